"""Server and GPU counters around a round.

/metrics is parsed with prometheus_client's own parser. Counters are cumulative (and
/reset_prefix_cache does not zero them), so a round's figures are the difference of
a snapshot taken before and one taken after. Gauges that move within a round (KV
usage) and GPU memory/utilization (NVML) are sampled by a background thread.
"""
from __future__ import annotations

import threading
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from .client import auth_header

COUNTERS = {
    "prefix_cache_queries": "vllm:prefix_cache_queries_total",
    "prefix_cache_hits": "vllm:prefix_cache_hits_total",
    "preemptions": "vllm:num_preemptions_total",
    "engine_steps": "vllm:iteration_tokens_total_count",
    "step_tokens": "vllm:iteration_tokens_total_sum",
    "server_prompt_tokens": "vllm:prompt_tokens_total",
    "server_generation_tokens": "vllm:generation_tokens_total",
    # vLLM's own TTFT (from the request's arrival at the server): beside the client's,
    # it splits a TTFT difference into "the load differed" and "the clients' clocks differ".
    "server_ttft_sum_s": "vllm:time_to_first_token_seconds_sum",
    "server_ttft_count": "vllm:time_to_first_token_seconds_count",
}


def _open(url: str, api_key: str | None, method: str = "GET", timeout: float = 5):
    # The key goes along for endpoints behind a gateway that guards every path.
    req = urllib.request.Request(url, headers=auth_header(api_key), method=method)
    return urllib.request.urlopen(req, timeout=timeout)


def _get(url: str, api_key: str | None = None) -> str:
    with _open(url, api_key) as r:
        return r.read().decode()


def parse_metrics(text: str) -> dict:
    """{sample name: value over label sets (counters summed, gauges their max)} plus
    the labels of info metrics."""
    values: dict[str, float] = {}
    info: dict[str, dict] = {}
    for family in text_string_to_metric_families(text):
        combine = max if family.type == "gauge" else (lambda a, b: a + b)
        for s in family.samples:
            values[s.name] = combine(values[s.name], s.value) if s.name in values else s.value
            if s.name.endswith("_info"):
                info[s.name] = dict(s.labels)
    return {"values": values, "info": info}


def scrape(base_url: str, api_key: str | None = None) -> dict:
    return parse_metrics(_get(base_url + "/metrics", api_key))


def round_deltas(before: dict, after: dict) -> dict:
    """Counter differences for one round, and the ratios derived from them."""
    out = {}
    for key, name in COUNTERS.items():
        a, b = after["values"].get(name), before["values"].get(name)
        out[key] = None if a is None or b is None else a - b
    q, h = out["prefix_cache_queries"], out["prefix_cache_hits"]
    out["prefix_cache_hit_rate"] = h / q if q else None
    steps = out["engine_steps"]
    out["tokens_per_step"] = out["step_tokens"] / steps if steps else None
    n = out["server_ttft_count"]
    out["server_ttft_mean_ms"] = 1000 * out["server_ttft_sum_s"] / n if n else None
    return out


def cache_config(snapshot: dict) -> dict:
    """KV capacity as vLLM reports it (labels of vllm:cache_config_info)."""
    labels = snapshot["info"].get("vllm:cache_config_info", {})
    keep = ("num_gpu_blocks", "block_size", "kv_cache_size_tokens", "kv_cache_memory_bytes",
            "gpu_memory_utilization", "enable_prefix_caching", "kv_cache_max_concurrency")
    return {k: labels[k] for k in keep if k in labels}


def reset_prefix_cache(base_url: str, api_key: str | None = None) -> None:
    """Needs VLLM_SERVER_DEV_MODE=1 on the server (the kit's launcher sets it)."""
    with _open(base_url + "/reset_prefix_cache", api_key, "POST", timeout=30) as r:
        if r.status != 200:
            raise RuntimeError(f"/reset_prefix_cache answered {r.status}")


class NvmlProbe:
    """GPU 0..n via NVML (nvidia-ml-py). `available` is False, with `why`, on a machine
    without an NVIDIA GPU or driver; callers record that instead of numbers."""

    def __init__(self):
        self.available, self.why, self.handles = False, "", []
        try:
            import pynvml
            pynvml.nvmlInit()
            n = pynvml.nvmlDeviceGetCount()
            self.handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(n)]
            self.available = n > 0
            self.why = "" if n else "NVML found no GPU"
            self._nvml = pynvml
        except Exception as e:  # ImportError, NVMLError_LibraryNotFound, driver errors
            self.why = f"no NVIDIA GPU visible ({type(e).__name__}: {e})"

    def describe(self) -> list[dict] | None:
        if not self.available:
            return None
        nv = self._nvml
        # The UUID names the physical GPU: a study resumed on another lent machine is
        # then visible per point, and so is any difference that follows the machine.
        return [{"name": nv.nvmlDeviceGetName(h), "memory_total_bytes": nv.nvmlDeviceGetMemoryInfo(h).total,
                 "driver": nv.nvmlSystemGetDriverVersion(), "uuid": nv.nvmlDeviceGetUUID(h)}
                for h in self.handles]

    def sample(self) -> dict:
        nv = self._nvml
        mem = [nv.nvmlDeviceGetMemoryInfo(h) for h in self.handles]
        return {"mem_used": sum(m.used for m in mem), "mem_total": sum(m.total for m in mem),
                "util": sum(nv.nvmlDeviceGetUtilizationRates(h).gpu for h in self.handles) / len(self.handles)}


class RoundSampler:
    """Samples KV usage from /metrics and GPU counters every `period_s` while a round
    runs. Use as a context manager; read `.result()` afterwards."""

    def __init__(self, base_url: str | None, nvml: NvmlProbe, period_s: float = 0.5,
                 api_key: str | None = None):
        self.base_url, self.nvml, self.period_s, self.api_key = base_url, nvml, period_s, api_key
        self.kv, self.gpu, self.scrape_errors = [], [], 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            try:
                v = (scrape(self.base_url, self.api_key)["values"].get("vllm:kv_cache_usage_perc")
                     if self.base_url else None)
                if v is not None:
                    self.kv.append(v)
            except OSError:
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
        out = {"kv_usage_peak": max(self.kv) if self.kv else None,
               "kv_usage_mean": sum(self.kv) / len(self.kv) if self.kv else None,
               "kv_samples": len(self.kv)}
        if self.gpu:
            peak = max(s["mem_used"] for s in self.gpu)
            out.update(gpu_mem_peak_bytes=peak, gpu_mem_peak_frac=peak / self.gpu[0]["mem_total"],
                       gpu_util_mean=sum(s["util"] for s in self.gpu) / len(self.gpu))
        else:
            out.update(gpu_mem_peak_bytes=None, gpu_mem_peak_frac=None, gpu_util_mean=None)
        return out
