"""The study's `predict:` stage (define/predict_spec.py): after the seed points' real
starts, every grid point's capacity predicted from a step-time model fitted to their
step records, each interval widened by the model's end-to-end error measured so far,
the points ranked, and the top `confirm_top` and the baseline handed to confirmation
until resolved as real starts. predictions.json in the run folder keeps it all; after
each later real start the model is refitted from every step so far and the prediction
of every measured point set beside its measurement (report/predict_section.py).

    units = plan_confirmation(run, study)    # predicts (once), appends the top's starts
    refit(run)                               # after a real start: the model's new version

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


class Predictions(BaseModel):
    model: ModelVersion
    error: EndToEnd
    points: list[PointPrediction]
    seeds: list[str]
    chosen: list[str]                 # measured in real starts on this prediction: the top and the baseline
    refits: list[ModelVersion] = []   # the model refitted after each later real start

    def save(self, run: RunFolder) -> None:
        write_atomic(run.path / PREDICTIONS, self.model_dump_json(indent=1) + "\n")

    def of(self, point: str) -> PointPrediction | None:
        return next((p for p in self.points if p.point == point), None)


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
                                held_out_p90=h.p90 if h else None, coef=main.coef)


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


def predict_one(task: tuple) -> PointPrediction:
    """One point's capacity in virtual time (a worker process's call)."""
    import time
    from .start import StudyInputs
    pid, plan, model, cache = task
    inputs = _INPUTS.get(plan.study.name)
    if inputs is None:
        inputs = _INPUTS[plan.study.name] = StudyInputs(plan.study)
    t0 = time.perf_counter()
    try:
        rec, _ = predict_capacity(plan, model, cache_config=cache, inputs=inputs,
                                  async_scheduling=plan.engine == "gpu", precision=FINE_PRECISION,
                                  max_steps=FINE_STEPS)
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


def predict_all(todo: list[tuple], workers: int, on_ray: bool = False) -> list[PointPrediction]:
    """Every task's prediction, on `workers` processes (one: in this process), or with
    on_ray one Ray task of one CPU each over the cluster the sweep's ray executor joined
    (ray.init: its address). Spawned, not forked: the sweep's threads and vLLM's imports
    do not survive a fork cleanly."""
    if on_ray:
        import ray
        ray.init(ignore_reinit_error=True, log_to_driver=False)   # joined already under --executor ray
        task = ray.remote(num_cpus=1, max_retries=0)(predict_one)
        return ray.get([task.remote(t) for t in todo])
    if workers <= 1 or len(todo) <= 1:
        return [predict_one(t) for t in todo]
    with ProcessPoolExecutor(min(workers, len(todo)), mp_context=get_context("spawn")) as pool:
        return list(pool.map(predict_one, todo, chunksize=max(1, len(todo) // (4 * workers))))


# -- the error, the intervals, the rank ---------------------------------------------------
def end_to_end(run: RunFolder, study: Study, models: list[step_model.StepModel],
               predicted: dict[str, PointPrediction]) -> EndToEnd:
    """The end-to-end error on what was measured so far (EndToEnd)."""
    from .start import StudyInputs
    err = EndToEnd(capacity=capacity_errors(measured_capacities(run, study), predicted))
    slo = list(study.capacity.slo)
    inputs, errs = StudyInputs(study), []
    for pid, d, rec in measured_starts(run):
        if rec.served_by or not (p := predicted.get(pid)) or not p.predicted:
            continue
        model = next(m for m in models if _fits(m, run, pid, rec))
        for row in replay_start(d, model, inputs=inputs):
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
    """The predicted value's interval: [value / (1 + e), value * (1 + e)]; a bound keeps
    its open side; no error measured yet: no interval."""
    if not p.predicted or e is None:
        return p
    if p.censored == "above":
        p.low, p.high = p.value / (1 + e), None
    elif p.censored == "below":
        p.low, p.high = None, p.value * (1 + e)
    else:
        p.low, p.high = p.value / (1 + e), p.value * (1 + e)
    return p


def rank(points: list[PointPrediction]) -> list[PointPrediction]:
    """Predicted points numbered from the highest capacity (at or above hi first, below
    the floor last); the others are left unranked."""
    order = {"above": 2, None: 1, "below": 0}
    ranked = sorted((p for p in points if p.predicted), key=lambda p: (order[p.censored], p.value), reverse=True)
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
    """Fit, predict every point, measure the error, widen, rank, choose (not saved)."""
    models, version = fit(run)
    todo, refused = tasks(run, models)
    done = predict_all(todo, workers or study.predict.processes, on_ray)
    by_id = {p.point: p for p in done}
    err = end_to_end(run, study, models, by_id)
    points = [by_id.get(pid) or next(r for r in refused if r.point == pid) for pid in run.manifest().points]
    for p in points:
        widen(p, err.widen)
    rank(points)
    seeds = seed_points(study, run.manifest().points)
    return Predictions(model=version, error=err, points=points, seeds=seeds,
                       chosen=choose(points, study.predict.confirm_top, study.baseline))


def plan_confirmation(run: RunFolder, study: Study, workers: int | None = None, on_ray: bool = False) -> list[Unit]:
    """Once the seeds are measured: predictions.json, and one shuffled block of a first
    start of each chosen point not measured yet, appended to the manifest's order (so
    --resume runs it). A run that has its predictions already gets nothing new."""
    if read(run.path) is not None:
        return []
    pred = predict(run, study, workers, on_ray)
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
