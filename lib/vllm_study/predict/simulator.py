"""The engine loop in virtual time: vLLM's scheduler (engine.build_scheduler) stepped as
EngineCore steps it, each step lasting what the step-time model predicts for it.

One iteration, as vllm/v1/engine/core.py runs it: the requests that arrived are added
(add_request), schedule() picks the step's tokens, the step runs for step_time(row)
seconds of virtual time, and update_from_output() takes a ModelRunnerOutput that holds
one sampled token for each request past its prompt and none for one still inside it.
With async scheduling (AsyncScheduler, a GPU engine's default) the loop is
step_with_batch_queue's: the next step is scheduled before the previous one's output
is back (at most two in flight), and a step starts when the previous one ends. A step
model with next-step terms (step_model: admission_s) charges the step it schedules'
admission work to the step in flight, as the real engine pays it there.

Each step leaves a row of scheduler_plugin.steps.DTYPE, the columns a real start's step
records have, so a simulated round and a measured one compare column for column.
"""
from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from ..scheduler_plugin.steps import DTYPE
from .engine import EngineSpec, build_scheduler, request_factory

StepTime = Callable[[np.ndarray], np.ndarray]  # rows of steps.DTYPE -> seconds each (or a model with .predict)
_SAMPLED = 0  # the token every step samples (ignore_eos: its value never stops a request)


@dataclass
class Tracked:
    """A request in the virtual engine: when it was sent and when each token came out."""
    key: int
    prompt_tokens: int
    max_tokens: int
    send_time: float
    token_times: list[float] = field(default_factory=list)
    end_time: float | None = None


@dataclass
class _Batch:
    output: object      # SchedulerOutput
    sampled: list[str]  # request ids that sample a token in this step
    done: float         # virtual time its output is back


class VirtualEngine:
    """vLLM's scheduler for `spec` stepped in virtual time (seconds from 0). Submit
    requests with `submit` (at the engine's current time or a later arrival time); `run`
    steps until the engine and the arrivals are spent, calling on_finish(key, time) for
    each request as it finishes (a closed-loop client submits its next one there)."""

    def __init__(self, spec: EngineSpec, step_time: StepTime, rng: np.random.Generator | None = None):
        # a step-time model (step_model.StepModel: its own_s, admission_s for the step in
        # flight, and with `rng` its jitter: each step's time drawn about the fit as the
        # measured steps spread) or any callable rows -> seconds
        self.spec = spec
        self.step_time = getattr(step_time, "own_s", None) or getattr(step_time, "predict", step_time)
        self._admission = getattr(step_time, "admission_s", None)
        self._jitter = getattr(step_time, "jitter", None) if rng is not None else None
        self._rng = rng
        self.scheduler = build_scheduler(spec)
        self._make = request_factory(spec.block_size)
        self.now = 0.0
        self.tracked: dict[str, Tracked] = {}
        self._arrivals: list[tuple[float, int, str, object]] = []  # heap: (time, seq, id, vLLM Request)
        self._seq = 0
        self._rows: list[tuple] = []
        self._queue: list[_Batch] = []
        self._depth = 2 if spec.async_scheduling else 1  # EngineCore's max_concurrent_batches
        # vLLM's own prefix-cache counts (its PrefixCacheStats: what vllm:prefix_cache_queries
        # and _hits add up), summed over every step so far
        self.cache_queries = self.cache_hits = 0
        clock = getattr(self.scheduler, "use_clock", None)  # the plugin's deferral ages, in virtual time
        if clock is not None:
            clock(lambda: self.now)

    # -- the client's side ----------------------------------------------------------------
    def submit(self, key: int, token_ids: list[int], max_tokens: int, at: float | None = None,
               sent: float | None = None) -> str:
        """A request reaching the engine at `at` (default: now), sent by the client at `sent`
        (default: `at`; earlier where a front end stands between); its id in the engine."""
        at = self.now if at is None else at
        if at < self.now:
            raise ValueError(f"request {key}: sent at {at:.6f} s, before the engine's time {self.now:.6f} s")
        if len(token_ids) + max_tokens > self.spec.max_model_len:
            raise ValueError(f"request {key}: {len(token_ids)} prompt + {max_tokens} output tokens exceed "
                             f"max_model_len {self.spec.max_model_len} (the server would refuse it)")
        rid = f"{key}-{self._seq}"
        self.tracked[rid] = Tracked(key, len(token_ids), max_tokens, at if sent is None else sent)
        heapq.heappush(self._arrivals, (at, self._seq, rid, self._make(rid, token_ids, max_tokens, at)))
        self._seq += 1
        return rid

    # -- the engine loop ------------------------------------------------------------------
    def run(self, on_finish: Callable[[int, float], None] | None = None) -> None:
        sched = self.scheduler
        while True:
            self._admit()
            if len(self._queue) < self._depth and sched.has_unfinished_requests() and self._schedule():
                continue
            if self._queue:
                self._finish_oldest(on_finish)
                continue
            if not self._arrivals:
                if sched.has_unfinished_requests():
                    raise RuntimeError("the scheduler holds requests it never schedules and nothing else "
                                       f"arrives: the KV pool ({self.spec.num_blocks} blocks of "
                                       f"{self.spec.block_size}) cannot hold one of them")
                return
            self.now = max(self.now, self._arrivals[0][0])  # idle (or stuck on KV): on to the next arrival

    def _admit(self) -> None:
        while self._arrivals and self._arrivals[0][0] <= self.now:
            _, _, _, req = heapq.heappop(self._arrivals)
            self.scheduler.add_request(req)

    def _schedule(self) -> bool:
        """Schedule one step and put it in flight; False when the scheduler picked nothing
        (its empty output is handed back at once, as EngineCore does, taking no time)."""
        from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT

        sched = self.scheduler
        out = sched.schedule()
        n = out.num_scheduled_tokens
        if not n:
            self._take(sched.update_from_output(out, EMPTY_MODEL_RUNNER_OUTPUT), None)
            return False
        pre = {d.req_id: d.num_computed_tokens for d in out.scheduled_new_reqs}
        cached = out.scheduled_cached_reqs
        pre.update(zip(cached.req_ids, cached.num_computed_tokens))
        prefill_tokens = prefill_reqs = decode_reqs = decode_tokens = context = prefill_context = attention = 0
        sampled = []
        for rid, k in n.items():
            req = sched.requests[rid]
            p = pre[rid]
            context += p
            if p < req.num_prompt_tokens:  # inside its prompt (as the kit's step records count it)
                prefill_tokens += k
                prefill_reqs += 1
                prefill_context += p
                attention += k * p + k * (k + 1) // 2   # the chunk's causal query-key pairs
            else:
                decode_reqs += 1
                decode_tokens += k
            if p + k >= req.num_tokens:  # the step reaches its last token: it samples one
                sampled.append(rid)
        new_cached = sum(d.num_computed_tokens for d in out.scheduled_new_reqs)
        preempted = len(getattr(out, "preempted_req_ids", None) or ())
        counts = getattr(sched, "get_request_counts", None)  # 0.32: waiting includes KV-holding ones
        running, waiting = counts() if counts else (len(sched.running), len(sched.waiting))
        row = (self.now, 0.0, prefill_tokens, prefill_reqs, decode_reqs, decode_tokens, context, new_cached,
               running, waiting, preempted, float(sched.kv_cache_manager.usage), prefill_context, attention)
        one = np.array([row], dtype=DTYPE)
        dt = float(self.step_time(one)[0])
        if self._jitter is not None:
            dt *= float(self._jitter(one, self._rng)[0])
        if not dt > 0:
            raise ValueError(f"the step-time model gave {dt!r} s for a step of {prefill_tokens} prefill "
                             f"and {decode_tokens} decode tokens: a step takes a positive time")
        if self._queue and self._admission is not None:  # prepared while the step in flight runs
            extra = float(self._admission(one)[0])
            if extra:
                self._queue[-1].done += extra
                self._rows[-1] = self._rows[-1][:1] + (self._rows[-1][1] + extra,) + self._rows[-1][2:]
        start = max(self.now, self._queue[-1].done) if self._queue else self.now
        self._rows.append(row[:1] + (start + dt,) + row[2:])
        self._queue.append(_Batch(out, sampled, start + dt))
        return True

    def _finish_oldest(self, on_finish) -> None:
        from vllm.v1.outputs import ModelRunnerOutput

        batch = self._queue.pop(0)
        self.now = max(self.now, batch.done)
        ids = list(batch.output.num_scheduled_tokens)
        sampled = set(batch.sampled)
        mro = ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                sampled_token_ids=[[_SAMPLED] if r in sampled else [] for r in ids])
        self._take(self.scheduler.update_from_output(batch.output, mro), on_finish)

    def _take(self, outputs: dict, on_finish) -> None:
        """Token times, finishes and vLLM's own cache and preemption counts from a step's outputs."""
        for eco in outputs.values():
            stats = eco.scheduler_stats
            if stats is not None and stats.prefix_cache_stats is not None:
                self.cache_queries += stats.prefix_cache_stats.queries
                self.cache_hits += stats.prefix_cache_stats.hits
            for o in eco.outputs:
                t = self.tracked.get(o.request_id)
                if t is None:
                    continue
                t.token_times.extend([self.now] * len(o.new_token_ids))
                if o.finish_reason is not None:
                    t.end_time = self.now
                    if on_finish is not None:
                        on_finish(t.key, self.now)

    # -- what it leaves -------------------------------------------------------------------
    def steps(self) -> np.ndarray:
        """One row of steps.DTYPE per step run so far (times in virtual seconds)."""
        return np.array(self._rows, dtype=DTYPE)
