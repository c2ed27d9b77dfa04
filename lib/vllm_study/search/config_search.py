"""A search over engine arguments instead of a grid (a study's `search:`).

Optuna proposes each trial's configuration (a well-kept library: TPE by default, others
by name) from what the earlier trials measured; its journal lives in the run folder
(search.journal), so `--resume` continues a search on another machine. One trial is one
server start of one point. This module holds the loop, written against what a trial
measured (a PointSummary), so the same code runs live starts (sweep.py) and a completed
grid read back as an oracle (benchmarks/search_oracle.py).

What the loop adds to Optuna's ask/tell:
- a configuration that vLLM's rules or the study's `when:` conditions reject is told
  as a failed trial with the reason and never starts;
- a trial whose start failed (out of memory, KV cache too small, arguments refused, a
  server that never became healthy) is a failed trial with its reason, never a score;
  and a configuration *like* one that crashed is not started again: identical, or, for
  a memory failure, asking at least as much of the short resource (`LIKE_CRASHED`);
- the SLO is told to the sampler as a constraint (bound / limit - 1 per bound, feasible
  at <= 0), not folded into the score;
- a configuration already measured is not started again: it is told the value it had;
- the trial budget counts server starts only.

Afterwards the top_k feasible configurations and vLLM's defaults get fresh starts in
shuffled blocks (`confirmation_units`); the decision reads those starts only, since the
trials' own starts are the ones that were selected for looking good.
"""
from __future__ import annotations

import math
import random
import re
import threading
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import optuna
from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution
from optuna.trial import TrialState

from ..define.grid import DEFAULTS_POINT, PointPlan, Unit, launch_limits, live_axes, point_id, search_sharing
from ..define.search_space import CONDITION, FloatRange, IntRange, Search
from ..define.params import Study
from ..define.schema import StudyError

JOURNAL = "search.journal"
MAX_SKIPS = 100  # proposals in a row that start nothing: the space has nothing new the sampler would try
# TPE on a small discrete space converges and proposes what it has measured, over and
# over; after this many proposals in a row that start nothing, one new configuration is
# drawn at random instead (and marked so in the journal)
RANDOM_AFTER = 20
# Proposals with a start's restart knobs held that may start nothing before the start
# serves the trials it has: a small live space runs out of new values quickly.
ALONGSIDE_TRIES = 20
TRIAL_BLOCK = 1  # the trials' block in the run order; confirmation blocks follow it

# Failure classes, first match wins: (name, what the reason says, knobs that make it worse:
# +1 higher asks more, -1 lower does). A candidate is like a crashed config when every
# knob is equal except these, which are at least as bad.
LIKE_CRASHED = (
    ("out of memory", re.compile(r"out of memory|OutOfMemoryError|OOM", re.I),
     {"gpu_memory_utilization": +1, "max_num_batched_tokens": +1, "max_num_seqs": +1, "max_model_len": +1,
      "kv_cache_memory_bytes": +1}),
    ("KV cache too small", re.compile(r"KV cache|cache blocks|maximum number of tokens that can be stored", re.I),
     {"gpu_memory_utilization": -1, "kv_cache_memory_bytes": -1, "max_model_len": +1}),
)

optuna.logging.set_verbosity(optuna.logging.WARNING)  # the kit prints what a trial did itself


def distributions(space: dict) -> dict[str, optuna.distributions.BaseDistribution]:
    out = {}
    for name, dim in space.items():
        if isinstance(dim, IntRange):
            out[name] = IntDistribution(dim.int[0], dim.int[1], log=dim.log, step=dim.step)
        elif isinstance(dim, FloatRange):
            out[name] = FloatDistribution(dim.float[0], dim.float[1], step=dim.step)
        else:
            out[name] = CategoricalDistribution(dim)
    return out


def make_sampler(spec: Search) -> optuna.samplers.BaseSampler:
    """Optuna's sampler by name. The SLO reaches those that use constraints (TPE, GP,
    NSGA-II) through each trial's set_constraint."""
    n0 = spec.n_startup
    if spec.sampler == "tpe":  # multivariate: the knobs interact (chunk size and max_num_seqs)
        return optuna.samplers.TPESampler(seed=spec.seed, n_startup_trials=n0, multivariate=True, constant_liar=True)
    if spec.sampler == "gp":
        return optuna.samplers.GPSampler(seed=spec.seed, n_startup_trials=n0)
    if spec.sampler == "nsga2":
        return optuna.samplers.NSGAIISampler(seed=spec.seed)
    if spec.sampler == "qmc":
        return optuna.samplers.QMCSampler(seed=spec.seed)
    return optuna.samplers.RandomSampler(seed=spec.seed)


_OPS = {"<=": lambda a, b: a <= b, ">=": lambda a, b: a >= b, "==": lambda a, b: a == b,
        "!=": lambda a, b: a != b, "<": lambda a, b: a < b, ">": lambda a, b: a > b}


def conditions_failed(when: list[str], values: dict) -> list[str]:
    """The `when:` conditions a configuration breaks; `values` holds the fixed engine args
    too. A condition naming a knob that is unset (vLLM's default) is not judged."""
    broken = []
    for cond in when:
        a, op, b = re.match(CONDITION, cond).groups()
        x, y = (values.get(s) if s[0].isalpha() or s[0] == "_" else float(s) for s in (a, b))
        if x is not None and y is not None and not _OPS[op](x, y):
            broken.append(f"{cond} ({a}={x:g}, {b}={y:g})" if isinstance(x, (int, float)) else cond)
    return broken


def failure_class(reason: str) -> tuple[str, dict[str, int]]:
    for name, pattern, worse in LIKE_CRASHED:
        if pattern.search(reason or ""):
            return name, worse
    return "", {}


def like(crashed: dict, candidate: dict, worse: dict[str, int]) -> bool:
    """Whether `candidate` asks at least what `crashed` asked of the resource its failure
    ran short of (and equals it elsewhere); with no class, whether they are identical."""
    for k in set(crashed) | set(candidate):
        a, b = crashed.get(k), candidate.get(k)
        sign = worse.get(k, 0)
        if a == b:
            continue
        if not sign or a is None or b is None or isinstance(a, bool) or sign * (b - a) < 0:
            return False
    return True


@dataclass
class TrialOutcome:
    """What one trial measured: the objective (None: not measured), the SLO constraints,
    or why its start failed."""
    value: float | None = None
    constraints: dict[str, float] = field(default_factory=dict)  # name -> bound / limit - 1 (feasible at <= 0)
    failed: str | None = None


def outcome_of(summary, study: Study, folder=None) -> TrialOutcome:
    """A trial's outcome from its point's summary (one start). In a capacity study with the
    trial's point folder, the capacity every table and answer states (capacity.estimate:
    the margins' fit), not the highest load that met the SLO."""
    spec = study.search
    if summary is None or summary.status in ("failed", "running"):
        why = "; ".join(summary.reasons) if summary and summary.reasons else "the start recorded no outcome"
        return TrialOutcome(failed=why)
    fitted = _fitted_outcome(folder, study) if study.capacity and folder is not None else None
    if fitted is not None:
        return fitted
    est = summary.estimates.get(spec.objective)
    if study.capacity:  # capacity is within the SLO by construction: infeasible where even the lowest load missed
        if est is not None:
            return TrialOutcome(est.median, {"slo_at_lowest_load": -1.0})
        # missed at its lowest load: its value is that load, a bound above its capacity (never 0),
        # and the trial is infeasible, so the sampler never ranks it among the measured ones
        bounds = [b[spec.objective] for b in summary.capacity_below if b.get(spec.objective) is not None]
        if bounds:
            return TrialOutcome(max(bounds), {"slo_at_lowest_load": 1.0})
    if est is None:
        return TrialOutcome(failed=f"{spec.objective} was not measured")
    cons = {}
    for bound, limit in study.slo.items():
        e = summary.estimates.get(bound)
        cons[bound] = e.median / limit - 1 if e else 1.0
    return TrialOutcome(est.median, cons)


def _fitted_outcome(folder, study: Study) -> TrialOutcome | None:
    """The trial start's fitted capacity in the objective's unit: a value or an "at least"
    bound is feasible; "below" the lowest load is its bound, infeasible (never 0). None:
    no capacity record to fit (the summary's figures are used)."""
    from ..records.point_capacity import point_capacities
    c = study.capacity
    pc = point_capacities({folder.id: (folder, {1})}, c.slo, c.lo).get(folder.id)
    if pc is None or pc.config.kind == "unresolved":
        return None
    k = pc.config
    value = pc.rps(k.value) if study.search.objective == "capacity_rps" and pc.rps_per_load else k.value
    if value is None:
        return None
    return TrialOutcome(value, {"slo_at_lowest_load": 1.0 if k.kind == "below" else -1.0})


@dataclass
class Proposal:
    number: int
    values: dict


class SearchLoop:
    """Optuna's study behind the rules above. `check(values)`: why vLLM would refuse a
    configuration (empty: it may start), e.g. grid.PointMaker. Thread-safe: proposals
    and outcomes may come from the executor's threads."""

    def __init__(self, spec: Search, name: str, storage, check, fixed: dict | None = None):
        self.spec, self.check, self.fixed = spec, check, fixed or {}
        self.dists = distributions(spec.space)
        self.study = optuna.create_study(study_name=name, storage=storage, direction=spec.goal,
                                         sampler=make_sampler(spec), load_if_exists=True)
        self.lock = threading.Lock()
        self.live: dict[int, optuna.trial.Trial] = {}
        self.stop_note: str | None = None
        if not self.study.trials:
            for cfg in spec.first:
                self.study.enqueue_trial(cfg, skip_if_exists=True)

    @classmethod
    def in_run(cls, run_path: Path, study: Study, check) -> "SearchLoop":
        from optuna.storages import JournalStorage
        from optuna.storages.journal import JournalFileBackend
        storage = JournalStorage(JournalFileBackend(str(Path(run_path) / JOURNAL)))
        return cls(study.search, study.name, storage, check, fixed=study.engine_args.model_dump(exclude_none=True))

    # -- what has been done --------------------------------------------------------
    def trials(self, states=None) -> list[optuna.trial.FrozenTrial]:
        return self.study.get_trials(deepcopy=False, states=states)

    def started(self) -> list[optuna.trial.FrozenTrial]:
        """Trials that started a server (skipped proposals did not)."""
        return [t for t in self.trials() if "point" in t.user_attrs]

    def running_points(self) -> dict[str, int]:
        """point id -> trial number, for trials that started and have no outcome yet."""
        return {t.user_attrs["point"]: t.number for t in self.trials((TrialState.RUNNING,)) if "point" in t.user_attrs}

    def _ordered(self, params: dict) -> dict:
        return {k: params[k] for k in self.spec.space if k in params}

    # -- asking --------------------------------------------------------------------
    def propose(self) -> Proposal | None:
        """The next configuration to start, or None: the budget is spent, or the sampler
        keeps proposing what cannot or need not start (stop_note says which)."""
        with self.lock:
            p = self._ask(MAX_SKIPS, RANDOM_AFTER)
            if p is False:
                self.stop_note = (f"the sampler proposed {MAX_SKIPS} configurations in a row that were refused, "
                                  "like one that crashed or already measured: the space holds nothing new it "
                                  "would try")
                return None
            return p

    def propose_alongside(self, lead: Proposal, fixed: dict) -> Proposal | None:
        """One more configuration for the start planned for `lead` (live knobs): the
        sampler's own proposal with the knobs in `fixed` held at the lead's values
        (Optuna's PartialFixedSampler), or None where the budget is spent, a queued
        configuration waits (search.first, which no sampler overrides), or ALONGSIDE_TRIES
        proposals in a row start nothing (the start then serves fewer trials)."""
        with self.lock:
            if self.study.get_trials(deepcopy=False, states=(TrialState.WAITING,)):
                return None
            base = self.study.sampler
            # marked experimental since Optuna 2.4: tests/search/test_unit_search_live_batch.py checks our use
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                self.study.sampler = optuna.samplers.PartialFixedSampler(fixed, base)
            try:
                p = self._ask(ALONGSIDE_TRIES, None)
            finally:
                self.study.sampler = base
            if p:
                self.live[p.number].set_user_attr("alongside", lead.number)
            return p or None

    def mark_launch(self, numbers: list[int], launch: dict) -> None:
        """The limits a shared start was launched at, above some of its trials' own: a
        crash of that start is judged at these values (_skip), not at each trial's."""
        with self.lock:
            for n in numbers:
                self.live[n].set_user_attr("launched_at", launch)

    def _ask(self, tries: int, random_after: int | None) -> Proposal | None | bool:
        """A configuration to start; None: the budget is spent; False: `tries` proposals in
        a row were refused, measured already or like a crash (each told so)."""
        for skips in range(tries):
            if len(self.started()) >= self.spec.trials:
                return None
            self._close_stale()
            drawn = random_after is not None and skips >= random_after and self._enqueue_random(skips)
            trial = self.study.ask(self.dists)
            values = self._ordered(trial.params)
            skip = self._skip(values)
            if skip is None:
                if drawn:
                    trial.set_user_attr("drawn_at_random", f"after {skips} proposals in a row that started "
                                                           "nothing (measured, refused or like a crash)")
                trial.set_user_attr("point", point_id(values))
                self.live[trial.number] = trial
                return Proposal(trial.number, values)
            kind, detail, value, cons = skip
            trial.set_user_attr(kind, detail)
            if value is None:
                self.study.tell(trial, state=TrialState.FAIL)
            else:
                _tell(self.study, trial, value, cons)
        return False

    def _enqueue_random(self, salt: int) -> bool:
        """Queue one configuration drawn at random that would start; False if 200 draws
        found none."""
        rng = random.Random(f"{self.spec.seed}/{len(self.trials())}/{salt}")
        for _ in range(200):
            values = {k: _draw(d, rng) for k, d in self.dists.items()}
            if self._skip(values) is None:
                self.study.enqueue_trial(values)
                return True
        return False

    def _close_stale(self) -> None:
        """A RUNNING trial that never got a point (a search stopped between ask and start)."""
        for t in self.trials((TrialState.RUNNING,)):
            if "point" not in t.user_attrs and t.number not in self.live:
                self.study.tell(t.number, state=TrialState.FAIL)

    def _skip(self, values: dict):
        """(attr, detail, value to tell or None for a failed trial, constraints) for a
        configuration that is not started; None for one that is."""
        merged = {**self.fixed, **values}
        broken = conditions_failed(self.spec.when, merged)
        if broken:
            return "rejected", "breaks search.when: " + "; ".join(broken), None, ()
        refused = self.check(values)
        if refused:
            return "rejected", " ".join(s.strip() for s in refused), None, ()
        for t in self.trials((TrialState.FAIL,)):
            if "failed" not in t.user_attrs:
                continue
            cls, worse = failure_class(t.user_attrs["failed"])
            # a shared start's crash happened at the limits it was launched at
            if like({**self._ordered(t.params), **t.user_attrs.get("launched_at", {})}, values, worse):
                what = f"{cls} " if cls else ""
                return "like_crashed", f"like trial {t.number} ({what}failure: {t.user_attrs['failed'][:160]})", \
                    None, ()
        for t in self.trials((TrialState.COMPLETE, TrialState.RUNNING)):
            if "point" in t.user_attrs and self._ordered(t.params) == values:
                if t.state == TrialState.RUNNING:
                    return "repeat_of", f"trial {t.number}, still running", None, ()
                return "repeat_of", f"trial {t.number}", t.value, dict(t.constraints)
        return None

    # -- telling -------------------------------------------------------------------
    def record(self, number: int, outcome: TrialOutcome) -> None:
        with self.lock:
            trial = self.live.pop(number, None) or optuna.trial.Trial(self.study, self._trial_id(number))
            if outcome.failed or outcome.value is None:
                trial.set_user_attr("failed", outcome.failed or "not measured")
                self.study.tell(trial, state=TrialState.FAIL)
            else:
                _tell(self.study, trial, outcome.value, outcome.constraints)

    def _trial_id(self, number: int) -> int:
        return next(t._trial_id for t in self.trials() if t.number == number)

    # -- the answer ------------------------------------------------------------------
    def feasible(self) -> list[optuna.trial.FrozenTrial]:
        """Completed trials that started a server and met every constraint, best first."""
        done = [t for t in self.trials((TrialState.COMPLETE,)) if "point" in t.user_attrs and feasible(t)]
        return sorted(done, key=lambda t: t.value, reverse=self.study.direction.name == "MAXIMIZE")

    def top(self, k: int) -> list[str]:
        return [t.user_attrs["point"] for t in self.feasible()[:k]]


def _draw(d, rng: random.Random):
    """One value of an Optuna distribution, uniformly (on the log scale where it is log)."""
    if isinstance(d, CategoricalDistribution):
        return rng.choice(d.choices)
    if isinstance(d, IntDistribution):
        if d.log:
            return min(d.high, max(d.low, round(math.exp(rng.uniform(math.log(d.low), math.log(d.high))))))
        return rng.randrange(d.low, d.high + 1, d.step)
    steps = round((d.high - d.low) / d.step)
    return round(d.low + d.step * rng.randint(0, steps), 10)


def _tell(study: optuna.Study, trial: optuna.trial.Trial, value: float, constraints: dict[str, float]) -> None:
    for name, c in constraints.items():
        trial.set_constraint(name, c)
    study.tell(trial, value)


def feasible(trial: optuna.trial.FrozenTrial) -> bool:
    """Every constraint met (Optuna's rule: a constraint value of 0 or less)."""
    return all(c <= 0 for c in trial.constraints.values())


# -- the run's side: points, units and the confirmation blocks ------------------------------
def confirmation_units(run, study: Study, top: list[str]) -> list[Unit]:
    """confirm_starts blocks over the top configurations and vLLM's defaults, each block
    shuffled with its own seed; appended to the manifest's order (so --resume runs
    them), with each point's plan updated to the starts it now has."""
    manifest = run.manifest()
    if any(u.block > TRIAL_BLOCK for u in manifest.order):  # planned already (a resumed run)
        return []
    ids = list(dict.fromkeys(top + [DEFAULTS_POINT]))
    have = {pid: sum(pid in u.points for u in manifest.order) for pid in ids}  # a shared start counts too
    units = []
    for b in range(1, study.search.confirm_starts + 1):
        order = list(ids)
        random.Random(f"{study.order_seed}/confirm/{b}").shuffle(order)
        units += [Unit(point=pid, start=have[pid] + b, block=TRIAL_BLOCK + b) for pid in order]
    for pid in ids:
        folder = run.point(pid)
        plan = folder.plan()
        # a trial's point plans one start, then its confirmation starts too
        folder.save_plan(plan.model_copy(update={"starts": have[pid] + study.search.confirm_starts}))
    manifest.order += units
    manifest.save(run.manifest_path)
    return units


class TrialSource:
    """The trials as units, for the sweep's dispatcher: each next() asks the loop for a
    configuration, writes its point's plan and appends its unit to the run order.
    len() is how many trials the budget leaves (the dispatcher's 'left' count).

    With live knobs on (server.live_knobs, search.live_batch > 1), one start serves up to
    live_batch trials: the sampler's proposal, then proposals with every knob a restart
    needs held at its values, so they differ only in the scheduler limits the kit's plugin
    changes between rounds. The start is launched at the largest of those limits, each
    trial measured under its own (live_start.py); a trial keeps its own point folder, plan
    and outcome. The confirmation starts stay fresh starts of one point each."""

    def __init__(self, loop: SearchLoop, run, study: Study, maker, engine: str):
        self.loop, self.run, self.study, self.maker, self.engine = loop, run, study, maker, engine
        self.points: dict[str, int] = {}   # point id -> trial number
        self.left = max(0, study.search.trials - len(loop.started()))
        self.batch = study.search.live_batch if search_sharing(study, engine)[1] is None else 1
        self.queue: list[Unit] = []        # trials of a batch whose shared launch vLLM refused: a start each

    def __len__(self) -> int:
        return self.left

    def __iter__(self):
        return self

    def __next__(self) -> Unit:
        if self.queue:
            return self.queue.pop(0)
        p = self.loop.propose()
        if p is None:
            raise StopIteration
        lead = self._point(p)
        batch = [(p, lead)]
        fixed = {k: v for k, v in p.values.items() if k not in live_axes(lead.engine_args)}
        if len(fixed) < len(p.values):  # a live knob to vary within one start (a space may turn chunked prefill off)
            while len(batch) < self.batch and (q := self.loop.propose_alongside(p, fixed)) is not None:
                batch.append((q, self._point(q)))
        points = [pt for _, pt in batch]
        launch = launch_limits(points)
        if launch and self.maker.make({**p.values, **launch})[1]:
            # vLLM would refuse the launch at the batch's largest limits: a start each
            units = [self._plan(pt, [pt]) for pt in points]
            self.queue += units[1:]
            return units[0]
        if launch:
            self.loop.mark_launch([q.number for q, _ in batch], launch)
        return self._plan(lead, points, launch or None)

    def _point(self, p: Proposal):
        point, problems = self.maker.make(p.values)
        if point is None:  # check() said yes a moment ago: nothing should differ
            raise StudyError("\n".join(problems))
        self.points[point.id] = p.number
        return point

    def _plan(self, lead, points: list, launch: dict | None = None) -> Unit:
        """Each point's plan (the lead's with the limits its start is launched at) and the
        start's unit appended to the run order."""
        for pt in points:
            self.run.point(pt.id).save_plan(PointPlan(study=self.study, point=pt, engine=self.engine, starts=1,
                                                      launch=launch if pt is lead else None))
        manifest = self.run.manifest()
        unit = Unit(point=lead.id, start=1, block=TRIAL_BLOCK,
                    serves=[pt.id for pt in points] if len(points) > 1 else [])
        manifest.points += [pt.id for pt in points]
        manifest.order.append(unit)
        manifest.save(self.run.manifest_path)
        return unit

    def done(self, unit: Unit, summary) -> None:
        """Each trial the unit's start served is told its outcome (a served point's from
        its own folder; the lead's is `summary`)."""
        for pid in unit.points:
            number = self.points.pop(pid, None)
            if number is None:
                number = self.loop.running_points().get(pid)
            if number is not None and unit.block == TRIAL_BLOCK:
                folder = self.run.point(pid)
                self.loop.record(number, outcome_of(summary if pid == unit.point else folder.summary(),
                                                    self.study, folder))


def checker(maker):
    """check(values) for SearchLoop: the problems PointMaker finds at a configuration."""
    def check(values: dict) -> list[str]:
        return maker.make(values)[1]
    return check


def run_offline(loop: SearchLoop, measure) -> SearchLoop:
    """The loop driven by a function instead of server starts: measure(values) -> TrialOutcome
    (the unit tests' synthetic objectives, the oracle benchmark's grid)."""
    while (p := loop.propose()) is not None:
        loop.record(p.number, measure(p.values))
    return loop
