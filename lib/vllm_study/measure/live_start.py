"""One server start that serves several points (server.live_knobs): the points of a
group differ only in the scheduler limits vLLM reads at every step, so the server is
launched once, as the group's point at its largest limits (the lead), and each round
first sets its own point's limits through the kit's scheduler plugin (live_knobs.py).

Records stay per point: every point measures into its own points/<id>/s<k>/ (start.json,
rounds.jsonl, requests), as a start of its own would. What the points share is recorded
once, in the lead's start: the launch (its command at the largest limits, environment,
start-up time), the timeline and the server log; each other point's start.json names it
(`served_by`), and the lead's lists every point it served (`serves`). Each round record
carries the limits the engine reported it ran under (`limits`).

The rounds interleave: `rounds` passes over the points, each pass in a seeded order
(grid.round_order), so drift over the start falls on every point alike and the points
are compared within one start. A control message the engine refuses fails that point's
start with the reason, and its round is not run (rounds.py sets the limits first).

A capacity study: each point runs its own whole capacity search (rounds.py
search_capacity: its own bracket, its limits set before every step), the points one
after another in a seeded order (grid.search_order), so each point's start.json holds
the CapacityRecord a start of its own would. The searches do not interleave: a
bracket's next load depends on the step before, so interleaving them would need the
search turned inside out (a generator per point) for a gain the seeded order already
gives in part: drift falls on the points in an order no axis lines up with.
"""
from __future__ import annotations

from pathlib import Path

from ..define.grid import PointPlan, round_order, search_order
from ..launch.machine import NvmlProbe
from ..records.results import PointFolder, PointSummary, RoundRecord, StartRecord
from .launcher import Launcher
from .live_knobs import Channel
from .point import close, summarize
from .rounds import RoundProtocol
from .start_record import StartLog

CONTROL_FILE = "limits.json"  # in the lead's start folder, beside the plugin's counters file


class SharedStart:
    """The point notebook's start when it serves several points: the same parts as a
    PointStart's, one launch for all. Each point (the lead, plans[0], first) has its
    StartLog; the one Launcher (the lead's log, the control channel `live`) starts the
    server at the points' largest limits; each point then has its RoundProtocol on what
    the launch handed over, its rounds run in grid.round_order on the one server."""

    def __init__(self, plans: list[PointPlan], start_dirs: list[str | Path], start: int, block: int | None,
                 gpu_indices: list[int] | None = None, slot_lock: str | Path | None = None):
        self.plans, self.plan, self.study = plans, plans[0], plans[0].study
        self.nvmls = [NvmlProbe(gpu_indices)]
        lead = StartLog.begin(plans[0], start_dirs[0], start, block, self.nvmls[0])
        self.live = Channel(lead.pb_stats_path, lead.dir / CONTROL_FILE)
        self.launcher = Launcher(plans[0], lead, gpu_indices, slot_lock, live=self.live,
                                 served_chunks=tuple(p.point.effective.max_num_batched_tokens for p in plans))
        lead.record.serves = [p.point.id for p in plans]
        lead.save()
        self.lead, self.logs = lead, [lead]
        for plan, d in zip(plans[1:], start_dirs[1:]):
            self.nvmls.append(NvmlProbe(None))
            log = StartLog.begin(plan, d, start, block, self.nvmls[-1])
            log.record.served_by = f"{plans[0].point.id}/{lead.dir.name}"
            log.save()
            self.logs.append(log)
        self.protocols = self.rounds_on()  # on nothing yet: a step before launch measures nothing

    def rounds_on(self) -> list[RoundProtocol]:
        """Each point's round protocol on what the launch has handed over so far."""
        served, work = self.launcher.served, self.launcher.work
        return [RoundProtocol(plan, log, served, work, nvml, self.live)
                for plan, log, nvml in zip(self.plans, self.logs, self.nvmls)]

    # what the point notebook reads of a start
    @property
    def record(self) -> StartRecord:
        return self.lead.record

    @property
    def failed(self) -> bool:
        return self.lead.failed

    @property
    def url(self) -> str | None:
        return self.launcher.served.url

    @property
    def rounds(self) -> list[RoundRecord]:
        return [r for p in self.protocols for r in p.rounds]

    @property
    def planned_rounds(self) -> int:
        return self.study.steps_per_start * len(self.plans)

    def launch(self) -> None:
        self.launcher.launch()
        for log in self.logs[1:]:
            if self.lead.failed:
                log.fail(f"the shared server did not start (points/{log.record.served_by}): {self.lead.record.reason}")
                continue
            self._share_launch(log)
        self.protocols = self.rounds_on()

    def _share_launch(self, log: StartLog) -> None:
        """What another point's rounds read of the launch, into its record; the rest stays
        in the lead's (the server, client settings and workload are the launch's, handed
        to every point's round protocol)."""
        lead = self.lead.record
        log.record.launch = log.record.launch.model_copy(update={
            "cache_config": lead.launch.cache_config, "has_metrics": lead.launch.has_metrics,
            "cache_reset": lead.launch.cache_reset})
        log.record.expected_prefix_hit_rate = lead.expected_prefix_hit_rate
        log.record.trace = lead.trace  # trace.windows: the lead cut them
        log.save()

    def warmup(self) -> None:
        self.protocols[0].warmup()  # one warm-up a server, at its launch limits

    def _server_gone(self) -> bool:
        server = self.launcher.server
        return server is not None and not server.alive()

    def run_rounds(self, progress=None) -> None:
        if self.study.capacity:
            self.search_capacities(progress)
            return
        by_id = {p.point.id: p for p in self.protocols}
        seed = self.study.order_seed
        for i, (r, pid) in enumerate(round_order(list(by_id), self.study.rounds, seed, self.lead.record.block or 0)):
            if self._server_gone():
                self._fail_all("the shared server died")
                break
            by_id[pid].run_round(r)  # a refused limit or a lost server fails this point's start, as data
            if progress:
                progress(i)
        for log in self.logs:
            log.mark("measured", save=True)

    def search_capacities(self, progress=None) -> None:
        """A capacity study: each point's own search on the one server, the points in
        grid.search_order; progress counts the rounds of all of them."""
        by_id = {p.point.id: p for p in self.protocols}
        done = 0

        def counted(_):
            nonlocal done
            if progress:
                progress(done)
            done += 1
        order = search_order(list(by_id), self.study.order_seed, self.lead.record.block or 0)
        for i, pid in enumerate(order):
            if self._server_gone():
                # a search done before it keeps its capacity; those not run yet fail
                self._fail_all("the shared server died", [by_id[p].log for p in order[i:]])
                break
            by_id[pid].search_capacity(counted)  # each step sets this point's limits first (run_round);
            #                                      its record marks when its own search ended

    def _fail_all(self, why: str, logs: list[StartLog] | None = None) -> None:
        for log in logs or self.logs:
            if not log.failed:
                log.fail(f"{why} (points/{self.plan.point.id}/{self.lead.dir.name}/server.log.gz)")

    def finish(self) -> PointSummary:
        """Each served point's record closed and summarized; then the lead's, with the
        server stopped. Returns the lead's summary (each point's is in its folder)."""
        for plan, log in zip(self.plans[1:], self.logs[1:]):
            close(log, plan.study)
            summarize(PointFolder(log.dir.parent), plan)
        self.launcher.stop()
        close(self.lead, self.study)
        return summarize(PointFolder(self.lead.dir.parent), self.plan)

    def summaries(self) -> list[PointSummary]:
        return [PointFolder(log.dir.parent).summary() for log in self.logs]
