"""The round protocol of a start: reset the prefix cache (each round starts cold) ->
snapshot the server's counters -> send the round's requests -> snapshot again -> the
round's figures, and, for a capacity step, judged against the SLO. Warm-up runs before
the first round; a capacity study runs its bracket one round a step. With
trace.windows, round r replays window r % K; a capacity step measures every window at
its load (K rounds) and judges their requests pooled. What a round
should do to the server first (prime a cache, set a live knob) goes in `run_round`,
before its first snapshot."""
from __future__ import annotations

import time
from dataclasses import replace

from ..capacity.bracket import Bracket, CapacityRecord, Step, Stopped, meets_slo, margins, trace_speed
from . import client, counters, stats
from ..launch import machine
from ..workload import loads
from ..define import models
from ..define.grid import point_limits
from ..records.results import RoundRecord, append_round, now_utc
from ..scheduler_plugin.counters_file import SERIES as PB_SERIES, read_stats as read_pb_stats, stats_delta
from ..scheduler_plugin import steps
from .launcher import Served
from .primer import Primer, model_departure
from .start_record import StartLog, exited, recorded_step
from .start_workload import StartWorkload


STEPS_SETTLE_S = 1.0  # the longest wait for a round's last step records (its last step in flight)


class RoundProtocol:
    """The measuring steps of a start, writing through its StartLog `log`, on the server
    its launch handed over (`served`, a launcher.Served) with the workload built there
    (`work`, a start_workload.StartWorkload). `nvml`: the start's GPUs, sampled over each
    round. `live`: the control channel (live_knobs.Channel) where the server serves
    several points; each round first sets this point's limits through it."""

    def __init__(self, plan, log: StartLog, served: Served, work: StartWorkload, nvml, live=None):
        self.study, self.point, self.log, self.served, self.nvml, self.live = \
            plan.study, plan.point, log, served, nvml, live
        self.tokenizer, self.windows = work.tokenizer, work.windows
        self.workload = work.workload  # trace.windows: the window of the round running (_pick_window)
        self.rounds: list[RoundRecord] = []
        self._primer: Primer | None = None
        self._last_results: list[dict] = []

    @property
    def server(self):
        """The kit's own server (None for a target): recorded_step and the rounds watch it."""
        return self.served.server

    @property
    def failed(self) -> bool:
        return self.log.failed

    def _pb_snapshot(self) -> dict | None:
        if not self.point.prefix_budget:
            return None
        try:
            return read_pb_stats(self.log.pb_stats_path)
        except (OSError, ValueError):  # not written yet: the engine has not scheduled
            return None

    def _run_closed(self, requests) -> list[dict]:
        w, s = self.study.workload, self.served
        return [r.to_dict() for r in client.run_sync(client.run_closed_loop(
            s.url, s.model_name, w.api, requests, w.concurrency, timeout_s=w.request_timeout_s,
            api_key=s.api_key, proxy=s.proxy))]

    def _prepare_round(self, load_value: float | None = None):
        """The round's requests and the coroutine that sends them, built before the
        round's clock starts (tokenizing prompts is not the server's time). load_value:
        a capacity step's load, in capacity.over's unit, in place of the study's."""
        w, s = self.study.workload, self.served
        n, load = w.requests_per_round, w.load
        over = self.study.capacity.over if load_value is not None else None
        common = dict(timeout_s=w.request_timeout_s, api_key=s.api_key, proxy=s.proxy)
        if w.kind == "multi_turn":  # turns are built as answers arrive
            return client.run_conversations(s.url, s.model_name, self.workload, n // w.turns,
                                            w.concurrency, w.think_time_s, **common)
        if w.kind == "trace":
            speed = trace_speed(over, load_value, self.workload.trace.rate, w.trace.speed)
            return client.run_open_loop(s.url, s.model_name, w.api, self.workload.requests(),
                                        self.workload.schedule(speed), **common)
        requests = self.workload.requests(n)
        if load.kind == "closed":
            c = int(load_value) if over == "concurrency" else w.concurrency
            return client.run_closed_loop(s.url, s.model_name, w.api, requests, c, **common)
        if load.kind == "poisson":
            rate = load_value if over == "rate" else load.rate
            times = loads.arrivals(n, rate, load.burstiness, w.seed)
        else:
            times, step = loads.ladder(n, load.rates, load.burstiness, w.seed)
            requests = [replace(r, tags={**r.tags, "step": rate}) for r, rate in zip(requests, step)]
        return client.run_open_loop(s.url, s.model_name, w.api, requests, times,
                                    max_concurrency=load.max_concurrency, **common)

    @recorded_step
    def warmup(self) -> None:
        """Requests from a separate stream, excluded from every statistic."""
        n, log = self.study.workload.warmup_requests, self.log
        log.mark("warmup")
        if n:
            res = self._run_closed(self.workload.requests(n, "warmup"))
            log.record.warmup_errors = sum(1 for r in res if r["error"])
            log.save()
            log.server_died(self.server, "during warm-up", wait_s=10 if log.record.warmup_errors else 0)

    @recorded_step
    def run_round(self, index: int, load: float | None = None, step: int | None = None) -> RoundRecord | None:
        """One measured round; `load`: a capacity step's load (judged against the SLO),
        `step` its number in the search (for the words a dead server is recorded with)."""
        log, s = self.log, self.served
        record, launch = log.record, log.record.launch
        k = self._pick_window(index)
        where = (f"step {step}" + (f" (window {k + 1})" if self.windows else "") if step is not None
                 else f"round {index + 1} of {record.rounds_planned}")  # 0-based in records
        if log.server_died(self.server, f"before {where}"):
            return None
        log.doing = f"before {where}"   # where a request that finds the server gone was (recorded_step)
        # a shared start (live knobs): this point's limits in force first, or no round (live_start.py)
        limits = self.live.enter(point_limits(self.point)) if self.live else None
        if launch.cache_reset:
            counters.reset_prefix_cache(s.url, s.api_key, s.proxy)  # every round starts cold
        trace = self.study.workload.kind == "trace"
        log.doing = f"during priming of {where}"
        primed = self.primer.prime(self._run_closed, k) if trace else {}  # unmeasured: before the first snapshot
        if primed.get("prime_errors") and log.server_died(self.server, log.doing, wait_s=10):
            return None   # its priming's requests met a dead server: no round to measure
        log.doing = f"during {where}"
        before = counters.scrape(s.url, s.api_key, s.proxy) if launch.has_metrics else None
        pb_before = self._pb_snapshot()
        sending = self._prepare_round(load)
        sampler = counters.RoundSampler(s.url if launch.has_metrics else None, self.nvml,
                                        api_key=s.api_key, proxy=s.proxy)
        with sampler:
            t0, sent = time.perf_counter(), time.monotonic()  # monotonic: the engine's step clock
            results = [r.to_dict() for r in client.run_sync(sending)]
            duration = _send_to_finish(results) or time.perf_counter() - t0
        values = stats.round_metrics(results, duration, self.study.slo)
        values["expected_prefix_hit_rate"] = (self.workload.expected_hit_rate() if self.windows
                                              else record.expected_prefix_hit_rate)  # the round's window's
        if trace:
            values |= self.workload.fidelity(results) | primed | self.primer.model_hit_rate(values, load, k)
        died, lost = exited(self.server), None
        if not died:
            try:
                if before is not None:
                    after = counters.scrape(s.url, s.api_key, s.proxy)
                    values |= _server_figures(self, before, after, duration)
            except OSError as e:  # a killed server's sockets close a moment before its exit shows
                died = exited(self.server, wait_s=10)
                lost = None if died else f"the server stopped answering after round {index + 1}: {e}"
            values |= sampler.result()
            values |= _budget_figures(pb_before, self._pb_snapshot())
            save_steps(self, index, sent)
        ok = not died and not lost and values["completed"] > 0
        flag = model_departure(values, f"round {index + 1}" + (f" (window {k + 1})" if self.windows else ""))
        if flag:  # said where the start's warnings are, and by the sweep's console (sweep.model_flags)
            record.warnings.append(flag)
        rec = RoundRecord(point=self.point.id, start=record.start, round=index, block=record.block,
                          status="ok" if ok else "failed", utc=now_utc(), errors=stats.errors(results),
                          metrics=values, groups=stats.group_records(results), load=load,
                          limits=self.live.used(limits) if self.live else None)
        if self.windows:
            w = self.windows.plan.windows[k]
            rec.window, rec.window_first, rec.window_last = k + 1, w.start, w.stop - 1
        if load is not None:
            why = None if ok else "the server died" if died else lost or "round failed"
            rec.slo_met, rec.slo_why = meets_slo(values, self.study.capacity.slo, why)
        self.rounds.append(rec)
        self._last_results = results  # a windowed capacity step pools its rounds' requests
        append_round(log.dir, rec, results)
        if died:
            log.server_died(self.server, f"during {where}", wait_s=10)  # gone: at once
        elif lost:
            log.fail(lost)
        elif ok:
            record.rounds_ok += 1
            log.save()
        return rec

    def _pick_window(self, index: int) -> int:
        """trace.windows: round `index` replays window index % K (a capacity step runs K
        rounds: every window once); its workload becomes the start's for the round. 0
        without windows."""
        if not self.windows:
            return 0
        k = self.windows.pick(index)
        self.workload = self.windows.workloads[k]
        return k

    @property
    def primer(self) -> Primer:
        """This start's priming and cache model, made at its first round (the server's KV size is known)."""
        if self._primer is None:
            self._primer = Primer(self.study, self.workload, self.tokenizer, self.log.record, self.windows)
        return self._primer

    def run_rounds(self, progress=None) -> None:
        if self.study.capacity:
            self.search_capacity(progress)
            return
        for i in range(self.study.rounds):
            if self.failed:
                break
            self.run_round(i)
            if progress:
                progress(i)
        self.log.mark("measured", save=True)

    def search_capacity(self, progress=None) -> None:
        """Bracket over this start's server, one round a step; the record is saved
        after every step, so a start that dies mid-search keeps what it measured."""
        c = self.study.capacity
        bracket = Bracket(c.over, c.lo, c.hi, c.precision, c.max_steps, floor=c.floor, probe=c.probe)

        def measure(load: float) -> Step:
            # a start that failed (its server died, a limit refused) ends its search with the
            # steps that ran: the step it failed in has no verdict, and no step after it runs
            recs, pooled = [], []
            for _ in range(len(self.windows.workloads) if self.windows else 1):
                # trace.windows: every window at this load, one round each (round i replays window i % K)
                i = len(self.rounds)
                rec = self.run_round(i, load, step=len(bracket.steps) + 1)
                if progress:
                    progress(i)
                if self.failed:
                    raise Stopped(self.log.record.reason)
                if rec is None:
                    return Step(load, False, "round failed")
                recs.append(rec)
                pooled += self._last_results
            if len(recs) == 1:
                return Step(load, bool(rec.slo_met), rec.slo_why or "", rec.round,
                                     margins(rec.metrics, c.slo))
            return _pooled_step(load, recs, pooled, c.slo)
        result = bracket.run(measure)
        # the start's trace record's rate: its window's, or with trace.windows theirs pooled
        rate = self.log.record.trace["rate"] if c.over == "speed" else None
        result.requests_per_s = _requests_per_s(result, rate, self.rounds)
        self.log.record.capacity = result
        self.log.mark("measured", save=True)


def save_steps(start: RoundProtocol, index: int, t0: float) -> None:
    """The engine steps scheduled since round `index` began sending (monotonic t0), as the
    start's steps/r<index>.npz (scheduler_plugin/steps.py); called once the round's figures
    are in, before anything else is sent. The engine writes its rows when it holds no
    request, so the round's are on disk by now but for a step still in flight: the file
    is read once it has stopped growing (at most STEPS_SETTLE_S)."""
    raw = start.served.steps_raw
    if raw is None:
        return
    t1 = time.monotonic()
    try:
        size, deadline = -1, time.monotonic() + STEPS_SETTLE_S
        while (now := raw.stat().st_size) != size and time.monotonic() < deadline:
            size = now
            time.sleep(0.05)
        rows = steps.between(steps.read_raw(raw), t0, t1)
    except FileNotFoundError:  # the engine never wrote a row: said once
        why = f"no step records: the engine wrote no {raw.name} (is its scheduler the kit's?)"
        if why not in start.log.record.warnings:
            start.log.record.warnings.append(why)
        return
    steps.save_round(start.log.dir, index, rows)


def _server_figures(start: RoundProtocol, before: dict, after: dict, duration: float) -> dict:
    """/metrics deltas over a round of `start`, whether the chunk budget bound, and hardware use."""
    point = start.point
    values = counters.round_deltas(before, after) | counters.work_deltas(before, after)
    if point.effective and point.effective.max_num_batched_tokens:
        values |= counters.long_prefills(before, after, point.effective.max_num_batched_tokens)
    gpus = start.log.record.gpus
    figures, source = machine.use(values, duration, gpus[0].name if gpus else None,
                                   point.engine_args.tensor_parallel_size or 1, models.local_config(start.study.model))
    if source:
        start.log.record.launch.hardware_source = source
    return values | figures


def _requests_per_s(result: CapacityRecord, trace_rate: float | None,
                    rounds: list[RoundRecord]) -> float | None:
    """The capacity in requests/s: the offered rate of an open-loop search (over speed: times
    the trace's real rate), the measured throughput at the capacity of a closed-loop one."""
    if result.load is None:
        return None
    if result.over == "speed":
        return result.load * trace_rate
    if result.over == "rate":
        return result.load
    at = next((r for r in rounds if r.round == result.at_round), None)
    return at.metrics.get("request_throughput") if at else None


def _pooled_step(load: float, recs: list[RoundRecord], results: list[dict], slo: dict) -> Step:
    """trace.windows: a capacity step over its windows' rounds, judged on their requests
    pooled; any failed round is a miss. Its round is the first window's."""
    values = stats.round_metrics(results, sum(r.metrics.get("duration_s") or 0.0 for r in recs), slo)
    bad = next((r for r in recs if r.status != "ok"), None)
    ok, why = meets_slo(values, slo, f"window {bad.window}'s round failed" if bad else None)
    return Step(load, ok, why, recs[0].round, margins(values, slo))


def _send_to_finish(results: list[dict]) -> float | None:
    """The round's clock (metrics.py: duration_s): first send to last finish, read from the requests'
    own timestamps, so starting the sender's event loop is not counted."""
    ends = [r["end_time"] for r in results if r.get("end_time") is not None]
    return max(ends) - min(r["send_time"] for r in results) if ends else None

def _budget_figures(before: dict | None, after: dict | None) -> dict:
    """The Prefix Reuse Budget's counters over one round (scheduler_plugin.stats_delta)."""
    if after is None:
        return {}
    if before is None:  # the engine wrote its first counters during the round
        before = {**after, "counters": {k: 0 for k in after["counters"]}, **{k: [] for k in PB_SERIES}}
    d = stats_delta(before, after)
    return {"pb_deferred": d["deferred"], "pb_admitted_by_age": d["admitted_by_age"],
            "pb_admitted_idle": d["admitted_idle"], "pb_defer_ms_p50": d["defer_ms_p50"],
            "pb_defer_ms_p99": d["defer_ms_p99"], "pb_defer_ms_max": d["defer_ms_max"]}
