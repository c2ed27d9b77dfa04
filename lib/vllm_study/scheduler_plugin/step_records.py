"""The engine side of step records (steps.py holds the file format): a mixin that
timestamps each engine step of a vLLM scheduler and appends one row a step to the raw
file named by ``VLLM_STUDY_STEPS``. Without that variable it records nothing: one
attribute test a call.

Where the columns come from (line numbers read in vLLM 0.32.0, vllm/v1/core/sched/; on
0.26.0 the mixin relies only on what the kit's other plugin code already reads there,
``self.requests``, ``num_computed_tokens``, ``num_prompt_tokens``,
``kv_cache_manager``, and falls back where an attribute may be missing:
``get_request_counts``, ``preempted_req_ids``):
- A request whose computed tokens before the step were below its prompt length is a
  prefill (a chunk or all of its prompt; a preempted one recomputing its prompt too),
  any other a decode (one token, or 1 + its draft tokens with speculative decoding).
  The mixin keeps the few requests inside their prompt by id: a request joins when
  admitted (``scheduled_new_reqs``) or resumed from preemption below its prompt
  length, and leaves once schedule() has advanced its ``num_computed_tokens`` past
  the prompt (``Scheduler._update_after_schedule``, at the end of schedule(); 0.32
  scheduler.py l.1555 and l.1616-1648; AsyncScheduler's override calls it first).
  Decode requests and tokens are the step's others: no visit to each decoding request.
- ``context_tokens``: the sums of ``NewRequestData.num_computed_tokens`` and
  ``CachedRequestData.num_computed_tokens``, both taken before the step advances them
  (0.32 scheduler.py l.1441 builds the cached list, l.1555 advances the counts).
- ``cached_tokens``: ``NewRequestData.num_computed_tokens`` of the step's
  ``scheduled_new_reqs``: what the prefix cache (or a KV connector) gave a request
  at its admission, so prefill tokens + cached tokens = prompt tokens over a request's
  life.
- ``preempted``: ``SchedulerOutput.preempted_req_ids``, the requests preempted since
  the previous schedule() (0.32 output.py l.269, scheduler.py l.1509 and l.1614).
- ``running`` / ``waiting``: ``get_request_counts()`` where vLLM has it (0.32
  scheduler.py l.2608: waiting includes KV-holding waiting requests), else the queues'
  lengths; ``kv_usage``: ``kv_cache_manager.usage`` (both).
- ``prefill_context_tokens``: for each request inside its prompt, its
  ``num_computed_tokens`` less the tokens scheduled for it (schedule() has advanced the
  count by then), summed: the prefix a chunk's attention reads.
- ``prefill_attention_pairs``: for each request inside its prompt, ``n * c + n (n + 1)
  / 2`` with n its scheduled tokens and c its context before them, summed: the causal
  attention's query-key pairs, its work. On one H100 a full chunk's cost per context
  token grew with the chunk (about 1.15 us at 2048, 3.07 us at 8192), as this product does.

Pairing a step with its output: EngineCore calls ``update_from_output(scheduler_output,
model_output)`` with the very SchedulerOutput schedule() returned. Under async
scheduling its batch queue holds up to two steps in flight (vllm/v1/engine/core.py:
``max_concurrent_batches`` 2; 0.32 ``step_with_batch_queue`` l.698-812: appendleft on
schedule, pop on output, so outputs come back first in, first out). The mixin keeps
its open rows in a FIFO and pairs by identity: the head matches; a step whose output
never came back (a batch the engine dropped) is passed over, not paired with the wrong
output. Steps that scheduled no token (no forward pass) are not recorded, but the
engine's batch queue holds them and returns them in turn: such an output pairs with
nothing and leaves the open rows alone (before this, it passed over every step scheduled
after it, and rounds on a GPU lost most of their later rows).

Writes: rows collect in a list of tuples and go to the file as one ``os.write`` of
packed bytes every ``FLUSH_S``, whenever the engine holds no request (so a round's last
steps are on disk by the time its last answer reaches the client), and at shutdown.
Per step: a visit to each request inside its prompt and sums over the output's lists;
no work per decoding request in Python, none per token.
"""
from __future__ import annotations

import logging
import os
import time
from collections import deque

import numpy as np

from .steps import DTYPE, STEPS_ENV

log = logging.getLogger(f"vllm.plugins.{__name__}")  # under vLLM's "vllm" logger: its handlers and format
FLUSH_S = 0.5


def steps_path_for(vllm_config) -> str | None:
    """The raw file for this EngineCore: ``VLLM_STUDY_STEPS``, with ``.dp<rank>`` where
    data parallelism runs one EngineCore (and one scheduler) per rank."""
    path = os.environ.get(STEPS_ENV) or None
    pc = getattr(vllm_config, "parallel_config", None)
    if path and pc is not None and getattr(pc, "data_parallel_size", 1) > 1:
        path = f"{path}.dp{getattr(pc, 'data_parallel_rank', 0)}"
    return path


class StepRecordsMixin:
    """Records every engine step of a vLLM scheduler class (put it first in the bases,
    so its clock reads when the engine calls schedule())."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        path = steps_path_for(self.vllm_config)
        self._sr_fd: int | None = None
        if not path:
            self._sr_on = False
            return
        self._sr_on = True
        self._sr_path = path
        self._sr_open: deque = deque()   # (SchedulerOutput, row without t_done), oldest first
        self._sr_rows: list[tuple] = []  # finished rows not yet written
        self._sr_last_flush = time.monotonic()
        self._sr_unpaired = 0
        self._sr_prefill: dict[str, int] = {}  # request id -> prompt length, for requests inside their prompt
        self._sr_counts = getattr(self, "get_request_counts", None)
        self._sr_fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        log.info("step records -> %s", path)

    def schedule(self, *args, **kwargs):
        if not self._sr_on:
            return super().schedule(*args, **kwargs)
        t = time.monotonic()
        out = super().schedule(*args, **kwargs)
        if out.total_num_scheduled_tokens:
            self._sr_open.append((out, self._sr_row(out, t)))
        return out

    def update_from_output(self, scheduler_output, model_runner_output):
        if not self._sr_on:
            return super().update_from_output(scheduler_output, model_runner_output)
        t = time.monotonic()
        q = self._sr_open
        # an empty step (never queued here) comes back in its turn too: it must not take
        # the steps scheduled after it along (a queue of at most 2: the check is cheap)
        while q and any(out is scheduler_output for out, _ in q):
            out, row = q.popleft()
            if out is scheduler_output:
                self._sr_rows.append((row[0], t, *row[1:]))
                break
            self._sr_unpaired += 1  # its output never came back: not a step we can time
        result = super().update_from_output(scheduler_output, model_runner_output)
        if self._sr_rows and (t - self._sr_last_flush >= FLUSH_S or not self.requests):
            self._sr_flush(t)
        return result

    def shutdown(self) -> None:
        try:
            super().shutdown()
        finally:
            if self._sr_fd is not None:
                self._sr_flush(time.monotonic())
                os.close(self._sr_fd)
                self._sr_fd = None
                if self._sr_unpaired:
                    log.warning("step records: %d scheduled steps never had their output back",
                                self._sr_unpaired)

    # -- helpers ----------------------------------------------------------------------
    def _sr_row(self, out, t_scheduled: float) -> tuple:
        """The step's columns but t_done (steps.COLUMNS order, t_done left out). Only the
        requests inside their prompt are visited one by one (a few a step: the token
        budget bounds them); decode counts are the rest, and context tokens are summed
        from the output's own lists."""
        reqs, sched, prefill = self.requests, out.num_scheduled_tokens, self._sr_prefill
        new = out.scheduled_new_reqs
        cached_reqs = out.scheduled_cached_reqs
        for nr in new:  # admitted this step: inside the prompt unless the cache held all of it
            r = reqs[nr.req_id]
            if nr.num_computed_tokens < r.num_prompt_tokens:
                prefill[nr.req_id] = r.num_prompt_tokens
        for rid in self._sr_resumed(cached_reqs):  # back from preemption: recomputing from its cached prefix
            r = reqs[rid]
            if r.num_computed_tokens - sched[rid] < r.num_prompt_tokens:
                prefill[rid] = r.num_prompt_tokens
        p_tok = p_req = p_ctx = p_att = 0
        for rid, prompt in list(prefill.items()):
            n = sched.get(rid)
            if n is None:
                if rid not in reqs:  # finished or aborted inside its prompt
                    del prefill[rid]
                continue
            p_tok += n
            p_req += 1
            c = reqs[rid].num_computed_tokens - n  # (advanced by schedule()) before the step
            p_ctx += c
            p_att += n * c + n * (n + 1) // 2
            if reqs[rid].num_computed_tokens >= prompt:  # (advanced by schedule()) its prompt is done
                del prefill[rid]
        cached = sum(nr.num_computed_tokens for nr in new)
        ctx = cached + sum(cached_reqs.num_computed_tokens)  # both lists hold the counts before the step
        if self._sr_counts is not None:
            running, waiting = self._sr_counts()
        else:  # an older vLLM without get_request_counts
            running, waiting = len(self.running), len(self.waiting)
        preempted = len(getattr(out, "preempted_req_ids", None) or ())
        return (t_scheduled, p_tok, p_req, len(sched) - p_req, out.total_num_scheduled_tokens - p_tok, ctx,
                cached, running, waiting, preempted, self.kv_cache_manager.usage, p_ctx, p_att)

    @staticmethod
    def _sr_resumed(cached_reqs):
        """Requests resumed from preemption this step: a set in 0.32 (CachedRequestData
        .resumed_req_ids), a flag a request in earlier releases (resumed_from_preemption)."""
        ids = getattr(cached_reqs, "resumed_req_ids", None)
        if ids is not None:
            return ids
        flags = getattr(cached_reqs, "resumed_from_preemption", None) or ()
        return [rid for rid, f in zip(cached_reqs.req_ids, flags) if f]

    def _sr_flush(self, now: float) -> None:
        self._sr_last_flush = now
        if not self._sr_rows or self._sr_fd is None:
            return
        data = np.array(self._sr_rows, dtype=DTYPE).tobytes()
        self._sr_rows = []
        try:
            os.write(self._sr_fd, data)  # one append: a reader sees whole rows or a torn last one
        except OSError:  # a full disk must not stop the engine: the records stop, said once
            log.exception("step records: writing %s failed; recording stops", self._sr_path)
            self._sr_on = False
