"""A trace study's round, beside its measurement: the window's history sent first
(trace.prime: history, workload/priming.py) and the prefix-cache model's hit rate for
the round (workload/prefix_cache_model.py), both at the server's own KV cache size."""
from __future__ import annotations

import time
from dataclasses import replace

from ..capacity import bracket as capacity
from ..define.traces import read_history
from ..workload import prefix_cache_model as pcm, priming


class Primer:
    """One start's priming and cache model. `record` is its StartRecord: the server's KV
    size (launch.cache_config), the window's max_model_len, and the warnings it adds."""

    def __init__(self, study, workload, tokenizer, record):
        self.study, self.workload, self.record = study, workload, record
        self.spec = study.workload.trace
        c = record.launch.cache_config
        # vllm:cache_config_info's blocks x block size: the pool the model's LRU runs over
        self.kv = ((int(c["num_gpu_blocks"]) * int(c["block_size"]), int(c["block_size"]))
                   if c.get("num_gpu_blocks") and c.get("block_size") else None)
        self.history, self.requests = None, []
        if self.spec.prime != "history":
            return
        if self.kv is None:
            record.warnings.append("workload.trace.prime: history: the server reports no KV cache size "
                                   "(vllm:cache_config_info), so its rounds were not primed")
            return
        trace = workload.trace
        self.history = priming.select_history(
            read_history(self.spec), trace.requests, block_tokens=trace.block_tokens, kv_tokens=self.kv[0],
            block_size=self.kv[1], max_model_len=(record.trace or {}).get("max_model_len"))
        self.requests = priming.prime_requests(tokenizer, api=study.workload.api, seed=study.workload.seed,
                                               history=self.history, block_tokens=trace.block_tokens)
        if self.history.note():
            record.warnings.append(self.history.note())

    def prime(self, run_closed) -> dict:
        """Send the history, prefill-only, as fast as the server takes it (run_closed: the
        round protocol's closed loop, workload.concurrency at once); what it took."""
        if self.history is None:
            return {}
        t0 = time.perf_counter()
        res = run_closed(self.requests) if self.requests else []
        return {"prime_s": time.perf_counter() - t0, "prime_requests": len(res),
                "prime_prompt_tokens": self.history.prompt_tokens,
                "prime_errors": sum(1 for r in res if r["error"])}

    def model_hit_rate(self, values: dict, load: float | None) -> dict:
        """The model's hit rate for the round: the server's KV and block size, the round's
        arrivals (at its speed), its median TTFT and TPOT for how long a request holds its
        blocks, primed with the history the round was primed with."""
        trace = self.workload.trace
        if trace.block_tokens is None or self.kv is None:
            return {}
        over = self.study.capacity.over if load is not None else None
        speed = capacity.trace_speed(over, load, trace.rate, self.spec.speed)
        window = [replace(r, t_s=r.t_s / speed) for r in trace.requests]
        ms = lambda k: (values.get(k) or 0.0) / 1000  # noqa: E731
        m = pcm.simulate(window, block_tokens=trace.block_tokens, kv_tokens=self.kv[0], block_size=self.kv[1],
                         history=self.history.requests if self.history else (),
                         timing=pcm.Timing(ms("ttft_p50_ms"), ms("tpot_p50_ms")))
        return {"model_prefix_hit_rate": m.hit_rate, "model_short_blocks": m.short_blocks}
