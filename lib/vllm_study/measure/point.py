"""One server start of one grid point: launch vLLM (or connect to an endpoint), warm
up, run the rounds, record everything; then the point's summary over all its starts.

The steps are methods so the point notebook can show each as a cell. A failure
(server that never starts, server that dies mid-round) marks the start failed with a
reason and turns the remaining steps into no-ops: the notebook still finishes and
the sweep goes on. Finished rounds are on disk the moment they end.
"""
from __future__ import annotations

import ast
import atexit
import functools
import json
import os
import platform
import re
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

from ..capacity import bracket as capacity
from . import client, counters, stats
from ..launch import hardware
from ..workload import loads
from ..define import models
from ..define.grid import PointPlan
from ..launch.machine import NvmlProbe, vllm_accepts
from ..records.results import (LOG, Launch, PointFolder, PointSummary, RoundRecord, StartRecord, append_round,
                               capacity_figures, compress_log, now_utc, read_log, START)
from ..prefix_budget.scheduler import STATS_ENV as PB_STATS_ENV
from ..prefix_budget.counters_file import SERIES as PB_SERIES, read_stats as read_pb_stats, stats_delta
from ..launch.slots import SlotLock, compile_cache_env
from ..launch.server import (ServerStartError, VllmServer, engine_init_visible, failure_reason, free_port, pgid_path,
                             serve_command, stop_group_from_file)
from ..define.traces import read_trace
from ..workload.build_workload import make_workload
from ..workload.trace_workload import TraceWorkload


def _non_default_args(log_text: str) -> dict | None:
    """vLLM logs the engine args it was given as a Python dict literal at startup."""
    m = re.search(r"non-default args: (\{.*\})", log_text)
    try:
        return ast.literal_eval(m.group(1)) if m else None
    except (ValueError, SyntaxError):
        return None


def _step(method):
    """A step that raises records the start as failed (with the error) instead of
    stopping the notebook: failures are data, and later steps become no-ops."""
    @functools.wraps(method)
    def wrapper(self, *a, **kw):
        if self.failed:
            return None
        try:
            return method(self, *a, **kw)
        except Exception as e:
            self._fail(f"{method.__name__}: {type(e).__name__}: {e}")
            return None
    return wrapper


# What _start_server sets for this start's place, not for the engine: its slot's GPUs and
# compile cache, the plugin's counter file, a start ahead's ready timeout. Recorded in
# launch.kit_env with the rest; an exported config leaves them out (export.py).
PLACE_ENV = frozenset({"CUDA_VISIBLE_DEVICES", "VLLM_CACHE_ROOT", PB_STATS_ENV, "VLLM_ENGINE_READY_TIMEOUT_S"})


class PointStart:
    """Start `start` of the point in `plan`, its files in `start_dir` (points/<id>/s<k>/).
    `slot_lock`: the sweep's lock file for this start's GPUs (slots.SlotLock), taken
    before the server starts and given back once it has stopped."""

    def __init__(self, plan: PointPlan, start_dir: str | Path, start: int = 1, block: int | None = None,
                 gpu_indices: list[int] | None = None, slot_lock: str | Path | None = None):
        self.plan, self.study, self.point = plan, plan.study, plan.point
        self.dir = Path(start_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        for stale in self.dir.iterdir():  # a re-run of a start starts clean (its notebook aside)
            if stale.is_file() and stale.suffix != ".ipynb":
                stale.unlink()
        self.gpu_indices = gpu_indices
        self.server: VllmServer | None = None
        self.url = self.model_name = self.api_key = self.proxy = None  # set by launch()
        self.rounds: list[RoundRecord] = []
        self.slot_lock = SlotLock(slot_lock) if slot_lock else None
        self.nvml = NvmlProbe(gpu_indices)  # not machine.describe(): its CPU probe imports torch (seconds)
        self.record = StartRecord(point=self.point.id, start=start, block=block, started_utc=now_utc(),
                                  launch=Launch(), host=platform.node(), gpus=self.nvml.describe(),
                                  no_gpu_reason=None if self.nvml.available else self.nvml.why,
                                  rounds_planned=self.study.steps_per_start, warnings=list(self.point.warnings))
        self._save()

    # -- bookkeeping --------------------------------------------------------
    @property
    def failed(self) -> bool:
        return self.record.status == "failed"

    def _fail(self, reason: str) -> None:
        self.record.status, self.record.reason = "failed", reason
        self._save()

    def _save(self) -> None:
        self.record.save(self.dir / START)

    def _mark(self, step: str, save: bool = False) -> None:
        self.record.timeline[step] = time.time()  # results.TIMELINE
        if save:
            self._save()

    # -- steps --------------------------------------------------------------
    @_step
    def launch(self) -> None:
        """Start this point's vLLM, or, for an endpoint target, check that it answers.
        Under the sweep it first takes its slot (the previous server there has stopped),
        or, started ahead (server.start_ahead), spawns at once and is held at its engine's
        init until it has the slot. The tokenizer and the workload (10-15 s of CPU:
        transformers' import, the tokenizer, the word pieces, a round's prompts) are built
        while vLLM starts."""
        model, dummy = models.resolve(self.study.model)  # also the tokenizer that sizes prompts for targets
        planned_block = self.point.effective.block_size if self.point.effective else None
        ahead = self._start_ahead_wanted() and not self._take_slot(wait=False)
        if not ahead:
            self._take_slot()
        with ThreadPoolExecutor(1) as pool:
            built = pool.submit(self._build_workload, model, planned_block)
            if self.point.target:
                self._connect(self.point.target)
            else:
                self._start_server(model, dummy, ahead)
            expected = built.result()
        block = int(self.record.launch.cache_config.get("block_size") or planned_block or 0)
        if block and block != planned_block:  # the server chose another block size than planned
            expected = self._expected_hit_rate(block)
        if not self.failed:
            self.record.expected_prefix_hit_rate = expected
        self._save()

    def _take_slot(self, wait: bool = True) -> bool:
        """Wait for the slot's previous start to stop its server (wait=False: take the
        slot only if it is free now, and say whether it was); a server whose start died
        holding the slot (its pgid still in the lock file) is stopped first."""
        lock = self.slot_lock
        if lock is None or lock.held:
            return True
        t0 = time.monotonic()
        if not lock.acquire(wait):
            return False
        self.record.launch.slot_wait_s = time.monotonic() - t0
        previous = lock.path.read_text().strip()  # the previous holder's server pgid file
        if previous and stop_group_from_file(Path(previous)):
            self.record.warnings.append(f"stopped a server that the slot's previous start left running ({previous})")
        lock.path.write_text(str(pgid_path(self.dir / LOG).resolve()))
        self.record.started_utc = now_utc()  # the slot's time starts here, not at the wait
        self._mark("slot", save=True)  # the sweep reads it: the slot's next start may now prepare
        return True

    def _start_ahead_wanted(self) -> bool:
        """server.start_ahead, where there is a slot to wait for and vLLM will log the
        line the hold is timed by."""
        s = self.study.server
        if not s.start_ahead or self.slot_lock is None or self.point.target:
            return False
        why = engine_init_visible({**os.environ, **s.env})
        if why:
            self.record.warnings.append(f"not started ahead of its slot: {why}")
        return why is None

    def _hold_for_slot(self) -> None:
        """The server started ahead is frozen at its engine's init: wait for the slot."""
        self._mark("held", save=True)
        self._take_slot()

    def _build_workload(self, model: str, block: int | None) -> float | None:
        """The tokenizer and the workload; returns the expected hit rate at `block`."""
        from transformers import AutoTokenizer
        self.tokenizer = AutoTokenizer.from_pretrained(model)
        w = self.study.workload
        if w.kind == "trace":
            self.workload = self._trace_workload()
        else:
            self.workload = make_workload(self.tokenizer, w)
        return self._expected_hit_rate(block) if block else None

    def _trace_workload(self):
        """The trace's window, less the requests longer than the server allows (counted in
        start.json), as prompts of exact length and prefix structure."""
        w = self.study.workload
        trace = read_trace(w.trace)
        limit = (self.point.effective.max_model_len if self.point.effective else None) \
            or models.max_positions(self.study.model)
        kept, dropped = trace.fit(limit) if limit else (trace, 0)
        wl = TraceWorkload(self.tokenizer, api=w.api, seed=w.seed, trace=kept)
        self.record.trace = {"source": trace.source, "format": w.trace.format, "start_s": w.trace.start_s,
                             "requests": len(kept.requests), "dropped_over_max_model_len": dropped,
                             "max_model_len": limit, "skipped": kept.skipped, "inexact": wl.inexact,
                             "rate": kept.rate, "duration_s": kept.duration_s}
        return wl

    def _expected_hit_rate(self, block: int) -> float | None:
        """What a cache that never evicts would hit (the report puts it beside the measured
        rate), for the workloads that share a prefix; a trace's from its prefix block ids."""
        if self.study.workload.kind == "trace":
            return self.workload.expected_hit_rate()
        if self.study.workload.kind not in ("shared_prefix", "mixed", "eviction"):
            return None
        return self.workload.expected_hit_rate(self.study.workload.requests_per_round, block)

    def _connect(self, t) -> None:
        self.url, self.model_name, self.proxy = t.base_url, t.model, t.proxy
        # Only the variable's name is recorded; the key stays in memory.
        self.record.launch.target = {"name": t.name, "base_url": t.base_url, "model": t.model,
                                     "api_key_env": t.api_key_env, "proxy": t.proxy}
        if t.api_key_env:
            self.api_key = os.environ.get(t.api_key_env)
            if not self.api_key:
                self._fail(f"environment variable {t.api_key_env} (the API key of target "
                           f"{t.name}) is not set; export it before the run")
                return
        try:
            client.check_endpoint(self.url, self.model_name, self.api_key, proxy=self.proxy)
        except client.EndpointError as e:
            self._fail(f"target {t.name}: {e}")
            return
        api = counters.probe_server_api(self.url, self.api_key, self.proxy)
        self._mark("ready")
        self.record.launch.has_metrics = api.snapshot is not None
        self.record.launch.cache_reset = api.cache_reset
        if api.snapshot is not None:
            self.record.launch.cache_config = counters.cache_config(api.snapshot)
        self.record.warnings += api.notes

    def _start_server(self, model: str, dummy: bool, ahead: bool = False) -> None:
        s = self.study
        port = free_port()
        cmd = serve_command(model, port, self.point.engine_args.cli(), s.model.served_name,
                            load_dummy=dummy, extra=s.server.extra_cli_args + self._measurement_flags())
        env = dict(s.server.env)
        if self.gpu_indices is not None:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, self.gpu_indices))
            env.update(compile_cache_env(self.gpu_indices))
        if self.point.prefix_budget:
            # the plugin's counters, per start; by environment so vLLM's compile cache key stays put
            env[PB_STATS_ENV] = str(self.pb_stats_path)
        if s.server.start_ahead:
            # on every start of the study, held or not: VLLM_ENGINE_READY_TIMEOUT_S is in
            # vLLM's torch.compile cache key (envs.compile_factors), so setting it on held
            # starts only would make each config's first held start compile again
            env.update(VllmServer.ahead_env({**os.environ, **env}))
        self.record.launch.command = cmd
        self.record.launch.started_ahead = ahead
        self.server = VllmServer(cmd, port, self.dir / LOG, env=env, startup_timeout_s=s.server.startup_timeout_s)
        self.record.launch.kit_env = {**{k: v for k, v in env.items() if k not in s.server.env}, **self.server.uni_env}
        atexit.register(self.server.stop)  # a kernel that dies mid-point stops its server
        try:
            self._mark("spawn", save=True)  # with "slot", the sweep lets the slot's next start prepare
            self.server.start(hold=self._hold_for_slot if ahead else None)
            self._mark("ready")
            reason = None
        except ServerStartError as e:
            reason = e.reason
        self.record.launch.ahead_cpus = self.server.ahead_cpus
        self.record.launch.ahead_priority_restored = self.server.priority_restored
        if self.server.priority_restored is False:
            self.record.warnings.append("started ahead at nice 19, and its priority could not be raised back once "
                                        "released (that needs CAP_SYS_NICE): it measured at nice 19")
        if self.server.hold_missed:
            self.record.timeline.pop("held", None)  # never frozen: its life on the GPU began at its spawn
            self.record.warnings.append("started ahead, but vLLM was healthy before its engine-init line was seen: "
                                        "its GPU start-up ran beside the slot's previous server")
        self.record.launch.vllm_non_default_args = _non_default_args(read_log(self.dir))
        if reason:
            self._fail(f"server did not start: {reason}")
            return
        self.record.launch.server_pgid = self.server.proc.pid
        self.record.launch.startup_s = self.server.startup_s
        self.url, self.model_name = self.server.url, s.model.served_name
        self.record.launch.cache_config = counters.cache_config(counters.scrape(self.server.url))
        client.check_endpoint(self.server.url, s.model.served_name)

    def _measurement_flags(self) -> list[str]:
        """Flags that make the server count what the report needs, where this vLLM takes
        them and the study does not set them itself: a histogram bound at the chunk budget
        (counters.long_prefills) and, on a GPU, vLLM's FLOP and byte estimates (hardware.py)."""
        given = {a.split("=", 1)[0] for a in self.study.server.extra_cli_args}
        flags = []
        pb = self.point.prefix_budget
        if pb:
            flags += ["--scheduler-cls", "vllm_study.prefix_budget.PrefixBudgetScheduler", "--additional-config",
                      json.dumps({"prefix_budget": {"min_reuse_ratio": pb.min_reuse_ratio,
                                                    "max_defer_ms": pb.max_defer_ms}})]
        mbt = self.point.effective.max_num_batched_tokens
        if mbt and "--custom-histogram-buckets" not in given and vllm_accepts("--custom-histogram-buckets"):
            flags += ["--custom-histogram-buckets", json.dumps(counters.budget_buckets(mbt))]
        if (self.plan.engine == "gpu" and "--enable-mfu-metrics" not in given
                and vllm_accepts("--enable-mfu-metrics")):
            flags.append("--enable-mfu-metrics")
        return flags

    @property
    def pb_stats_path(self) -> Path:
        return self.dir / "prefix_budget.json"

    def _pb_snapshot(self) -> dict | None:
        if not self.point.prefix_budget:
            return None
        try:
            return read_pb_stats(self.pb_stats_path)
        except (OSError, ValueError):  # not written yet: the engine has not scheduled
            return None

    def _round_server_figures(self, before: dict, after: dict, duration: float) -> dict:
        """/metrics deltas, whether the chunk budget bound, and hardware use."""
        values = counters.round_deltas(before, after) | counters.work_deltas(before, after)
        if self.point.effective and self.point.effective.max_num_batched_tokens:
            values |= counters.long_prefills(before, after, self.point.effective.max_num_batched_tokens)
        gpus = self.record.gpus
        figures, source = hardware.use(values, duration, gpus[0].name if gpus else None,
                                       self.point.engine_args.tensor_parallel_size or 1,
                                       models.local_config(self.study.model))
        if source:
            self.record.launch.hardware_source = source
        return values | figures

    def _run_closed(self, requests) -> list[dict]:
        w = self.study.workload
        return [r.to_dict() for r in client.run_sync(client.run_closed_loop(
            self.url, self.model_name, w.api, requests, w.concurrency, timeout_s=w.request_timeout_s,
            api_key=self.api_key, proxy=self.proxy))]

    def _prepare_round(self, load_value: float | None = None):
        """The round's requests and the coroutine that sends them, built before the
        round's clock starts (tokenizing prompts is not the server's time). load_value:
        a capacity step's load, in capacity.over's unit, in place of the study's."""
        w = self.study.workload
        n, load = w.requests_per_round, w.load
        over = self.study.capacity.over if load_value is not None else None
        common = dict(timeout_s=w.request_timeout_s, api_key=self.api_key, proxy=self.proxy)
        if w.kind == "multi_turn":  # turns are built as answers arrive
            return client.run_conversations(self.url, self.model_name, self.workload, n // w.turns,
                                            w.concurrency, w.think_time_s, **common)
        if w.kind == "trace":
            speed = capacity.trace_speed(over, load_value, self.workload.trace.rate, w.trace.speed)
            return client.run_open_loop(self.url, self.model_name, w.api, self.workload.requests(),
                                        self.workload.schedule(speed), **common)
        requests = self.workload.requests(n)
        if load.kind == "closed":
            c = int(load_value) if over == "concurrency" else w.concurrency
            return client.run_closed_loop(self.url, self.model_name, w.api, requests, c, **common)
        if load.kind == "poisson":
            rate = load_value if over == "rate" else load.rate
            times = loads.arrivals(n, rate, load.burstiness, w.seed)
        else:
            times, step = loads.ladder(n, load.rates, load.burstiness, w.seed)
            requests = [replace(r, tags={**r.tags, "step": rate}) for r, rate in zip(requests, step)]
        return client.run_open_loop(self.url, self.model_name, w.api, requests, times,
                                    max_concurrency=load.max_concurrency, **common)

    @_step
    def warmup(self) -> None:
        """Requests from a separate stream, excluded from every statistic."""
        n = self.study.workload.warmup_requests
        self._mark("warmup")
        if n:
            res = self._run_closed(self.workload.requests(n, "warmup"))
            self.record.warmup_errors = sum(1 for r in res if r["error"])
            self._save()

    @_step
    def run_round(self, index: int, load: float | None = None) -> RoundRecord | None:
        """One measured round; `load`: a capacity step's load (judged against the SLO)."""
        launch = self.record.launch
        if launch.cache_reset:
            counters.reset_prefix_cache(self.url, self.api_key, self.proxy)  # every round starts cold
        before = counters.scrape(self.url, self.api_key, self.proxy) if launch.has_metrics else None
        pb_before = self._pb_snapshot()
        sending = self._prepare_round(load)
        sampler = counters.RoundSampler(self.url if launch.has_metrics else None, self.nvml,
                                        api_key=self.api_key, proxy=self.proxy)
        with sampler:
            t0 = time.perf_counter()
            results = [r.to_dict() for r in client.run_sync(sending)]
            duration = _send_to_finish(results) or time.perf_counter() - t0
        values = stats.round_metrics(results, duration, self.study.slo)
        values["expected_prefix_hit_rate"] = self.record.expected_prefix_hit_rate
        if self.study.workload.kind == "trace":
            values |= self.workload.fidelity(results)
        died = self.server is not None and not self.server.alive()
        if not died:
            if before is not None:
                after = counters.scrape(self.url, self.api_key, self.proxy)
                values |= self._round_server_figures(before, after, duration)
            values |= sampler.result()
            values |= _budget_figures(pb_before, self._pb_snapshot())
        ok = not died and values["completed"] > 0
        rec = RoundRecord(point=self.point.id, start=self.record.start, round=index, block=self.record.block,
                          status="ok" if ok else "failed", utc=now_utc(), errors=stats.errors(results),
                          metrics=values, groups=stats.group_records(results), load=load)
        if load is not None:
            rec.slo_met, rec.slo_why = capacity.judge(values, self.study.capacity.slo,
                                                      None if ok else "the server died" if died else "round failed")
        self.rounds.append(rec)
        append_round(self.dir, rec, results)
        if died:
            # rounds are numbered from 0 in the records, from 1 in words
            self._fail(f"server died during round {index + 1} of {self.record.rounds_planned}: "
                       f"{failure_reason(read_log(self.dir), self.server.proc.returncode)}")
        elif ok:
            self.record.rounds_ok += 1
            self._save()
        return rec

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
        self._mark("measured", save=True)

    def search_capacity(self, progress=None) -> None:
        """capacity.Search over this start's server, one round a step; the record is saved
        after every step, so a start that dies mid-search keeps what it measured."""
        c = self.study.capacity
        search = capacity.Search(c.over, c.lo, c.hi, c.precision, c.max_steps)

        def measure(load: float) -> capacity.Step:
            if self.failed:
                return capacity.Step(load, False, f"start failed: {self.record.reason}")
            i = len(self.rounds)
            rec = self.run_round(i, load)
            if progress:
                progress(i)
            if rec is None:
                return capacity.Step(load, False, self.record.reason or "round failed")
            return capacity.Step(load, bool(rec.slo_met), rec.slo_why or "", rec.round)
        result = search.run(measure)
        result.requests_per_s = self._requests_per_s(result)
        self.record.capacity = result
        self._mark("measured", save=True)

    def _requests_per_s(self, result: capacity.CapacityRecord) -> float | None:
        """The capacity in requests/s: the offered rate of an open-loop search, the measured
        throughput at the capacity of a closed-loop one."""
        if result.load is None:
            return None
        if result.over == "speed":
            return result.load * self.workload.trace.rate
        if result.over == "rate":
            return result.load
        at = next((r for r in self.rounds if r.round == result.at_round), None)
        return at.metrics.get("request_throughput") if at else None

    def finish(self) -> PointSummary:
        """Stop the server, close this start's record, and summarize the point over
        every start it has so far. The slot is handed on as soon as the server is gone."""
        if self.server:
            self._mark("stop")
            self.server.stop()
            self._mark("stopped")
        if self.slot_lock:
            self.slot_lock.release()
        if self.server:
            compress_log(self.dir)
        if not self.failed:
            if self.study.capacity:
                self.record.status = "ok" if self.record.capacity else "failed"
                if not self.record.capacity:
                    self.record.reason = "the capacity search did not run"
            elif self.record.rounds_ok < self.study.rounds:
                self._fail(f"only {self.record.rounds_ok} of {self.study.rounds} rounds completed a request")
            else:
                self.record.status = "ok"
        self.record.finished_utc = now_utc()
        self._save()
        return summarize(PointFolder(self.dir.parent), self.plan)


def _send_to_finish(results: list[dict]) -> float | None:
    """The round's clock (metrics.py: duration_s): first send to last finish, read from the requests'
    own timestamps, so starting the sender's event loop is not counted."""
    ends = [r["end_time"] for r in results if r.get("end_time") is not None]
    return max(ends) - min(r["send_time"] for r in results) if ends else None


def _budget_figures(before: dict | None, after: dict | None) -> dict:
    """The Prefix Reuse Budget's counters over one round (prefix_budget.stats_delta)."""
    if after is None:
        return {}
    if before is None:  # the engine wrote its first counters during the round
        before = {**after, "counters": {k: 0 for k in after["counters"]}, **{k: [] for k in PB_SERIES}}
    d = stats_delta(before, after)
    return {"pb_deferred": d["deferred"], "pb_admitted_by_age": d["admitted_by_age"],
            "pb_admitted_idle": d["admitted_idle"], "pb_defer_ms_p50": d["defer_ms_p50"],
            "pb_defer_ms_p99": d["defer_ms_p99"], "pb_defer_ms_max": d["defer_ms_max"]}


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
    if study.capacity and searched:
        for name in ("capacity_rps", "capacity_load"):
            estimates[name] = stats.estimate([[capacity_figures(c)[name]] for c in searched.values()])
    summary = PointSummary(
        point=point.id, values=point.values, status=status, reasons=reasons, starts_planned=n_starts,
        starts_done=done, rounds_planned=planned, rounds_ok=len(ok_rounds), engine=plan.engine,
        engine_args=point.engine_args.model_dump(exclude_none=True), effective=point.effective,
        launch=first_up.launch if first_up else None, warnings=sorted({w for s in starts for w in s.warnings}),
        estimates=estimates, groups=stats.group_estimates(rounds))
    summary.save(folder.summary_path)
    return summary
