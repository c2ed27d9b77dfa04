"""Every metric the kit reports, defined once: its name, label, unit, number format,
which direction is better, where it comes from and what exactly it is.

Tables, heatmaps (and their colour direction), the report's definitions table and the
validation of round records all read this registry, so a metric cannot be defined one
way in the report and computed another way in the code.

Names follow vLLM's benchmarks: TTFT, ITL (every gap between streamed content chunks,
pooled over a round: = TBT), TPOT ((E2E - TTFT) / (output tokens - 1) per request),
E2E. GuideLLM and AIPerf call TPOT "ITL"; LLMPerf's ITL includes TTFT.

Beside the pooled ITL, per-request figures (REQUEST_ITL): each request's longest gap (its
stall) and its mean gap, with percentiles over the round's requests, as AIPerf reports ITL
per request. A pooled percentile weights a request by its gaps: with 256 output tokens a
chunked-prefill stall is 1 gap in 255, below the pooled P99 even when every request had one.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
import pandas as pd

Source = Literal["client", "server", "nvml", "kit"]
Better = Literal["lower", "higher"] | None


@dataclass(frozen=True)
class Metric:
    name: str           # the column / key everywhere: ttft_p90_ms
    label: str          # what tables and axes show: TTFT P90
    unit: str           # ms, tok/s, share, ...
    fmt: str            # format spec for one value: .0f, .1%
    better: Better      # lower / higher / None (a count that is neither)
    source: Source      # client (per request), server (/metrics), nvml, kit (the workload)
    definition: str
    # fixed by the workload and the config, not measured: where a point's rounds all agree,
    # the value is exact (analysis.py gives it a zero-width interval); a measured figure
    # that agrees in every round has only not been seen to vary
    exact: bool = False

    @property
    def title(self) -> str:
        return f"{self.label} ({self.unit})" if self.unit and self.unit != "share" else self.label

    def format(self, value) -> str:
        return "n/a" if value is None or pd.isna(value) else format(value, self.fmt)

    @property
    def domain(self) -> tuple[float, float]:
        """Where the quantity can lie: every metric here is a latency, a rate, a count or a
        share, so none is negative; a share is at most 1, a percentage at most 100."""
        return 0.0, {"share": 1.0, "%": 100.0}.get(self.unit, float("inf"))

    @property
    def cmap(self) -> str:
        """Colour map in which the better end is the bright (yellow) one."""
        return "viridis" if self.better == "higher" else "viridis_r"


def with_interval(iv: dict | None, m: Metric) -> str:
    """'182 [140, 230]': a value and its 95% interval (an analysis.point_intervals row) in
    the metric's format; the value alone where no interval could be drawn."""
    if iv is None:
        return ""
    if not np.isfinite(iv["ci_low"]):
        return m.format(iv["value"])
    return f"{m.format(iv['value'])} [{m.format(iv['ci_low'])}, {m.format(iv['ci_high'])}]"


REGISTRY: dict[str, Metric] = {}


def _add(*metrics: Metric) -> None:
    for m in metrics:
        assert m.name not in REGISTRY, m.name
        REGISTRY[m.name] = m


# Latency distributions: each of TTFT, ITL, TPOT, E2E per round as mean, std and
# percentiles over its requests (ITL over all gaps of the round's requests).
LATENCIES = {
    "ttft": ("TTFT", "first streamed content chunk minus send time, per request", 0),
    "itl": ("ITL", "every gap between successive streamed content chunks (= TBT), pooled over "
                   "the round's requests; GuideLLM/AIPerf call TPOT 'ITL', LLMPerf's ITL includes TTFT", 1),
    "tpot": ("TPOT", "(E2E - TTFT) / (output tokens - 1), per request with 2+ output tokens", 1),
    "e2e": ("E2E", "last streamed chunk minus send time, per request", 0),
}
PERCENTILES = (50, 90, 99)
for _key, (_label, _defn, _digits) in LATENCIES.items():
    for _stat, _what in [("mean", "mean"), ("std", "std")] + [(f"p{p}", f"P{p}") for p in PERCENTILES]:
        _add(Metric(f"{_key}_{_stat}_ms", f"{_label} {_what}", "ms", f".{_digits}f",
                    None if _stat == "std" else "lower", "client", f"{_what} of {_label}: {_defn}"))

# Per request, from its own gaps between streamed content chunks (requests with 2+ chunks):
# one figure each, then a percentile over the round's requests. name -> (label, what, reduce)
REQUEST_ITL = {
    "stall": ("stall", "each request's longest gap between successive streamed content chunks (a chunked "
                       "prefill of another request, a preemption, a scheduling hiccup)", np.max),
    "itl_mean": ("ITL mean per request", "each request's mean gap between successive streamed content chunks "
                                         "(AIPerf's per-request ITL; equals its TPOT where every chunk carries one "
                                         "token)", np.mean),
}
for _key, (_label, _defn, _) in REQUEST_ITL.items():
    for _p in PERCENTILES:
        _add(Metric(f"{_key}_p{_p}_ms", f"{_label} P{_p}", "ms", ".1f", "lower", "client",
                    f"P{_p} over the round's requests of {_defn}; not recorded by runs made before it was added"))


def request_itl_figure(name: str) -> str | None:
    """'stall_p90_ms' -> 'stall', 'itl_mean_p99_ms' -> 'itl_mean': the per-request figure a
    metric (or an SLO bound) takes a percentile over requests of; None for any other name."""
    for key in REQUEST_ITL:
        if name in (f"{key}_p{p}_ms" for p in PERCENTILES):
            return key
    return None


def slo_bound_names(stats) -> list[str]:
    """What an SLO may bound: each latency at each of `stats`, each per-request figure at each percentile."""
    return [f"{lat}_{s}_ms" for lat in LATENCIES for s in stats] + \
        [f"{fig}_p{p}_ms" for fig in REQUEST_ITL for p in PERCENTILES]


def request_itl_ms(gaps_s, figure: str) -> float | None:
    """One request's figure (REQUEST_ITL key) from its gaps in seconds, in ms; None without a gap."""
    return float(REQUEST_ITL[figure][2](gaps_s)) * 1000 if len(gaps_s) else None

_add(
    Metric("requests", "requests", "", ".0f", None, "client", "requests sent in the round", exact=True),
    Metric("completed", "completed", "", ".0f", "higher", "client", "requests answered with at least one token"),
    Metric("failed", "failed", "", ".0f", "lower", "client",
           "requests that ended in an error (by kind in the round record)"),
    Metric("duration_s", "round duration", "s", ".2f", None, "client",
           "first send to last finish: the round's requests are built before its clock starts"),
    Metric("prompt_tokens", "prompt tokens", "tok", ".0f", None, "client",
           "prompt tokens of answered requests, from usage", exact=True),
    Metric("output_tokens", "output tokens", "tok", ".0f", None, "client",
           "output tokens of answered requests, from usage"),
    Metric("request_throughput", "requests/s", "req/s", ".2f", "higher", "client",
           "answered requests / round duration"),
    Metric("output_throughput", "output tokens/s", "tok/s", ".0f", "higher", "client",
           "output tokens / round duration"),
    Metric("total_token_throughput", "total tokens/s", "tok/s", ".0f", "higher", "client",
           "(prompt + output tokens) / round duration"),
    Metric("goodput", "goodput", "req/s", ".2f", "higher", "client",
           "requests that met every SLO bound / round duration"),
    Metric("slo_attainment", "SLO attainment", "share", ".1%", "higher", "client",
           "share of the round's requests that met every SLO bound (failed requests count as missed)"),
    # /metrics deltas over the round (counters are cumulative)
    Metric("prefix_cache_queries", "prefix-cache queries", "tok", ".0f", None, "server",
           "delta of vllm:prefix_cache_queries_total"),
    Metric("prefix_cache_hits", "prefix-cache hits", "tok", ".0f", None, "server",
           "delta of vllm:prefix_cache_hits_total"),
    Metric("prefix_cache_hit_rate", "prefix-cache hit rate", "share", ".3f", "higher", "server",
           "delta of vllm:prefix_cache_hits_total / delta of vllm:prefix_cache_queries_total"),
    Metric("expected_prefix_hit_rate", "hit rate if nothing were evicted", "share", ".3f", None, "kit",
           "what a prefix cache that never evicts would hit on the round's requests (full blocks of the "
           "shared prefix, from the rendered prompts)", exact=True),
    Metric("model_prefix_hit_rate", "hit rate the cache model predicts", "share", ".3f", None, "kit",
           "prefix_cache_model.simulate: vLLM's LRU block cache at the server's KV size and block size over the "
           "round's arrivals, primed with the history the round was primed with"),
    Metric("model_short_blocks", "blocks the cache model lacked", "", ".0f", None, "kit",
           "the most blocks the model's running requests lacked (0: its prediction needs no queueing)"),
    Metric("prime_s", "priming time", "s", ".1f", None, "kit",
           "trace.prime: history: first send to last answer of the unmeasured history"),
    Metric("prime_requests", "priming requests", "", ".0f", None, "kit",
           "history requests sent before the round (prefill-only, 1 output token)", exact=True),
    Metric("prime_prompt_tokens", "priming prompt tokens", "tok", ".0f", None, "kit",
           "the history's prompt tokens", exact=True),
    Metric("prime_errors", "priming errors", "", ".0f", "lower", "client", "history requests that failed"),
    Metric("preemptions", "preemptions", "", ".0f", "lower", "server", "delta of vllm:num_preemptions_total"),
    # vllm:iteration_tokens_total is observed once per engine step that emitted output
    # (vLLM 0.26 and 0.32: AsyncLLM makes IterationStats only when a step has outputs), so
    # its count misses steps that only advanced a chunked prefill: it is not all steps.
    Metric("output_steps", "steps with output", "", ".0f", None, "server",
           "delta of vllm:iteration_tokens_total_count: engine steps that emitted a token or finished "
           "a request; steps that only advanced a prefill chunk are not counted"),
    Metric("computed_tokens", "computed tokens", "tok", ".0f", None, "server",
           "delta of vllm:iteration_tokens_total_sum: output tokens, plus each prompt's uncached tokens, "
           "counted in the step its prefill finished"),
    Metric("tokens_per_output_step", "tokens per step with output", "tok", ".1f", None, "server",
           "computed tokens / steps with output: above the tokens of an average engine step wherever "
           "steps ran prefill chunks alone"),
    Metric("server_prompt_tokens", "server prompt tokens", "tok", ".0f", None, "server",
           "delta of vllm:prompt_tokens_total"),
    Metric("server_generation_tokens", "server output tokens", "tok", ".0f", None, "server",
           "delta of vllm:generation_tokens_total"),
    Metric("server_ttft_mean_ms", "vLLM's TTFT mean", "ms", ".1f", "lower", "server",
           "vLLM's own mean TTFT (from the request's arrival at the server; its histogram's sum/count "
           "deltas): the client's TTFT minus it is what the client and network add"),
    Metric("kv_usage_peak", "KV cache peak", "share", ".1%", None, "server",
           "max of vllm:kv_cache_usage_perc sampled every 0.5 s during the round"),
    Metric("kv_usage_mean", "KV cache mean", "share", ".1%", None, "server",
           "mean of vllm:kv_cache_usage_perc sampled every 0.5 s during the round"),
    Metric("running_peak", "running requests peak", "", ".0f", None, "server",
           "max of vllm:num_requests_running sampled every 0.5 s: compare with max_num_seqs"),
    Metric("waiting_peak", "waiting requests peak", "", ".0f", None, "server",
           "max of vllm:num_requests_waiting sampled every 0.5 s"),
    # did the chunk size bind? (counters.long_prefills)
    Metric("long_prefills", "prefills longer than the chunk", "", ".0f", None, "server",
           "requests whose uncached prompt exceeded max_num_batched_tokens, so vLLM split their "
           "prefill over steps (vllm:request_prefill_kv_computed_tokens; where vLLM lacks "
           "--custom-histogram-buckets, those above long_prefill_edge_tokens)"),
    Metric("long_prefill_edge_tokens", "prefill edge counted from", "tok", ".0f", None, "server",
           "the histogram bound prefills were counted above: max_num_batched_tokens when exact", exact=True),
    # the Prefix Reuse Budget scheduler (vllm_study.scheduler_plugin), where a point uses it
    Metric("pb_deferred", "requests deferred", "", ".0f", None, "server",
           "requests the Prefix Reuse Budget held back at least once (cached share below min_reuse_ratio)"),
    Metric("pb_admitted_by_age", "admitted by the age bound", "", ".0f", None, "server",
           "deferred requests let in because they had waited max_defer_ms"),
    Metric("pb_admitted_idle", "admitted while idle", "", ".0f", None, "server",
           "deferred requests let in because nothing else waiting could use the budget"),
    Metric("pb_defer_ms_p50", "defer P50", "ms", ".0f", None, "server", "median hold time of deferred requests"),
    Metric("pb_defer_ms_p99", "defer P99", "ms", ".0f", None, "server", "P99 hold time of deferred requests"),
    Metric("pb_defer_ms_max", "defer max", "ms", ".0f", None, "server", "longest hold time of a deferred request"),
    # how close to the hardware (launch/machine.py)
    Metric("est_flops", "estimated FLOPs", "FLOP", ".3g", None, "server",
           "delta of vllm:estimated_flops_per_gpu_total (--enable-mfu-metrics)"),
    Metric("est_read_bytes", "estimated bytes read", "bytes", ".3g", None, "server",
           "delta of vllm:estimated_read_bytes_per_gpu_total (--enable-mfu-metrics)"),
    Metric("est_write_bytes", "estimated bytes written", "bytes", ".3g", None, "server",
           "delta of vllm:estimated_write_bytes_per_gpu_total (--enable-mfu-metrics)"),
    Metric("mfu", "MFU", "share", ".1%", "higher", "server",
           "FLOPs per second over the round / the GPU's dense bf16 datasheet peak; FLOPs from vLLM's "
           "estimate, else 2 x parameters x scheduled tokens (a lower bound)"),
    Metric("hbm_bandwidth_use", "memory bandwidth use", "share", ".1%", None, "server",
           "bytes moved per second over the round / the GPU's datasheet HBM bandwidth; bytes from "
           "vLLM's estimate, else the weights once per engine step (a lower bound)"),
    Metric("gpu_mem_peak_bytes", "GPU memory peak", "bytes", ".3g", None, "nvml",
           "peak NVML memory used, sampled every 0.5 s"),
    Metric("gpu_mem_peak_frac", "GPU memory peak", "share", ".2f", None, "nvml",
           "peak NVML memory used / total; flat near gpu_memory_utilization, because vLLM reserves memory "
           "up front (KV usage is the load-dependent signal)"),
    Metric("gpu_util_mean", "GPU utilization", "%", ".0f", None, "nvml", "mean NVML utilization during the round"),
)

# Open loop (a rate, a ladder, a trace): latencies from each request's scheduled arrival,
# and how late the client sent (capacity.py judges latency bounds on these).
for _key, _label in (("ttft", "TTFT"), ("e2e", "E2E")):
    for _stat, _what in [("mean", "mean")] + [(f"p{p}", f"P{p}") for p in PERCENTILES]:
        _add(Metric(f"{_key}_sched_{_stat}_ms", f"{_label} {_what} from schedule", "ms", ".0f", "lower", "client",
                    f"{_what} of {_label} measured from the request's scheduled arrival instead of its send: "
                    "the send lateness added, so a client that falls behind cannot hide queueing"))
for _stat, _what in (("p50", "P50"), ("p99", "P99"), ("max", "max")):
    _add(Metric(f"send_lateness_{_stat}_ms", f"send lateness {_what}", "ms", ".1f", "lower", "client",
                f"{_what} over the round's requests of actual send minus scheduled arrival (open loop)"))

# A replayed trace: does the replay reproduce it?
_add(
    Metric("trace_prompt_tokens", "trace prompt tokens", "tok", ".0f", None, "kit",
           "the trace's input lengths summed over the round's answered requests", exact=True),
    Metric("prompt_tokens_vs_trace", "prompt tokens against the trace", "share", "+.2%", None, "kit",
           "prompt tokens the server counted (usage) / the trace's input lengths - 1, answered requests",
           exact=True),
    Metric("offered_rate", "offered rate", "req/s", ".2f", None, "kit",
           "requests / the span of their scheduled arrivals (open loop): the load the round asked for",
           exact=True),
)

# Per start, not per round.
_add(Metric("startup_s", "startup", "s", ".0f", "lower", "kit", "launch of vLLM until /health answers 200"))
_add(
    Metric("capacity_rps", "capacity", "req/s", ".2f", "higher", "kit",
           "the most load, in requests/s, a start sustains within the SLO: where its steps' fitted SLO margins "
           "cross 1 (docs/capacity.md); a bound (capacity_censored below / above) where it missed at its lowest "
           "load or met at its highest, never 0"),
    Metric("capacity_load", "capacity (search units)", "", ".3g", "higher", "kit",
           "the capacity in the search's own unit: the trace's speed, the Poisson rate or the concurrency"),
)


# Names earlier runs recorded that no longer mean what their label said: they are dropped
# when those runs' records load, so old runs still open.
RETIRED = {
    # "steps at the chunk budget", from vllm:iteration_tokens_total. That histogram is not
    # per-step scheduled tokens: vLLM observes a prompt's computed tokens once, in the step
    # its prefill finishes, so the share counted steps that finished a long prefill.
    "budget_steps_share": "not the share of steps at the chunk budget",
    "budget_edge_tokens": "the bound budget_steps_share was counted above",
}
# Names earlier runs recorded for the same quantity under a label that claimed more: the
# values load under the new name.
RENAMED = {
    "engine_steps": "output_steps",          # counted steps with output only, never every step
    "step_tokens": "computed_tokens",
    "tokens_per_step": "tokens_per_output_step",
}


def get(name: str) -> Metric:
    try:
        return REGISTRY[name]
    except KeyError:
        raise KeyError(f"unknown metric {name!r}; known: {', '.join(REGISTRY)}") from None


# What the report's headline table shows, in this order.
HEADLINE = ("capacity_rps", "ttft_sched_p90_ms", "ttft_p50_ms", "ttft_p90_ms", "itl_p50_ms", "itl_p90_ms",
            "stall_p90_ms", "tpot_p50_ms", "e2e_p50_ms",
            "output_throughput", "request_throughput", "goodput", "slo_attainment", "prefix_cache_hit_rate",
            "expected_prefix_hit_rate", "preemptions", "kv_usage_peak",
            "gpu_mem_peak_frac")
# Drawn from every round that sent its requests, a round whose server died included: its
# failed requests missed the SLO, and leaving the round out would hide them.
FAILURES_COUNT = ("goodput", "slo_attainment")
# One figure per metric in the report's heatmap grid.
HEATMAPS = ("capacity_rps", "ttft_p90_ms", "itl_p90_ms", "tpot_p50_ms", "output_throughput", "prefix_cache_hit_rate",
            "kv_usage_peak", "preemptions", "long_prefills", "running_peak",
            "mfu", "hbm_bandwidth_use", "gpu_mem_peak_frac")
TRENDS = ("capacity_rps", "ttft_p90_ms", "itl_p90_ms", "output_throughput")
# Shown per request class / turn / rate step.
GROUP_METRICS = ("requests", "failed", "ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p90_ms",
                 "itl_p99_ms", "stall_p90_ms", "tpot_p50_ms", "e2e_p50_ms")


def definitions(names=None) -> pd.DataFrame:
    """The report's table of what each metric means."""
    rows = [{"metric": m.name, "label": m.label, "unit": m.unit, "better": m.better or "",
             "source": m.source, "definition": m.definition}
            for m in (REGISTRY[n] for n in (names or REGISTRY))]
    return pd.DataFrame(rows).set_index("metric")
