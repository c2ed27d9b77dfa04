"""The study's `predict:` stage (define/predict_spec.py): after the seed points' real
starts, every grid point's capacity predicted from a step-time model fitted to their
step records, each interval widened by the model's end-to-end error measured so far,
the points ranked, and the top `confirm_top` and the baseline measured in real starts.
Then, up to `passes` times, the grid is predicted again from every step so far (the
model refitted, its error now measured at the top's starts too) and its new top
measured; confirmation takes over until resolved. predictions.json in the run folder
keeps the latest pass and every earlier one; after each real start the model's refit is
recorded and the prediction of every measured point set beside its measurement
(report/predict_section.py).

    units = plan_confirmation(run, study)    # the next pass, and a first start of its new top
    refit(run)                               # after a real start: the model's new version

A leading point's capacity is the median over `draws` streams of the step model's
spread (a capacity bound by a P99 sits on the draws: three configs that run alike
predicted 0.90, 0.96 and 1.03 x from a stream each in
results/20261207T035231Z-h100-mooncake-predict-confirm-82eaa0b); the grid is screened on
one stream and only its leading points drawn again, since every stream costs a
simulation of every point it is drawn for.

A point the model cannot predict (outside its scope, no measured KV pool like its own)
is kept with its reason ("not predicted: ..."), never dropped.
"""
from __future__ import annotations

import math
import random
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

import numpy as np
from pydantic import BaseModel

from ..define.grid import Unit
from ..define.params import Study
from ..define.predict_spec import seed_points
from ..records.point_capacity import point_capacities
from ..records.results import Launch, RunFolder, write_atomic
from . import step_model
from .replay import predict_capacity, replay_start

PREDICTIONS = "predictions.json"
# the simulator's bracket, finer than a real start can afford (1 to 85 s of one loaded core a config in
# results/predict-space/20261207-cpu): a point estimate
FINE_PRECISION, FINE_STEPS = 0.02, 14
NOT_PREDICTED = "not predicted"


class ModelVersion(BaseModel):
    """A fit of the step model: what it saw, and its own held-out per-step error."""
    starts: list[str]                 # point#s<k> whose steps it was fitted on
    rounds: int
    steps: int
    held_out_median: float | None = None
    held_out_p90: float | None = None
    coef: dict[str, float] = {}
    left_out: dict[str, str] = {}     # a term held at 0, and why (StepModel.left_out)
    # after a real start: |predicted / measured - 1| of each measured point's capacity then
    errors: dict[str, float] = {}


class PointPrediction(BaseModel):
    point: str
    values: dict = {}
    verdict: str                      # "predicted", or "not predicted: <why>"
    over: str | None = None
    value: float | None = None        # the predicted capacity (the fine bracket's geometric middle, or its bound)
    censored: str | None = None       # "above": at least value (hi met); "below": below the floor
    bracket: tuple[float | None, float | None] | None = None  # the simulated bracket (met, missed)
    low: float | None = None          # value widened by the end-to-end error (None: open, or no error measured)
    high: float | None = None
    sim_wall_s: float | None = None
    rank: int | None = None           # 1 = the highest predicted capacity
    # a leading point's capacity in each stream of draws, (value, censored); value is their
    # median stream's. Empty: one stream (value's own)
    draws: list[tuple[float | None, str | None]] = []

    @property
    def predicted(self) -> bool:
        return self.verdict == "predicted"


class EndToEnd(BaseModel):
    """The model's end-to-end error so far: predicted against measured on the measured
    starts themselves. capacity: |predicted / measured - 1| of each measured point's
    capacity; replay: |predicted / measured - 1| of the SLO's figures over every replayed
    round. widen: the factor each interval carries (max of the capacity errors and the
    replay's P90: a capacity moves with the SLO figure that binds it, and the capacity
    errors are few)."""
    capacity: dict[str, float] = {}
    replay_rounds: int = 0
    replay_p90: float | None = None
    widen: float | None = None


class Pass(BaseModel):
    """One prediction of the grid: the model it used, its error then, every point, and
    the points it sent to real starts."""
    model: ModelVersion
    error: EndToEnd
    points: list[PointPrediction]
    chosen: list[str]                 # measured in real starts on this prediction: the top and the baseline

    def of(self, point: str) -> PointPrediction | None:
        return next((p for p in self.points if p.point == point), None)


class Predictions(Pass):
    """The latest pass, with the earlier ones (oldest first)."""
    seeds: list[str]
    refits: list[ModelVersion] = []   # the model refitted after each later real start
    earlier: list[Pass] = []

    @property
    def passes(self) -> list[Pass]:
        return [*self.earlier, self]

    def chosen_in(self, point: str) -> int | None:
        """The 1-based pass that first sent `point` to a real start (None: none did)."""
        return next((i for i, p in enumerate(self.passes, 1) if point in p.chosen), None)

    def save(self, run: RunFolder) -> None:
        write_atomic(run.path / PREDICTIONS, self.model_dump_json(indent=1) + "\n")


def read(path: str | Path) -> Predictions | None:
    f = Path(path) / PREDICTIONS
    return Predictions.model_validate_json(f.read_text()) if f.exists() else None


# -- the model -------------------------------------------------------------------------
def measured_starts(run: RunFolder) -> list[tuple[str, Path, object]]:
    """(point, start folder, record) of every completed start with step records."""
    out = []
    for pid in run.point_ids():
        folder = run.point(pid)
        for rec in folder.starts():
            d = folder.start_dir(rec.start)
            if rec.status == "ok" and any((d / "steps").glob("r*.npz")):
                out.append((pid, d, rec))
    return out


def fit(run: RunFolder) -> tuple[list[step_model.StepModel], ModelVersion]:
    """One model a scope of the run's step records so far (step_model.fit_run), and the
    version the predictions name: the starts, rounds and steps it saw."""
    models = step_model.fit_run(run.path)
    if not models:
        raise ValueError(f"{run.path}: no start recorded its engine steps (steps/r<k>.npz): nothing to fit")
    main = max(models, key=lambda m: m.steps)
    starts = [f"{p}#s{rec.start}" for p, _, rec in measured_starts(run)]
    h = main.held_out
    return models, ModelVersion(starts=starts, rounds=sum(m.rounds for m in models),
                                steps=sum(m.steps for m in models), held_out_median=h.median if h else None,
                                held_out_p90=h.p90 if h else None, coef=main.coef,
                                left_out=main.left_out)


def refit(run: RunFolder, study: Study | None = None) -> ModelVersion | None:
    """After a real start: the model fitted again from every start's steps, its version
    appended to predictions.json with the error of each measured point's prediction then
    (None where the run has no predictions)."""
    pred = read(run.path)
    if pred is None:
        return None
    _, version = fit(run)
    if study is None:
        from ..define.study_file import load_study
        study = load_study(run.study_path)
    version.errors = capacity_errors(measured_capacities(run, study), {p.point: p for p in pred.points})
    if not pred.refits or pred.refits[-1].starts != version.starts:
        pred.refits.append(version)
        pred.save(run)
    return version


# -- what each point is predicted with ---------------------------------------------------
def _kv_key(plan) -> tuple:
    """What sets a start's KV pool besides the machine: a measured start's pool stands for a
    point that shares these (on the CPU engine, the pool is kv_cache_memory_bytes)."""
    a, e = plan.point.engine_args, plan.point.effective
    return (a.kv_cache_memory_bytes, a.gpu_memory_utilization, e.block_size if e else a.block_size,
            e.dtype if e else a.dtype, a.tensor_parallel_size)


def tasks(run: RunFolder, models: list[step_model.StepModel], plans: list | None = None
          ) -> tuple[list[tuple], list[PointPrediction]]:
    """(point id, plan, model, cache_config) for each point the model can predict, and a
    "not predicted" record (with its reason) for each other. `plans`: the points to predict
    (define.grid.PointPlan; default: every point of the run), their KV pools and scope read
    from the run's measured starts."""
    manifest = run.manifest()
    seen = measured_starts(run)
    pools = {}
    for pid, _, rec in seen:
        pools.setdefault(_kv_key(run.point(pid).plan()), rec)
    todo, refused = [], []
    for plan in plans if plans is not None else [run.point(pid).plan() for pid in manifest.points]:
        pid = plan.point.id
        like = pools.get(_kv_key(plan))
        if like is None:
            refused.append(PointPrediction(point=pid, values=plan.point.values, verdict=(
                f"{NOT_PREDICTED}: no measured start has its KV pool (kv_cache_memory_bytes, "
                "gpu_memory_utilization, block_size, dtype, tensor_parallel_size): seed a point like it")))
            continue
        cache = {"num_gpu_blocks": like.launch.cache_config.get("num_gpu_blocks"),
                 "block_size": like.launch.cache_config.get("block_size"),
                 "enable_prefix_caching": str(plan.point.engine_args.enable_prefix_caching is not False)}
        scope = step_model.scope_of(plan, like, Launch(cache_config=cache), manifest)
        why = []
        for m in models:
            try:
                m.check(scope)
                todo.append((pid, plan, m, cache))
                break
            except step_model.Extrapolation as e:
                why.append(str(e))
        else:
            refused.append(PointPrediction(point=pid, values=plan.point.values,
                                           verdict=f"{NOT_PREDICTED}: {why[0] if why else 'no model'}"))
    return todo, refused


_INPUTS: dict = {}   # a worker's StudyInputs (tokenizer, workloads), built once per study


def _inputs(study: Study):
    from .start import StudyInputs
    if study.name not in _INPUTS:
        _INPUTS[study.name] = StudyInputs(study)
    return _INPUTS[study.name]


def predict_one(task: tuple, stream: int = 0) -> PointPrediction:
    """One point's capacity in virtual time, on one stream of draws (a worker process's call)."""
    import time
    pid, plan, model, cache = task
    inputs = _inputs(plan.study)
    t0 = time.perf_counter()
    try:
        rec, _ = predict_capacity(plan, model, cache_config=cache, inputs=inputs,
                                  async_scheduling=plan.engine == "gpu", precision=FINE_PRECISION,
                                  max_steps=FINE_STEPS, stream=stream)
    except ValueError as e:   # vLLM's scheduler refused the point's settings: kept, with why
        return PointPrediction(point=pid, values=plan.point.values, verdict=f"{NOT_PREDICTED}: the simulation "
                               f"failed: {e}", sim_wall_s=time.perf_counter() - t0)
    met, missed = rec.bracket
    if rec.censored == "above" or missed is None:
        value = met
    elif rec.censored == "below" or met is None:
        value = missed
    else:
        value = math.sqrt(met * missed)
    return PointPrediction(point=pid, values=plan.point.values, verdict="predicted", over=rec.over, value=value,
                           censored=rec.censored, bracket=rec.bracket, sim_wall_s=time.perf_counter() - t0)


class Workers:
    """Where a prediction's simulations run: `n` processes (one: this process), or with
    on_ray one Ray task of one CPU each over the cluster the sweep's ray executor joined
    (ray.init: its address). Spawned, not forked: the sweep's threads and vLLM's imports
    do not survive a fork cleanly. Within `with`, one pool serves every stage (the
    screen, the draws, the replays): each spawned process imports vLLM and the
    tokenizer once, seconds a process, not once a stage."""

    def __init__(self, n: int, on_ray: bool = False):
        self.n, self.on_ray, self._pool = max(1, n), on_ray, None

    def __enter__(self) -> Workers:
        if not self.on_ray and self.n > 1:
            self._pool = ProcessPoolExecutor(self.n, mp_context=get_context("spawn"))
        return self

    def __exit__(self, *exc) -> None:
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None

    def map(self, fn, jobs: list[tuple]) -> list:
        """fn(*job) of each job, in order."""
        if self.on_ray:
            import ray
            ray.init(ignore_reinit_error=True, log_to_driver=False)   # joined already under --executor ray
            task = ray.remote(num_cpus=1, max_retries=0)(fn)
            return ray.get([task.remote(*job) for job in jobs])
        if self.n <= 1 or len(jobs) <= 1:
            return [fn(*job) for job in jobs]
        if self._pool is None:   # outside `with`: a pool for this map alone
            with Workers(min(self.n, len(jobs))) as w:
                return w.map(fn, jobs)
        return list(self._pool.map(fn, *zip(*jobs), chunksize=max(1, len(jobs) // (4 * self.n))))


def predict_all(todo: list[tuple], workers: int, on_ray: bool = False) -> list[PointPrediction]:
    """Every task's prediction on the study seed's own stream of draws."""
    return Workers(workers, on_ray).map(predict_one, [(t, 0) for t in todo])


_ORDER = {"above": 2, None: 1, "below": 0}   # a bound above hi outranks any value, one below the floor none


def _key(p: PointPrediction) -> tuple:
    return (_ORDER[p.censored], p.value)


def combine(streams: list[PointPrediction]) -> PointPrediction:
    """One point's predictions on several streams of draws as one: the median stream's
    (the lower middle of an even count: the cautious one), with every stream's capacity
    in `draws`. A stream the simulation refused makes the point's verdict that refusal."""
    if len(streams) == 1:
        return streams[0]
    if bad := next((p for p in streams if not p.predicted), None):
        return bad
    ordered = sorted(streams, key=_key)
    mid = ordered[(len(ordered) - 1) // 2].model_copy()
    mid.draws = [(p.value, p.censored) for p in streams]
    mid.sim_wall_s = sum(p.sim_wall_s or 0 for p in streams)
    return mid


def leading(points: list[PointPrediction], top: int) -> set[str]:
    """The points drawn again on more streams: the `top` highest predicted on one stream
    (a tie at the cut goes by grid order)."""
    return {p.point for p in sorted((p for p in points if p.predicted), key=_key, reverse=True)[:top]}


# -- the error, the intervals, the rank ---------------------------------------------------
def replay_one(start_dir: Path, model: step_model.StepModel) -> list[dict]:
    """A measured start's rounds replayed (replay_start; a worker process's call)."""
    from ..records.results import PointFolder
    return replay_start(start_dir, model, inputs=_inputs(PointFolder(start_dir.parent).plan().study))


def end_to_end(run: RunFolder, study: Study, models: list[step_model.StepModel],
               predicted: dict[str, PointPrediction], workers: Workers | None = None) -> EndToEnd:
    """The end-to-end error on what was measured so far (EndToEnd); the measured starts
    replayed on `workers` (default: in this process), as the points are predicted."""
    err = EndToEnd(capacity=capacity_errors(measured_capacities(run, study), predicted))
    slo = list(study.capacity.slo)
    jobs = [(d, next(m for m in models if _fits(m, run, pid, rec))) for pid, d, rec in measured_starts(run)
            if not rec.served_by and (p := predicted.get(pid)) and p.predicted]
    errs = []
    for rows in (workers or Workers(1)).map(replay_one, jobs):
        for row in rows:
            errs += [abs(row[f"predicted_{k}"] / row[f"measured_{k}"] - 1) for k in slo
                     if row.get(f"measured_{k}") and row.get(f"predicted_{k}") is not None]
    err.replay_rounds = len(errs)
    err.replay_p90 = float(np.quantile(errs, 0.9)) if errs else None
    parts = list(err.capacity.values()) + ([err.replay_p90] if errs else [])
    err.widen = max(parts) if parts else None
    return err


def _fits(model, run, pid, rec) -> bool:
    try:
        model.check(step_model.scope_of(run.point(pid).plan(), rec, rec.launch, run.manifest()))
        return True
    except step_model.Extrapolation:
        return False


def capacity_errors(measured: dict, predicted: dict[str, PointPrediction]) -> dict[str, float]:
    """|predicted / measured - 1| of each point whose capacity was measured as a value and
    predicted as one (a bound on either side has no ratio)."""
    return {pid: abs(p.value / pc.config.value - 1) for pid, pc in measured.items()
            if pc is not None and pc.config.kind == "value" and (p := predicted.get(pid)) is not None
            and p.predicted and not p.censored}


def measured_capacities(run: RunFolder, study: Study) -> dict:
    """Each point's measured capacity over its completed starts (None: not measured)."""
    return point_capacities({p: (run.point(p), None) for p in run.point_ids()}, study.capacity.slo,
                            study.capacity.lo)


def widen(p: PointPrediction, e: float | None) -> PointPrediction:
    """The predicted value's interval: [value / (1 + e), value * (1 + e)], stretched to
    take in every stream's capacity where it was drawn on several; a bound keeps its open
    side (and a stream's bound opens that side); no error measured yet: no interval."""
    if not p.predicted or e is None:
        return p
    if p.censored == "above":
        p.low, p.high = p.value / (1 + e), None
    elif p.censored == "below":
        p.low, p.high = None, p.value * (1 + e)
    else:
        p.low, p.high = p.value / (1 + e), p.value * (1 + e)
    for v, censored in p.draws:   # and every stream's capacity: the draws' own spread
        p.low = None if p.low is None or censored == "below" else min(p.low, v)
        p.high = None if p.high is None or censored == "above" else max(p.high, v)
    return p


def rank(points: list[PointPrediction]) -> list[PointPrediction]:
    """Predicted points numbered from the highest capacity (at or above hi first, below
    the floor last); the others are left unranked."""
    ranked = sorted((p for p in points if p.predicted), key=_key, reverse=True)
    for i, p in enumerate(ranked, 1):
        p.rank = i
    return ranked


def choose(points: list[PointPrediction], top: int, baseline: str) -> list[str]:
    """The `top` highest-ranked points other than the baseline, then the baseline: each of
    them is a comparison confirmation can resolve."""
    best = [p.point for p in sorted((p for p in points if p.rank and p.point != baseline), key=lambda p: p.rank)]
    return best[:top] + [baseline]


# -- the stage ---------------------------------------------------------------------------
def predict(run: RunFolder, study: Study, workers: int | None = None, on_ray: bool = False) -> Predictions:
    """Fit, predict every point (its leaders on `draws` streams), measure the error,
    widen, rank, choose (not saved)."""
    models, version = fit(run)
    todo, refused = tasks(run, models)
    spec = study.predict
    with Workers(min(workers or spec.processes, max(1, len(todo))), on_ray) as w:   # no idle spawns
        by_id = {p.point: p for p in w.map(predict_one, [(t, 0) for t in todo])}
        spread = [t for t in todo if getattr(t[2], "spread", None)]   # without one every stream draws alike
        if spec.draws > 1 and spread:
            again = leading([by_id[t[0]] for t in spread], max(4 * spec.confirm_top, 12))
            jobs = [(t, s) for t in spread if t[0] in again for s in range(1, spec.draws)]
            drawn: dict[str, list[PointPrediction]] = {}
            for (t, _), p in zip(jobs, w.map(predict_one, jobs)):
                drawn.setdefault(t[0], []).append(p)
            for pid, more in drawn.items():
                by_id[pid] = combine([by_id[pid], *more])
        err = end_to_end(run, study, models, by_id, w)
    points = [by_id.get(pid) or next(r for r in refused if r.point == pid) for pid in run.manifest().points]
    for p in points:
        widen(p, err.widen)
    rank(points)
    seeds = seed_points(study, run.manifest().points)
    return Predictions(model=version, error=err, points=points, seeds=seeds,
                       chosen=choose(points, study.predict.confirm_top, study.baseline))


def next_pass(run: RunFolder, study: Study) -> int | None:
    """The 1-based number of the run's next pass, or None once `passes` are made."""
    before = read(run.path)
    n = 1 if before is None else len(before.passes) + 1
    return n if n <= study.predict.passes else None


def plan_confirmation(run: RunFolder, study: Study, workers: int | None = None, on_ray: bool = False) -> list[Unit]:
    """The next pass, once the last one's starts are measured (the seeds' for the first):
    the grid predicted (again), saved in predictions.json with the earlier passes, and one
    shuffled block of a first start of each chosen point not measured yet, appended to the
    manifest's order (so --resume runs it). Nothing new (and no pass) once `passes` are
    made; nothing new where a pass chose only points measured already."""
    if next_pass(run, study) is None:
        return []
    before = read(run.path)
    pred = predict(run, study, workers, on_ray)
    if before is not None:
        pred.seeds, pred.refits = before.seeds, before.refits
        pred.earlier = [*before.earlier, Pass(**{k: getattr(before, k) for k in Pass.model_fields})]
    pred.save(run)
    manifest = run.manifest()
    measured = {u.point for u in manifest.order} | {p for u in manifest.order for p in u.points}
    new = [p for p in pred.chosen if p not in measured]
    if not new:
        return []
    block = max(u.block for u in manifest.order) + 1
    random.Random(f"{study.order_seed}/{block}").shuffle(new)
    units = [Unit(point=p, start=1, block=block) for p in new]
    manifest.order += units
    manifest.save(run.manifest_path)
    return units
