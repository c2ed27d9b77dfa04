"""One server start of one grid point: launch vLLM (or connect to an endpoint), warm
up, run the rounds, record everything; then the point's summary over all its starts.

The steps are methods so the point notebook can show each as a cell. A failure
(server that never starts, server that dies mid-round) marks the start failed with a
reason and turns the remaining steps into no-ops: the notebook still finishes and
the sweep goes on. Finished rounds are on disk the moment they end.

PointStart composes three parts, handed to each other: the start's log
(start_record.StartLog: its record and folder), its launch (launcher.Launcher: the slot,
the server behind launch/deployment.py, the workload), which hands over the server it
started (launcher.Served) and the workload (start_workload.StartWorkload), and the round
protocol on them (rounds.RoundProtocol). Here are its making, its finish (`close`: the
start's verdict), and the point's summary over its starts.
"""
from __future__ import annotations

from pathlib import Path

from . import stats
from ..define.grid import PointPlan
from ..launch.machine import NvmlProbe
from ..records.results import PointFolder, PointSummary, RoundRecord, StartRecord, now_utc
from ..records.point_capacity import rps_per_load, start_figures
from .launcher import Launcher
from .rounds import RoundProtocol
from .start_record import StartLog


class PointStart:
    """Start `start` of the point in `plan`, its files in `start_dir` (points/<id>/s<k>/).
    `block`: the block of the randomized run order it belongs to (the KV-cache block
    size is `kv_block` wherever the two meet). `slot_lock`: the sweep's lock file for
    this start's GPUs (slots.SlotLock), taken before the server starts and given back
    once it has stopped."""

    def __init__(self, plan: PointPlan, start_dir: str | Path, start: int = 1, block: int | None = None,
                 gpu_indices: list[int] | None = None, slot_lock: str | Path | None = None):
        self.plan, self.study, self.point = plan, plan.study, plan.point
        self.nvml = NvmlProbe(gpu_indices)  # not machine.describe(): its CPU probe imports torch (seconds)
        self.log = StartLog.begin(plan, start_dir, start, block, self.nvml)
        self.launcher = Launcher(plan, self.log, gpu_indices, slot_lock)
        self.protocol = self.rounds_on()  # on nothing yet: a step before launch measures nothing

    def rounds_on(self) -> RoundProtocol:
        """The round protocol on what the launch has handed over so far."""
        return RoundProtocol(self.plan, self.log, self.launcher.served, self.launcher.work, self.nvml)

    # what the point notebook reads of a start
    @property
    def record(self) -> StartRecord:
        return self.log.record

    @property
    def failed(self) -> bool:
        return self.log.failed

    @property
    def url(self) -> str | None:
        return self.launcher.served.url

    @property
    def rounds(self) -> list[RoundRecord]:
        return self.protocol.rounds

    @property
    def planned_rounds(self) -> int:
        return self.study.steps_per_start

    def launch(self) -> None:
        self.launcher.launch()
        self.protocol = self.rounds_on()

    def warmup(self) -> None:
        self.protocol.warmup()

    def run_rounds(self, progress=None) -> None:
        self.protocol.run_rounds(progress)

    def finish(self) -> PointSummary:
        """Stop the server, close this start's record, and summarize the point over
        every start it has so far. The slot is handed on as soon as the server is gone."""
        self.launcher.stop()
        close(self.log, self.study)
        return summarize(PointFolder(self.log.dir.parent), self.plan)


def close(log: StartLog, study) -> None:
    """A start's verdict, once its rounds are done: failed where it failed or measured
    less than the study asks, ok otherwise; the record closed."""
    record = log.record
    if not log.failed:
        if study.capacity:
            record.status = "ok" if record.capacity else "failed"
            if not record.capacity:
                record.reason = "the capacity search did not run"
        elif record.rounds_ok < study.rounds:
            log.fail(f"only {record.rounds_ok} of {study.rounds} rounds completed a request")
        else:
            record.status = "ok"
    record.finished_utc = now_utc()
    log.save()


def summarize(folder: PointFolder, plan: PointPlan) -> PointSummary:
    """The point over all its starts: status, reasons, and every metric's estimate.
    ok = every planned round of every planned start; partial = some; failed = none,
    with a start that failed; running = nothing measured yet."""
    study, point = plan.study, plan.point
    n_starts = plan.planned_starts
    starts = folder.starts()
    rounds = folder.rounds()
    ok_rounds = [r for r in rounds if r.status == "ok"]
    planned = n_starts * study.rounds
    failed_starts = [s for s in starts if s.status == "failed"]
    if study.capacity:  # one search a start: its figures are the round at its capacity
        searched = {s.start: s.capacity for s in starts if s.status == "ok" and s.capacity}
        rounds = [r for r in rounds if r.start in searched and r.round == searched[r.start].at_round]
        ok_rounds, planned = rounds, n_starts
    if len(ok_rounds) >= planned and not failed_starts:
        status = "ok"
    elif ok_rounds:
        status = "partial"
    else:
        status = "failed" if failed_starts else "running"
    reasons = [f"start {s.start}: {s.reason}" for s in failed_starts]
    done = sum(1 for s in starts if s.status != "running")
    if status == "partial" and done < n_starts:
        reasons.append(f"{n_starts - done} of {n_starts} server starts not run yet")
    first_up = next((s for s in starts if s.launch.startup_s is not None or s.launch.target), None)
    estimates = stats.point_estimates(rounds)
    startups = [s.launch.startup_s for s in starts if s.launch.startup_s is not None]
    if startups:  # a figure per start, not per round
        estimates["startup_s"] = stats.estimate([[v] for v in startups])
    below = []
    if study.capacity and searched:
        # each start's capacity as the report states it (records.point_capacity.start_figures),
        # a bound below as no value (capacity_below lists it)
        by_start = {st.start: st for st in starts}
        figures = [start_figures(by_start[k], folder.start_dir(k), study.capacity.slo, study.capacity.lo)
                   for k in searched]
        for name in ("capacity_rps", "capacity_load"):
            est = stats.estimate([[f[name]] for f in figures if f["capacity_censored"] != "below"])
            if est is not None:   # (none where every start missed at its lowest load: a bound, below)
                estimates[name] = est
        for st in starts:
            c = searched.get(st.start)
            if c is not None and c.censored == "below":
                per = rps_per_load(c, st)
                below.append({"start": st.start, "capacity_load": c.bracket[1],
                              "capacity_rps": c.bracket[1] * per if per else None})
    summary = PointSummary(
        point=point.id, values=point.values, status=status, reasons=reasons, starts_planned=n_starts,
        starts_done=done, rounds_planned=planned, rounds_ok=len(ok_rounds), engine=plan.engine,
        engine_args=point.engine_args.model_dump(exclude_none=True), effective=point.effective,
        launch=first_up.launch if first_up else None, warnings=sorted({w for s in starts for w in s.warnings}),
        estimates=estimates, groups=stats.group_estimates(rounds), capacity_below=below)
    summary.save(folder.summary_path)
    return summary
