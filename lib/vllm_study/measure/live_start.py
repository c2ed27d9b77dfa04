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
from ..records.results import PointFolder, PointSummary
from .live_knobs import Channel
from .point import PointStart

CONTROL_FILE = "limits.json"  # in the lead's start folder, beside the plugin's counters file


class SharedStart:
    """The point notebook's start when it serves several points: the lead PointStart
    launches and warms up; every point (the lead first) has its PointStart, its rounds
    run in grid.round_order on the one server."""

    def __init__(self, plans: list[PointPlan], start_dirs: list[str | Path], start: int, block: int | None,
                 gpu_indices: list[int] | None = None, slot_lock: str | Path | None = None):
        lead = PointStart(plans[0], start_dirs[0], start, block, gpu_indices, slot_lock)
        lead.live = Channel(lead.pb_stats_path, lead.dir / CONTROL_FILE)
        lead.served_chunks = tuple(p.point.effective.max_num_batched_tokens for p in plans)
        lead.record.serves = [p.point.id for p in plans]
        lead._save()
        self.lead, self.plan, self.study = lead, plans[0], plans[0].study
        self.starts = [lead]
        for plan, d in zip(plans[1:], start_dirs[1:]):
            s = PointStart(plan, d, start, block)
            s.record.served_by = f"{lead.point.id}/{lead.dir.name}"
            s._save()
            self.starts.append(s)

    # what the point notebook reads of a start
    @property
    def record(self):
        return self.lead.record

    @property
    def failed(self) -> bool:
        return self.lead.failed

    @property
    def url(self):
        return self.lead.url

    @property
    def rounds(self):
        return [r for s in self.starts for r in s.rounds]

    def launch(self) -> None:
        self.lead.launch()
        for s in self.starts[1:]:
            if self.lead.failed:
                s._fail(f"the shared server did not start (points/{s.record.served_by}): {self.lead.record.reason}")
                continue
            self._attach(s)

    def _attach(self, s: PointStart) -> None:
        """The lead's server, client settings and workload, for another point's rounds."""
        lead = self.lead
        s.url, s.model_name, s.api_key, s.proxy = lead.url, lead.model_name, lead.api_key, lead.proxy
        s.tokenizer, s.workload = lead.tokenizer, lead.workload
        s.server = lead.server  # its rounds see the server die; finish() leaves stopping it to the lead
        s.live = lead.live
        s.steps_raw = lead.steps_raw  # the one engine's records; each point keeps its own rounds' steps
        launched = lead.record.launch  # what the rounds read per point; the rest stays in the lead's record
        s.record.launch = s.record.launch.model_copy(update={
            "cache_config": launched.cache_config, "has_metrics": launched.has_metrics,
            "cache_reset": launched.cache_reset})
        s.record.expected_prefix_hit_rate = lead.record.expected_prefix_hit_rate
        s.record.trace, s.windows = lead.record.trace, lead.windows  # trace.windows: the lead cut them
        s._save()

    def warmup(self) -> None:
        self.lead.warmup()  # one warm-up a server, at its launch limits

    def run_rounds(self, progress=None) -> None:
        if self.study.capacity:
            self.search_capacities(progress)
            return
        by_id = {s.point.id: s for s in self.starts}
        seed = self.study.order_seed
        for i, (r, pid) in enumerate(round_order(list(by_id), self.study.rounds, seed, self.lead.record.block or 0)):
            s = by_id[pid]
            if self.lead.server is not None and not self.lead.server.alive():
                self._fail_all("the shared server died")
                break
            s.run_round(r)  # a refused limit or a lost server fails this point's start, as data
            if progress:
                progress(i)
        for s in self.starts:
            s._mark("measured", save=True)

    def search_capacities(self, progress=None) -> None:
        """A capacity study: each point's own search on the one server, the points in
        grid.search_order; progress counts the rounds of all of them."""
        by_id = {s.point.id: s for s in self.starts}
        done = 0

        def counted(_):
            nonlocal done
            if progress:
                progress(done)
            done += 1
        order = search_order(list(by_id), self.study.order_seed, self.lead.record.block or 0)
        for i, pid in enumerate(order):
            if self.lead.server is not None and not self.lead.server.alive():
                # a search done before it keeps its capacity; those not run yet fail
                self._fail_all("the shared server died", [by_id[p] for p in order[i:]])
                break
            by_id[pid].search_capacity(counted)  # each step sets this point's limits first (run_round);
            #                                      its record marks when its own search ended

    def _fail_all(self, why: str, starts: list[PointStart] | None = None) -> None:
        for s in starts or self.starts:
            if not s.failed:
                s._fail(f"{why} (points/{self.lead.point.id}/{self.lead.dir.name}/server.log.gz)")

    def finish(self) -> PointSummary:
        """Each served point's record closed and summarized; then the lead's, which stops
        the server. Returns the lead's summary (each point's is in its folder)."""
        for s in self.starts[1:]:
            s.server = None  # the lead's to stop
            s.finish()
        return self.lead.finish()

    def summaries(self) -> list[PointSummary]:
        return [PointFolder(s.dir.parent).summary() for s in self.starts]
