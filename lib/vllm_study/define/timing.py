"""A study's wall time, estimated before it runs (shown by --dry-run), from the model's
size, the workload and the load. It is a rough model, meant to tell 20 minutes from 3
hours, not to plan to the minute:

- a server start: 75 s on the CPU engine; on a GPU 90 s plus 1 s per GB of weights
  (dummy-weight init, torch.compile with a cold cache, CUDA graph capture); started
  ahead (server.start_ahead), every start but the first leaves a quarter of that on
  the critical path once the compile cache holds its configuration, half while it
  does not (a grid point's first start, every trial of a search). 7B on one H200:
  13-16 s and 33-62 s, against 48-128 s in all;
- a decode step: the weights read once from memory at 60% of the GPU's datasheet
  bandwidth (or at 10 GB/s on a CPU), plus 3 ms; a request's prefill at 40% of the
  GPU's peak FLOP/s (prefix-cached tokens skipped);
- a round: open loop, its arrival span plus one request's latency; closed loop, one
  request's latency per wave of `concurrency` requests;
- per start, 15 s of the kit's own work (notebook kernel, tokenizer, workload);
- priming (trace.prime: history, prefix caching on): each round first prefills about the
  KV cache's size (workload/priming.py) at the prefill rate above, or the history before
  its window where that holds fewer distinct prefix blocks (the dry run reads them from the
  trace); the KV size on a GPU from its memory x gpu_memory_utilization less the weights
  and 5 GB (one H200, Qwen2.5-7B at 0.92: 2.06M tokens; this model says 2.07M, and 80 s a
  round where 58 s were measured), on the CPU engine the point's kv_cache_memory_bytes, at
  the CPU's priming rate (CPU_PRIME_FLOPS).
"""
from __future__ import annotations

import math

from ..capacity.bracket import trace_speed
from ..launch import machine
from . import models
from .grid import CPU_KV_CAP, search_sharing
from .params import Study
from .traces import read_trace

CPU_START_S, GPU_START_S, GPU_START_S_PER_GB = 75.0, 90.0, 1.0
# of a GPU start, left on the critical path by a start ahead: its configuration compiled
# before, or new to the compile cache
AHEAD_SHARE, AHEAD_SHARE_NEW = 0.25, 0.5
KIT_S_PER_START, REPORT_S = 15.0, 40.0
# Priming on the CPU engine: the history's prefills go in batched (workload.concurrency at
# once, chunked at max_num_batched_tokens), faster than one request's prefill (_flops). On a
# 2-core AMD EPYC, the tiny Qwen2 (40M parameters), the Mooncake conversation trace, chunk
# 1024, 4 in flight: a 128 MiB cache (131k tokens) primed in 24.7-34.6 s a round (3 rounds),
# where one request's rate (0.2 TFLOP/s) modelled 53 s and this rate models 26 s; 16k tokens
# of KV, 1 in flight: 2.8 and 6.3 s (3.3 s modelled).
CPU_PRIME_FLOPS = 0.4e12
# what a GPU start holds besides weights and KV (activations, CUDA graphs): one H200,
# Qwen2.5-7B at 0.92 kept 118.3 GB of KV of 138.7 GB, 15.2 of weights
GPU_OTHER_BYTES = 5e9
VLLM_GPU_MEMORY_UTILIZATION = 0.92


def _step_s(weight_bytes: float, peak_bw: float | None) -> float:
    bw = 0.6 * peak_bw if peak_bw else 10e9
    return weight_bytes / bw + 0.003


def request_latency_s(study: Study, engine: str, gpu_name: str | None = None) -> float:
    """One request's TTFT + decode time under the rough model above."""
    cfg = models.local_config(study.model) or {}
    params = machine.param_count(cfg)[0] if cfg else 7e9
    peaks = machine.peaks(gpu_name) if gpu_name and engine == "gpu" else None
    flops = _flops(engine, gpu_name)
    w = study.workload
    out = w.output_tokens if isinstance(w.output_tokens, int) else w.output_tokens.longest() / 2
    uncached = w.question_tokens if isinstance(w.question_tokens, int) else 64
    if w.kind == "trace":  # every prompt uncached: a bound for a rough model
        trace = _trace(study)
        uncached = sum(r.input_tokens for r in trace.requests) / max(len(trace.requests), 1)
        out = sum(r.output_tokens for r in trace.requests) / max(len(trace.requests), 1)
    elif w.kind in ("mixed", "eviction"):
        long = w.long_prompt_tokens if isinstance(w.long_prompt_tokens, int) else w.long_prompt_tokens.longest()
        uncached += w.long_fraction * long
    elif w.kind == "random":
        uncached = w.input_tokens if isinstance(w.input_tokens, int) else w.input_tokens.longest() / 2
    return 2 * params * uncached / flops + out * _step_s(2 * params, peaks[1] if peaks else None)


def _flops(engine: str, gpu_name: str | None) -> float:
    peaks = machine.peaks(gpu_name) if gpu_name and engine == "gpu" else None
    return 0.4 * peaks[0] if peaks else 0.2e12


def kv_tokens(study: Study, args, engine: str, gpu_name: str | None, gpu_bytes: int | None = None) -> int | None:
    """A start's KV cache in tokens under this rough model, for a point's engine args:
    kv_cache_memory_bytes where set; on the CPU engine the kit's default at most
    (grid.cpu_kv_default); on a GPU its memory (gpu_bytes, or machine.MEMORY_BYTES) x
    gpu_memory_utilization less the weights and the rest. None where the model is unknown."""
    cfg = models.local_config(study.model)
    if not cfg:
        return None
    per_token = models.kv_bytes_per_token(cfg)
    if args.kv_cache_memory_bytes:
        return int(args.kv_cache_memory_bytes) // per_token
    if engine != "gpu":
        return CPU_KV_CAP // per_token
    total = gpu_bytes or (machine.memory_bytes(gpu_name) if gpu_name else None)
    if total is None:
        return None
    free = total * (args.gpu_memory_utilization or VLLM_GPU_MEMORY_UTILIZATION) - \
        2 * machine.param_count(cfg)[0] - GPU_OTHER_BYTES
    return max(0, int(free) // per_token)


def priming_s(study: Study, args, engine: str, gpu_name: str | None, gpu_bytes: int | None = None,
              history_tokens: list[int] | None = None) -> float:
    """What priming adds to each measured round of a point (engine args `args`): about its
    KV cache's size prefilled (workload/priming.py), or where a window's history holds
    fewer tokens of distinct prefix blocks (history_tokens: one a window,
    workload.windows.history_tokens), that history, averaged over the windows; 0 where
    nothing is primed (no trace.prime: history, prefix caching off) or the KV size is unknown."""
    w = study.workload
    if w.kind != "trace" or w.trace.prime != "history" or args.enable_prefix_caching is False:
        return 0.0
    kv = kv_tokens(study, args, engine, gpu_name, gpu_bytes)
    if not kv:
        return 0.0
    tokens = sum(min(kv, h) for h in history_tokens) / len(history_tokens) if history_tokens else kv
    cfg = models.local_config(study.model)
    flops = _flops(engine, gpu_name) if engine == "gpu" else CPU_PRIME_FLOPS
    return 2 * machine.param_count(cfg)[0] * tokens / flops


def _trace(study: Study):
    return read_trace(study.workload.trace)


def round_s(study: Study, latency_s: float) -> float:
    """One round at the study's load; a capacity search's steps at the geometric middle
    of its bracket."""
    w, load = study.workload, study.workload.load
    n = w.requests_per_round
    c = study.capacity
    mid = (c.lo * c.hi) ** 0.5 if c else None
    if w.kind == "trace":
        trace = _trace(study)
        speed = trace_speed(c.over if c else None, mid, trace.rate, w.trace.speed)
        return trace.duration_s / speed + latency_s
    if c and c.over == "rate":
        return n / mid + latency_s
    if c and c.over == "concurrency":
        return math.ceil(n / mid) * latency_s
    if load.kind == "poisson":
        return n / load.rate + latency_s
    if load.kind == "ladder":
        per = n / len(load.rates)
        return sum(per / r for r in load.rates) + latency_s
    if w.kind == "multi_turn":
        return math.ceil(n / w.turns / w.concurrency) * w.turns * (latency_s + w.think_time_s)
    return math.ceil(n / w.concurrency) * latency_s


def estimate_minutes(study: Study, engine: str, n_points: int, gpu_name: str | None = None,
                     n_starts: int | None = None, priming: float = 0.0) -> float:
    """n_starts: server starts a block launches where fewer than its points (live knobs:
    a start serves several points, one warm-up and one start-up for all of them);
    priming: what priming adds to a measured round, averaged over the points (priming_s)."""
    latency = request_latency_s(study, engine, gpu_name)
    if engine == "gpu":
        cfg = models.local_config(study.model) or {}
        gb = 2 * machine.param_count(cfg)[0] / 1e9 if cfg else 15
        start = GPU_START_S + GPU_START_S_PER_GB * gb
    else:
        start = CPU_START_S
    if study.targets:
        start = 0.0
    one = round_s(study, latency) + priming
    measure = KIT_S_PER_START + study.steps_per_start * one + \
        math.ceil(study.workload.warmup_requests / study.workload.concurrency) * latency
    launched = n_starts or n_points
    starts, new = launched * study.replicates, launched  # new: configurations the compile cache has not seen
    # a shared start's rounds for each point it serves
    measure += (n_points / launched - 1) * study.steps_per_start * one
    measured = starts * measure
    if study.search:  # every trial, then the confirmation blocks over the top k and vLLM's defaults
        s = study.search
        shared = search_sharing(study, engine)[1] is None
        trial_starts = math.ceil(s.trials / (s.live_batch if shared else 1))  # at best (config_search.TrialSource)
        confirm = s.confirm_starts * (s.top_k + 1)
        starts, new = trial_starts + confirm, trial_starts + 1
        measured = (s.trials + confirm) * measure
    ahead = study.server.ahead_on(engine) and not study.targets
    on_path = (new - 1) * (AHEAD_SHARE_NEW if ahead else 1) + (starts - new) * (AHEAD_SHARE if ahead else 1)
    return (start + measured + on_path * start + REPORT_S) / 60
