"""The step-time model: how long one engine step takes, fitted from the step records of
the kit's real starts (scheduler_plugin/steps.py), for the simulator to advance its
virtual clock by.

    rounds = collect(run_dir)                       # [(rows, scope), ...], one a round
    model = fit([rows for rows, _ in rounds], rounds[0][1])
    model.check(scope_of_the_config)                # raises Extrapolation where it would guess
    seconds = model.predict(rows)                   # a round's rows, in order: one time a row
    seconds = model.own_s(row) + model.admission_s(next_row)   # the simulator's split of it

The form: a step's cycle (steps.cycles: output to output while busy) is

    c0 + c1 * prefill_tokens + c2 * prefill_reqs + c3 * decode_reqs + c4 * context_tokens
       + c5 * prefill_attention_pairs + c6 * next_prefill_tokens + c7 * next_prefill_reqs

with every c >= 0. A forward pass costs a fixed overhead (kernel launches, the
scheduler, sampling setup, the output's way back) plus work linear in the tokens it
computes (the GEMMs), in the requests it samples or prepares (per-request metadata,
a sampled token each) and in the KV it reads (attention over the context). Nonnegative
terms keep it physical where it extrapolates a little (more tokens never cost less);
an unconstrained fit can buy a better residual with a negative term that turns
predictions negative past the data. Decode tokens are decode requests without
speculative decoding, so they are not a separate term.

The attention term (c5) is what a prefill chunk's causal attention computes: n x c +
n (n + 1) / 2 query-key pairs for n tokens scheduled after c computed. A chunk late in
a long prompt reads all the KV before it, so at equal tokens its step costs more, and
more so the larger the chunk: within starts on one H100 the prefill chunks' context cut
the full-chunk steps' residual from 11.5% to 2.3-2.7% at chunk 2048, and its cost per
context token was 1.15 us at 2048 against 3.07 us at 8192, a product of chunk and
context (benchmarks/prefill_context_term.py). Kits before the column wrote 0 there; a
prefill row with 0 pairs cannot be (a chunk of n >= 1 tokens has n (n + 1) / 2 >= 1),
so a round is known to lack it, and the term is fitted only where every round of the
fit recorded it (left out, with why, otherwise: a term fitted on rows that hold 0 for
an unrecorded value would be biased toward 0). Fitted by least squares on the
seconds themselves (scipy.optimize.lsq_linear, bounds at 0): the simulator sums step
times, so an error that keeps the sum right beats one that keeps each ratio right.

The next-step terms (c5, c6) are where an async engine pays for admitting requests.
With async scheduling EngineCore schedules step k+1, and the model runner prepares its
inputs, while step k runs; the CPU work of a new request (its input tensors, block
table, sampling state) then lengthens step k's cycle, not k+1's. On one H100
(results/predict-vs-measured/20261207-h100-footprint) decode-only steps just before an
admitting step took 12.0 ms against 6.6 ms, and a row-wise model missed them by 44%.
A row's next_* features are the following row's prefill tokens and requests where that
step was scheduled while this one was in flight (t_scheduled[k+1] < t_done[k]), else
0: a sync engine never overlaps, so its next-step terms stay 0 and the form is the
row-wise one. The simulator charges them the same way (admission_s of the step it
schedules, added to the step in flight). A model saved before these terms loads with
them at 0.

Its scope: the model, device, dtype, vLLM version and engine the records came from, the
launch settings that change the kernels a step runs (max_num_batched_tokens and
max_num_seqs: torch.compile ranges and CUDA graph capture sizes; block_size,
enforce_eager, tensor_parallel_size), and each feature's observed range. ``check``
refuses a configuration outside it (Extrapolation says what differs and which start to
measure); the two limits may lie anywhere between the values fitted from. Rows' features
are refused only past RANGE_MARGIN times their fitted maximum: a round of the fitted
configuration itself reaches a request or a few context tokens past the rounds it was
fitted on (8 of 16 held-out rounds on the H100 did, 12-13 prefill requests where 11 were
fitted), and a term linear in a count keeps its slope well past the fitted top where
the launch settings (kernels, CUDA graph sizes) are the fitted ones, which the scope
check holds.

Its front end (predict/front_end.py: the time a request spends outside the engine,
fitted from the same runs' rounds) travels with it, its own scope checked apart.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from pydantic import BaseModel
from scipy.optimize import lsq_linear

from ..scheduler_plugin import steps
from . import front_end as fe
from .front_end import Extrapolation, FrontEnd

FEATURES = ("prefill_tokens", "prefill_reqs", "decode_reqs", "context_tokens", "prefill_attention_pairs")
RECORDED_LATER = ("prefill_attention_pairs",)   # step records from older kits hold 0 there
LEAD = ("prefill_tokens", "prefill_reqs")   # the next step's, charged to the step in flight (async)
TERMS = (("overhead_s",) + tuple(f"per_{f.removesuffix('s')}_s" for f in FEATURES)
         + tuple(f"per_next_{f.removesuffix('s')}_s" for f in LEAD))
OWN_TERMS, LEAD_TERMS = TERMS[:1 + len(FEATURES)], TERMS[1 + len(FEATURES):]
# a row's feature may reach this many times its fitted maximum before check refuses it
RANGE_MARGIN = 2.0
# launch settings that pick kernels: the same value, or (RANGED) within the fitted values
KERNEL_SETTINGS = ("max_num_batched_tokens", "max_num_seqs", "block_size", "enforce_eager", "tensor_parallel_size")
RANGED = ("max_num_batched_tokens", "max_num_seqs")
FOLDS = 5
# the spread: quantiles of measured / predicted step time, kept per kind of step
SPREAD_LEVELS = np.linspace(0, 1, 101)
SPREAD_TOP = 0.999   # the top level's quantile: one stray step (a GC pause) is not the tail


class Scope(BaseModel):
    """Where a step record (or a model fitted from them) comes from."""
    model: str
    device: str            # the GPU's name, or "cpu"
    dtype: str
    vllm_version: str
    engine: str            # "gpu" or "cpu"
    launch: dict[str, int | bool | None]  # KERNEL_SETTINGS


class HeldOut(BaseModel):
    """Per-step absolute relative error of the fit on rounds it did not see (K-fold,
    folds made of whole rounds: steps of one round are not independent)."""
    folds: int
    steps: int
    median: float
    p90: float


class StepModel(BaseModel):
    scope: Scope
    launches: list[dict[str, int | bool | None]]   # every launch the records came from
    coef: dict[str, float]                         # TERMS, in seconds
    ranges: dict[str, tuple[float, float]]         # each fitted feature's observed [min, max]
    rounds: int
    steps: int
    held_out: HeldOut | None = None
    held_out_why_not: str | None = None
    front_end: FrontEnd | None = None
    front_end_why_not: str | None = None
    left_out: dict[str, str] = {}                  # a term held at 0: why (its column not recorded)
    # "prefill" (steps computing prompt tokens) and "decode": SPREAD_LEVELS quantiles of
    # measured / predicted, held out where folds allow (None: a model saved before it)
    spread: dict[str, list[float]] | None = None

    def _c(self, terms) -> np.ndarray:
        return np.array([self.coef.get(t, 0.0) for t in terms])  # a term a saved model lacks: 0

    def predict(self, rows: np.ndarray) -> np.ndarray:
        """Seconds each row's step takes (rows of steps.DTYPE in schedule order, as a round's
        records hold them: FEATURES, and the next row's LEAD where it was scheduled while
        this step was in flight)."""
        return _design(rows) @ self._c(TERMS)

    def own_s(self, rows: np.ndarray) -> np.ndarray:
        """Seconds each row's step takes for its own work (no next step counted)."""
        return _design(rows, lead=False) @ self._c(OWN_TERMS)

    def admission_s(self, rows: np.ndarray) -> np.ndarray:
        """Seconds the step in flight takes longer for preparing each of these rows' step
        while it runs (async scheduling: the next-step terms)."""
        return np.column_stack([rows[f].astype(float) for f in LEAD]) @ self._c(LEAD_TERMS)

    def jitter(self, rows: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """A factor for each row's predicted time, drawn from the measured / predicted ratios
        of the fitted steps of its kind (1 where the model has no spread). The linear terms
        give a step's expected time; what a P99 (ITL, TTFT) sees is the tail around it: on
        one H100, steps with a full prefill chunk spread +-30% about the fit at equal
        features. Draws are independent between steps."""
        f = np.ones(len(rows))
        if not self.spread:
            return f
        u = rng.random(len(rows))
        prefill = rows["prefill_tokens"] > 0
        for kind, mask in (("prefill", prefill), ("decode", ~prefill)):
            q = self.spread.get(kind)
            if q and mask.any():
                f[mask] = np.interp(u[mask], SPREAD_LEVELS, q)
        return f

    def check(self, scope: Scope, rows: np.ndarray | None = None) -> None:
        """Raise Extrapolation unless `scope` (and `rows`' features, if given) lie where the
        model was fitted."""
        why = []
        mine = self.scope.model_dump()
        for key in ("model", "device", "dtype", "vllm_version", "engine"):
            if getattr(scope, key) != mine[key]:
                why.append(f"{key} {getattr(scope, key)!r} (fitted on {mine[key]!r})")
        for key in KERNEL_SETTINGS:
            asked, seen = scope.launch.get(key), sorted({la.get(key) for la in self.launches}, key=str)
            if key in RANGED and asked is not None and None not in seen:
                if not min(seen) <= asked <= max(seen):
                    why.append(f"{key}={asked} (fitted on {min(seen)}..{max(seen)})")
            elif asked not in seen:
                why.append(f"{key}={asked} (fitted on {', '.join(map(str, seen))})")
        if self.front_end is not None and self.front_end.scope.vllm_version != scope.vllm_version:
            why.append(f"its front end's vLLM {self.front_end.scope.vllm_version!r} (the configuration's "
                       f"{scope.vllm_version!r})")
        if rows is not None and len(rows):
            for f, (lo, hi) in self.ranges.items():   # a term left out is no range to keep to
                top = float(rows[f].max())
                if top > RANGE_MARGIN * hi:
                    why.append(f"{f} up to {top:g} (fitted on {lo:g}..{hi:g}; up to {RANGE_MARGIN:g} x "
                               f"{hi:g} is predicted)")
        if why:
            raise Extrapolation(
                "the step-time model would extrapolate: " + "; ".join(why) + ". Measure a start there "
                "(its step records refit the model), or predict within what was measured.")

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.write_text(self.model_dump_json(indent=1) + "\n")
        return path

    @classmethod
    def load(cls, path: str | Path) -> StepModel:
        return cls.model_validate_json(Path(path).read_text())


# -- fitting ---------------------------------------------------------------------------
def busy(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(rows of steps that ran tokens, their cycles in seconds), a round's rows in file order."""
    rows, c = with_lead(rows), steps.cycles(rows)
    keep = (rows["prefill_tokens"] + rows["decode_tokens"] > 0) & (c > 0)
    return rows[keep], c[keep]


LEAD_DTYPE = np.dtype(steps.DTYPE.descr + [(f"next_{f}", "f8") for f in LEAD])


def with_lead(rows: np.ndarray) -> np.ndarray:
    """A round's rows (in schedule order) with next_<LEAD> columns: the next row's
    features where that step was scheduled before this one's output was back, else 0.
    Rows that have them already are returned as they are."""
    if rows.dtype.names and "next_prefill_tokens" in rows.dtype.names:
        return rows
    out = np.zeros(len(rows), dtype=LEAD_DTYPE)
    for name in steps.DTYPE.names:
        out[name] = rows[name]
    if len(rows) > 1:
        overlap = rows["t_scheduled"][1:] < rows["t_done"][:-1]
        for f in LEAD:
            out[f"next_{f}"][:-1] = np.where(overlap, rows[f][1:], 0)
    return out


def _design(rows: np.ndarray, lead: bool = True) -> np.ndarray:
    cols = [np.ones(len(rows))] + [rows[f].astype(float) for f in FEATURES]
    if lead:
        rows = with_lead(rows)
        cols += [rows[f"next_{f}"].astype(float) for f in LEAD]
    return np.column_stack(cols)


def _solve(X: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Nonnegative least squares, columns scaled to 1 first (tokens of context run to 1e5
    where requests run to 1e2: unscaled, the solver's tolerance would be one column's)."""
    scale = np.abs(X).max(axis=0)
    used = scale > 0   # a term never seen (a sync engine's next-step terms): 0, not the solver's guess
    coef = np.zeros(X.shape[1])
    coef[used] = lsq_linear(X[:, used] / scale[used], y, bounds=(0, np.inf), method="bvls").x / scale[used]
    return coef


def fit(rounds: list[np.ndarray], scope: Scope, launches: list[dict] | None = None,
        folds: int = FOLDS, lead: bool = True) -> StepModel:
    """The model from rounds of step records (each a steps.DTYPE array, as
    steps.load_round gives) that share `scope` (`launches`: their launches' settings, the
    scope's alone by default). Its held-out error is K-fold with folds of whole rounds.
    lead=False: the row-wise form, the next-step terms held at 0 (to compare)."""
    parts = [busy(r) for r in rounds]
    parts = [(r, c) for r, c in parts if len(r)]
    if not parts:
        raise ValueError("no busy engine step in these records: nothing to fit a step time from")
    rows = np.concatenate([r for r, _ in parts])
    y = np.concatenate([c for _, c in parts])
    group = np.concatenate([np.full(len(r), i) for i, (r, _) in enumerate(parts)])
    X = _design(rows)
    if not lead:
        X[:, 1 + len(FEATURES):] = 0
    left_out = {}
    for f in RECORDED_LATER:
        lacking = sum(not recorded(r, f) for r, _ in parts)
        if lacking:
            X[:, 1 + FEATURES.index(f)] = 0
            left_out[f"per_{f.removesuffix('s')}_s"] = (
                f"{lacking} of {len(parts)} rounds were recorded by a kit that did not write {f}")
    coef = _solve(X, y)
    k = min(folds, len(parts))
    held, why_not = None, None
    guess = X @ coef
    if k >= 2:
        for fold in range(k):
            test = group % k == fold  # rounds dealt to the folds in turn
            guess[test] = X[test] @ _solve(X[~test], y[~test])
        err = np.abs(guess - y) / y
        held = HeldOut(folds=k, steps=len(y), median=float(np.median(err)), p90=float(np.quantile(err, 0.9)))
    else:
        why_not = "one round: no round to hold out"
    spread = _spread(rows, y, guess)
    fitted = [f for f in FEATURES if f"per_{f.removesuffix('s')}_s" not in left_out]
    return StepModel(scope=scope, launches=launches or [scope.launch], coef=dict(zip(TERMS, map(float, coef))),
                     ranges={f: (float(rows[f].min()), float(rows[f].max())) for f in fitted},
                     rounds=len(parts), steps=len(y), held_out=held, held_out_why_not=why_not, spread=spread,
                     left_out=left_out)


def recorded(rows: np.ndarray, feature: str) -> bool:
    """Whether a round's rows hold `feature` (one of RECORDED_LATER): no prefill row has 0
    there, which a recorded prefill chunk cannot have."""
    return not np.any((rows["prefill_tokens"] > 0) & (rows[feature] == 0))


def _spread(rows: np.ndarray, y: np.ndarray, guess: np.ndarray) -> dict[str, list[float]]:
    """Quantiles of measured / predicted per kind of step (a kind with under 20 steps has
    none: too few to give a tail)."""
    ok = guess > 0
    levels = np.minimum(SPREAD_LEVELS, SPREAD_TOP)
    out = {}
    for kind, mask in (("prefill", rows["prefill_tokens"] > 0), ("decode", rows["prefill_tokens"] == 0)):
        r = y[mask & ok] / guess[mask & ok]
        if len(r) >= 20:
            out[kind] = [float(v) for v in np.quantile(r, levels)]
    return out


# -- a run folder's records ------------------------------------------------------------
def collect(run_dir: str | Path) -> list[tuple[np.ndarray, Scope]]:
    """Every round's step records in a run folder, with the scope of the start it ran in
    (a shared live-knobs start's launch is its lead's)."""
    from ..records.results import RunFolder
    run = RunFolder(run_dir)
    manifest = run.manifest()
    out = []
    for pid in run.point_ids():
        folder = run.point(pid)
        plan = folder.plan()
        for start in folder.starts():
            start_dir = folder.start_dir(start.start)
            files = sorted((start_dir / steps.ROUNDS_DIR).glob("r*.npz"), key=lambda p: int(p.stem[1:]))
            if not files:
                continue
            launch = start.launch
            if start.served_by:
                lead_point, lead_start = start.served_by.split("/")
                launch = run.point(lead_point).start(int(lead_start.removeprefix("s"))).launch
            scope = scope_of(plan, start, launch, manifest)
            out += [(steps.load_round(f), scope) for f in files]
    return out


def scope_of(plan, start, launch, manifest) -> Scope:
    """A start's scope: vLLM's own account of its launch (the non-default args it logged,
    the KV block size it reported) over what the kit planned."""
    args = plan.point.engine_args.model_dump()
    eff = plan.point.effective.model_dump() if plan.point.effective else {}
    given = launch.vllm_non_default_args or {}
    settings = {}
    for key in KERNEL_SETTINGS:
        value = given.get(key, eff.get(key) if eff.get(key) is not None else args.get(key))
        settings[key] = value
    if launch.cache_config.get("block_size"):
        settings["block_size"] = int(launch.cache_config["block_size"])
    settings["enforce_eager"] = bool(settings["enforce_eager"])
    settings["tensor_parallel_size"] = int(settings["tensor_parallel_size"] or 1)
    m = plan.study.model
    dtype = given.get("dtype") or eff.get("dtype") or (manifest.cpu_dtype or {}).get("dtype") or "auto"
    return Scope(model=m.path or m.card or m.served_name, device=start.gpus[0].name if start.gpus else "cpu",
                 dtype=str(dtype), vllm_version=manifest.versions.vllm or "unknown", engine=plan.engine,
                 launch=settings)


def fit_run(run_dir: str | Path, folds: int = FOLDS) -> list[StepModel]:
    """One model a scope (launch settings in RANGED aside) of a run folder's records, each
    with the front end fitted from the run's rounds (front_end.fit; None, with why, where
    no round could give one)."""
    by_scope: dict[str, list[tuple[np.ndarray, Scope]]] = {}
    for rows, scope in collect(run_dir):
        d = scope.model_dump()
        key = json.dumps({**d, "launch": {k: v for k, v in d["launch"].items() if k not in RANGED}}, sort_keys=True)
        by_scope.setdefault(key, []).append((rows, scope))
    front, why_not = None, None
    try:  # one front end a run: one API server program, API and tokenizer in every start
        samples, scope = fe.samples_of_run(run_dir)
        if not samples:
            why_not = "no ok round with step records and its requests' records"
        else:
            front = fe.fit(samples, scope)
    except ValueError as e:
        why_not = str(e)
    models = []
    for group in by_scope.values():
        launches = [json.loads(s) for s in sorted({json.dumps(sc.launch, sort_keys=True) for _, sc in group})]
        m = fit([r for r, _ in group], group[0][1], launches, folds)
        m.front_end, m.front_end_why_not = front, why_not
        models.append(m)
    return models
