"""Server and GPU counters around a round.

/metrics is parsed with prometheus_client's own parser. Counters are cumulative (and
/reset_prefix_cache does not zero them), so a round's figures are the difference of
a snapshot taken before and one taken after. Gauges that move within a round (KV
usage) and GPU memory/utilization (NVML) are sampled by a background thread.
"""
from __future__ import annotations

import threading
import urllib.error
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from ..launch import net
from .client import auth_header
from ..launch.machine import NvmlProbe

COUNTERS = {
    "prefix_cache_queries": "vllm:prefix_cache_queries_total",
    "prefix_cache_hits": "vllm:prefix_cache_hits_total",
    "preemptions": "vllm:num_preemptions_total",
    "output_steps": "vllm:iteration_tokens_total_count",
    "computed_tokens": "vllm:iteration_tokens_total_sum",
    "server_prompt_tokens": "vllm:prompt_tokens_total",
    "server_generation_tokens": "vllm:generation_tokens_total",
    # vLLM's own TTFT (from the request's arrival at the server): beside the client's,
    # it splits a TTFT difference into "the load differed" and "the clients' clocks differ".
    "server_ttft_sum_s": "vllm:time_to_first_token_seconds_sum",
    "server_ttft_count": "vllm:time_to_first_token_seconds_count",
}


def _open(url: str, api_key: str | None, method: str = "GET", timeout: float = 5, proxy: str | None = None):
    # The key goes along for endpoints behind a gateway that guards every path.
    return net.open_url(url, method, auth_header(api_key), timeout, proxy)


def parse_metrics(text: str) -> dict:
    """{sample name: value over label sets (counters summed, gauges their max)}, the
    labels of info metrics, and histograms as {name: {upper bound: cumulative count}}."""
    values: dict[str, float] = {}
    info: dict[str, dict] = {}
    hist: dict[str, dict[float, float]] = {}
    for family in text_string_to_metric_families(text):
        combine = max if family.type == "gauge" else (lambda a, b: a + b)
        for s in family.samples:
            if s.name.endswith("_bucket") and "le" in s.labels:
                buckets = hist.setdefault(s.name[:-len("_bucket")], {})
                le = float(s.labels["le"])
                buckets[le] = buckets.get(le, 0.0) + s.value
                continue
            values[s.name] = combine(values[s.name], s.value) if s.name in values else s.value
            if s.name.endswith("_info"):
                info[s.name] = dict(s.labels)
    return {"values": values, "info": info, "hist": hist}


def scrape(base_url: str, api_key: str | None = None, proxy: str | None = None) -> dict:
    with _open(base_url + "/metrics", api_key, proxy=proxy) as r:
        return parse_metrics(r.read().decode())


def round_deltas(before: dict, after: dict) -> dict:
    """Counter differences for one round, and the ratios derived from them."""
    out = {}
    for key, name in COUNTERS.items():
        a, b = after["values"].get(name), before["values"].get(name)
        out[key] = None if a is None or b is None else a - b
    q, h = out["prefix_cache_queries"], out["prefix_cache_hits"]
    out["prefix_cache_hit_rate"] = h / q if q else None
    steps = out["output_steps"]
    out["tokens_per_output_step"] = out["computed_tokens"] / steps if steps else None
    n, total = out.pop("server_ttft_count"), out.pop("server_ttft_sum_s")
    out["server_ttft_mean_ms"] = 1000 * total / n if n else None
    return out


def above(before: dict, after: dict, histogram: str, limit: float) -> tuple[float | None, float | None]:
    """How many of a round's observations of `histogram` exceeded `limit`, as exactly
    as its buckets tell: the count above the largest bucket bound at or below `limit`,
    returned with that bound (equal to `limit` when the buckets include it)."""
    a, b = after.get("hist", {}).get(histogram), before.get("hist", {}).get(histogram, {})
    bounds = sorted(le for le in (a or {}) if le <= limit)
    if not a or not bounds or float("inf") not in a:
        return None, None
    edge = bounds[-1]
    total = a[float("inf")] - b.get(float("inf"), 0.0)
    return total - (a[edge] - b.get(edge, 0.0)), edge


def long_prefills(before: dict, after: dict, max_num_batched_tokens: int) -> dict:
    """Did the chunk size bind in this round? The prefills longer than the budget, which
    vLLM had to split over steps, from the per-request histogram of computed prompt
    tokens. Exact where the server has the bucket bound budget_buckets() asks for;
    otherwise counted above the nearest default bound below the budget, which is recorded
    (long_prefill_edge_tokens) so the figure says what it counts.
    vLLM exports no per-step count of scheduled tokens: vllm:iteration_tokens_total
    observes a prompt's computed tokens once, in the step its prefill finishes."""
    n, edge = above(before, after, "vllm:request_prefill_kv_computed_tokens", max_num_batched_tokens)
    return {"long_prefills": n, "long_prefill_edge_tokens": edge}


def budget_buckets(*max_num_batched_tokens: int) -> dict[str, list[int]]:
    """Histogram bounds (vLLM's --custom-histogram-buckets) that make long_prefills exact
    at each chunk size given (a start that serves several lowers it between rounds)."""
    return {"request_tokens": sorted(set(max_num_batched_tokens))}


# vLLM's own work estimates (--enable-mfu-metrics), per GPU.
WORK = {"est_flops": "vllm:estimated_flops_per_gpu_total",
        "est_read_bytes": "vllm:estimated_read_bytes_per_gpu_total",
        "est_write_bytes": "vllm:estimated_write_bytes_per_gpu_total"}


def work_deltas(before: dict, after: dict) -> dict:
    out = {}
    for key, name in WORK.items():
        a, b = after["values"].get(name), before["values"].get(name)
        out[key] = None if a is None or b is None else a - b
    return out


def cache_config(snapshot: dict) -> dict:
    """KV capacity as vLLM reports it (labels of vllm:cache_config_info)."""
    labels = snapshot["info"].get("vllm:cache_config_info", {})
    keep = ("num_gpu_blocks", "block_size", "kv_cache_size_tokens", "kv_cache_memory_bytes",
            "gpu_memory_utilization", "enable_prefix_caching", "kv_cache_max_concurrency")
    return {k: labels[k] for k in keep if k in labels}


def reset_prefix_cache(base_url: str, api_key: str | None = None, proxy: str | None = None) -> None:
    """Needs VLLM_SERVER_DEV_MODE=1 on the server (the kit's launcher sets it)."""
    with _open(base_url + "/reset_prefix_cache", api_key, "POST", timeout=30, proxy=proxy) as r:
        if r.status != 200:
            raise RuntimeError(f"/reset_prefix_cache answered {r.status}")


@dataclass
class ServerApi:
    """What a running endpoint offers beyond the OpenAI API, each part on its own."""
    snapshot: dict | None          # a /metrics snapshot, or None where it does not answer
    cache_reset: bool              # /reset_prefix_cache answered (vLLM's dev mode)
    notes: list[str]               # what is missing, said plainly


def probe_server_api(base_url: str, api_key: str | None = None, proxy: str | None = None) -> ServerApi:
    api = ServerApi(None, True, [])
    try:
        api.snapshot = scrape(base_url, api_key, proxy)
    except (OSError, ValueError) as e:
        api.notes.append(f"{base_url}/metrics does not answer ({_why(e)}): server-side counters are absent")
    try:
        reset_prefix_cache(base_url, api_key, proxy)
    except (OSError, RuntimeError) as e:
        api.cache_reset = False
        api.notes.append(f"{base_url}/reset_prefix_cache is refused ({_why(e)}; vLLM offers it only with "
                         "VLLM_SERVER_DEV_MODE=1): the prefix cache is NOT reset between rounds, so later "
                         "rounds may start warm")
    return api


def _why(e: Exception) -> str:
    if isinstance(e, urllib.error.HTTPError):
        return f"HTTP {e.code}"
    return f"{type(e).__name__}: {e}"


# Gauges sampled during a round (they move within it; a snapshot after would miss the peak).
GAUGES = {"kv": "vllm:kv_cache_usage_perc", "running": "vllm:num_requests_running",
          "waiting": "vllm:num_requests_waiting"}


class RoundSampler:
    """Samples vLLM's gauges from /metrics and the GPU through NVML every `period_s`
    while a round runs. Use as a context manager; read `.result()` afterwards."""
    PERIOD_S = 0.5

    def __init__(self, base_url: str | None, nvml: NvmlProbe, period_s: float = PERIOD_S,
                 api_key: str | None = None, proxy: str | None = None):
        self.base_url, self.nvml, self.period_s, self.api_key, self.proxy = base_url, nvml, period_s, api_key, proxy
        self.gauges: dict[str, list[float]] = {}
        self.gpu, self.scrape_errors = [], 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            try:
                values = scrape(self.base_url, self.api_key, self.proxy)["values"] if self.base_url else {}
                for key, name in GAUGES.items():
                    if name in values:
                        self.gauges.setdefault(key, []).append(values[name])
            except (OSError, ValueError):
                self.scrape_errors += 1
            if self.nvml.available:
                self.gpu.append(self.nvml.sample())
            self._stop.wait(self.period_s)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(timeout=10)

    def result(self) -> dict:
        kv, running = self.gauges.get("kv", []), self.gauges.get("running", [])
        waiting = self.gauges.get("waiting", [])
        out = {"kv_usage_peak": max(kv) if kv else None, "kv_usage_mean": sum(kv) / len(kv) if kv else None,
               "running_peak": max(running) if running else None, "waiting_peak": max(waiting) if waiting else None}
        if self.gpu:
            peak = max(s["mem_used"] for s in self.gpu)
            out.update(gpu_mem_peak_bytes=peak, gpu_mem_peak_frac=peak / self.gpu[0]["mem_total"],
                       gpu_util_mean=sum(s["util"] for s in self.gpu) / len(self.gpu))
        else:
            out.update(gpu_mem_peak_bytes=None, gpu_mem_peak_frac=None, gpu_util_mean=None)
        return out
