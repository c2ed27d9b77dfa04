"""A point's capacity read from its run folder: each start's capacity record, rounds and
kept requests handed to capacity.estimate (the statistic, the fit and the combination over
starts live there), and a capacity study's summary.csv.
"""
from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

from ..capacity import estimate, fit
from ..capacity.bracket import CapacityRecord
from ..capacity.estimate import PointCapacity
from ..define.study_file import study_from_dict
from .results import PointFolder, RunFolder, StartRecord, read_requests, read_rounds


def rps_per_load(rec: CapacityRecord, start: StartRecord) -> float | None:
    """Requests/s per unit of load: 1 over rate; over speed, the trace's real rate; over
    concurrency, none (its throughput at capacity is measured, not set)."""
    if rec.over == "rate":
        return 1.0
    if rec.over == "speed":
        if start.trace and start.trace.get("rate"):
            return float(start.trace["rate"])
        if rec.load and rec.requests_per_s:
            return rec.requests_per_s / rec.load
    return None


def start_capacity(start_dir: Path, rec: CapacityRecord, slo: dict[str, float], floor: float,
                   seed: int = 0) -> tuple[fit.StartCapacity, str]:
    """One start's capacity and the capacity.estimate.STATISTICS key it was judged by."""
    return _start_capacity(str(start_dir), rec.model_dump_json(), json.dumps(slo, sort_keys=True), floor, seed)


@lru_cache(maxsize=512)  # a report over a run fits every start once
def _start_capacity(start_dir: str, rec_json: str, slo_json: str, floor: float,
                    seed: int) -> tuple[fit.StartCapacity, str]:
    rec = CapacityRecord.model_validate_json(rec_json)
    per_step = rec.step_rounds(read_rounds(Path(start_dir) / "rounds.jsonl")) if rec.steps else []
    return estimate.start_capacity(rec, per_step, read_requests(Path(start_dir)), json.loads(slo_json), floor, seed)


def start_figures(st: StartRecord, start_dir: Path, slo: dict[str, float], floor: float) -> dict:
    """A start's capacity as summary.csv holds it, on the round at its capacity: the
    statistic the report, console and export state (start_capacity), in the search's unit
    (capacity_load) and in req/s (capacity_rps); a bound as a bound, its value the load
    it lies below or at least, with capacity_censored "below" or "above" (never 0). Over
    concurrency no load fixes a rate: capacity_rps stays the throughput measured at the
    highest load that met, as the report states it."""
    rec = st.capacity
    c, _ = start_capacity(start_dir, rec, slo, rec.floor or floor, seed=st.start)
    per = rps_per_load(rec, st)
    rps = c.value * per if per else rec.requests_per_s if rec.over == "concurrency" and c.kind != "below" else None
    return {"capacity_rps": rps, "capacity_load": c.value,
            "capacity_censored": {"below": "below", "at_least": "above"}.get(c.kind, "")}


def write_summary_csv(run: RunFolder):
    """summary.csv (RunFolder.write_summary_csv), a capacity study's with each start's
    capacity as start_figures states it."""
    study = study_from_dict(run.manifest().params, source=str(run.manifest_path)) \
        if run.manifest_path.exists() else None
    if study is None or not study.capacity:
        return run.write_summary_csv()
    slo, lo = study.capacity.slo, study.capacity.lo
    return run.write_summary_csv(lambda st, d: start_figures(st, d, slo, lo))


def _fitted_starts(folder: PointFolder, slo: dict[str, float], floor: float, starts: set[int] | None):
    done = [(st, d) for st, d in folder._start_dirs()
            if st.capacity and st.status == "ok" and (starts is None or st.start in starts)]
    fitted = [start_capacity(d, st.capacity, slo, st.capacity.floor or floor, seed=st.start) for st, d in done]
    per = next((f for f in (rps_per_load(st.capacity, st) for st, _ in done) if f), None)
    return [c for c, _ in fitted], [k for _, k in fitted], per


def point_capacities(folders: dict[str, tuple[PointFolder, set[int] | None]], slo: dict[str, float],
                     floor: float) -> dict[str, PointCapacity | None]:
    """Each point's capacity over its completed searches (point id -> its folder and the
    start numbers to use, None: all; e.g. a search's confirmation starts); None where none
    completed. `floor`: the study's lowest load, for records that did not keep theirs.
    The start-to-start spread is pooled over the points (capacity.estimate.combine)."""
    return estimate.combine({pid: _fitted_starts(f, slo, floor, starts) for pid, (f, starts) in folders.items()})


def point_capacity(folder: PointFolder, slo: dict[str, float], floor: float,
                   starts: set[int] | None = None) -> PointCapacity | None:
    """One point's capacity on its own (its own starts' spread): point_capacities."""
    return point_capacities({folder.id: (folder, starts)}, slo, floor)[folder.id]
