"""A trace study's round, beside its measurement: the window's history sent first
(trace.prime: history, workload/priming.py) and the prefix-cache model's hit rate for
the round (workload/prefix_cache_model.py), both at the server's own KV cache size.
With trace.windows, each window has its own history and its own model: a round is
primed with, and modelled on, the window it replays."""
from __future__ import annotations

import time
from dataclasses import dataclass, replace

from ..capacity.bracket import trace_speed
from ..define.traces import read_history
from ..workload import prefix_cache_model as pcm, priming


# How far vLLM's measured prefix-cache hit rate may sit from the cache model's (absolute)
# before a round is flagged: the model's stated accuracy on one H200 (docs/workloads.md).
MODEL_TOLERANCE = 0.03


def model_departure(values: dict, where: str) -> str | None:
    """The flag for a round (`where` names it) whose measured hit rate departs from the
    model's by more than MODEL_TOLERANCE, with both numbers; None otherwise."""
    measured, model = values.get("prefix_cache_hit_rate"), values.get("model_prefix_hit_rate")
    if measured is None or model is None or measured != measured or model != model:  # (NaN: a CSV's blank)
        return None
    if abs(measured - model) <= MODEL_TOLERANCE:
        return None
    return (f"{where}: vLLM's measured prefix-cache hit rate {measured:.3f} departs from the cache model's "
            f"{model:.3f} by {measured - model:+.3f} (more than {MODEL_TOLERANCE:g})")


@dataclass
class _Slot:
    """One window's workload, its history (None: not primed) and the requests priming sends."""
    workload: object
    history: priming.History | None = None
    requests: list = None


class Primer:
    """One start's priming and cache model. `record` is its StartRecord: the server's KV
    size (launch.cache_config), the window's max_model_len, and the warnings it adds.
    `windows`: trace.windows' WindowSet (workload/windows.py), whose window k is primed
    with the whole trace's rows before it; None: the one window, primed with the rows of
    its file before start_s."""

    def __init__(self, study, workload, tokenizer, record, windows=None):
        self.study, self.record = study, record
        self.spec = study.workload.trace
        c = record.launch.cache_config
        # vllm:cache_config_info's blocks x block size: the pool the model's LRU runs over
        self.kv = ((int(c["num_gpu_blocks"]) * int(c["block_size"]), int(c["block_size"]))
                   if c.get("num_gpu_blocks") and c.get("block_size") else None)
        self.slots = ([_Slot(wl) for wl in windows.workloads] if windows is not None else [_Slot(workload)])
        # prefix caching off: no block outlives its request, so history primes nothing and
        # the model (an LRU of reused blocks) does not apply; the label is vLLM's str(bool)
        self.caching = str(c.get("enable_prefix_caching", True)).lower() != "false"
        if self.spec.prime != "history":
            return
        if not self.caching:
            record.trace = {**(record.trace or {}), "prime": "none: prefix caching is off, nothing to prime"}
            return
        if self.kv is None:
            record.warnings.append("workload.trace.prime: history: the server reports no KV cache size "
                                   "(vllm:cache_config_info), so its rounds were not primed")
            return
        for k, slot in enumerate(self.slots):
            trace = slot.workload.trace
            before = (read_history(self.spec) if windows is None
                      else windows.whole.requests[:windows.plan.windows[k].start])
            slot.history = priming.select_history(
                before, trace.requests, block_tokens=trace.block_tokens, kv_tokens=self.kv[0],
                block_size=self.kv[1], max_model_len=(record.trace or {}).get("max_model_len"))
            slot.requests = priming.prime_requests(tokenizer, api=study.workload.api, seed=study.workload.seed,
                                                   history=slot.history, block_tokens=trace.block_tokens)
            if windows is None:
                note = slot.history.note()
            else:
                note = slot.history.note("its window is early in the trace")
                note = note and f"window {k + 1}: {note}"
            if note:
                record.warnings.append(note)

    @property
    def history(self) -> priming.History | None:
        """The first (or only) window's history."""
        return self.slots[0].history

    def prime(self, run_closed, window: int = 0) -> dict:
        """Send window `window`'s history (0-based), prefill-only, as fast as the server
        takes it (run_closed: the round protocol's closed loop, workload.concurrency at
        once); what it took."""
        slot = self.slots[window]
        if slot.history is None:
            return {}
        t0 = time.perf_counter()
        res = run_closed(slot.requests) if slot.requests else []
        return {"prime_s": time.perf_counter() - t0, "prime_requests": len(res),
                "prime_prompt_tokens": slot.history.prompt_tokens,
                "prime_errors": sum(1 for r in res if r["error"])}

    def model_hit_rate(self, values: dict, load: float | None, window: int = 0) -> dict:
        """The model's hit rate for a round of window `window`: the server's KV and block
        size, the window's arrivals (at the round's speed), its median TTFT and TPOT for how
        long a request holds its blocks, primed with the history the round was primed with."""
        slot = self.slots[window]
        trace = slot.workload.trace
        if trace.block_tokens is None or self.kv is None or not self.caching:
            return {}
        over = self.study.capacity.over if load is not None else None
        speed = trace_speed(over, load, trace.rate, self.spec.speed)
        measured = [replace(r, t_s=r.t_s / speed) for r in trace.requests]
        ms = lambda k: (values.get(k) or 0.0) / 1000  # noqa: E731
        m = pcm.simulate(measured, block_tokens=trace.block_tokens, kv_tokens=self.kv[0], block_size=self.kv[1],
                         history=slot.history.requests if slot.history else (),
                         timing=pcm.Timing(ms("ttft_p50_ms"), ms("tpot_p50_ms")))
        return {"model_prefix_hit_rate": m.hit_rate, "model_short_blocks": m.short_blocks}
