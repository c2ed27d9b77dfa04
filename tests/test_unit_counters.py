"""/metrics parsing, per-round counter deltas, cache config labels, NVML probe."""
from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from vllm_study.counters import NvmlProbe, cache_config, parse_metrics, round_deltas

_CACHE_LABELS = ('block_size="16",cache_dtype="auto",enable_prefix_caching="True",'
                 'gpu_memory_utilization="0.9",kv_cache_max_concurrency="46.3",'
                 'kv_cache_memory_bytes="None",kv_cache_size_tokens="758880",'
                 'num_cpu_blocks="None",num_gpu_blocks="47430",sliding_window="None"')


def exposition(queries=(1000.0, 500.0), hits=(600.0, 100.0), preempt=(2.0, 1.0),
               steps=(40.0, 10.0), step_tokens=(3200.0, 800.0), kv=(0.25, 0.5),
               ttft=((20.0, 4.0), (5.0, 1.0))) -> str:
    """Prometheus text as vLLM's /metrics writes it, for two engines (data parallel)."""
    lines = []

    def fam(name, kind, helptext):
        lines.extend([f"# HELP {name} {helptext}", f"# TYPE {name} {kind}"])

    def lab(e):
        return f'engine="{e}",model_name="tiny"'

    fam("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.")
    lines += [f"vllm:kv_cache_usage_perc{{{lab(e)}}} {kv[e]}" for e in (0, 1)]
    fam("vllm:prefix_cache_queries", "counter", "Prefix cache queries, in terms of number of queried tokens.")
    lines += [f"vllm:prefix_cache_queries_total{{{lab(e)}}} {queries[e]}" for e in (0, 1)]
    lines += [f"vllm:prefix_cache_queries_created{{{lab(e)}}} 1.7e9" for e in (0, 1)]
    fam("vllm:prefix_cache_hits", "counter", "Prefix cache hits, in terms of number of cached tokens.")
    lines += [f"vllm:prefix_cache_hits_total{{{lab(e)}}} {hits[e]}" for e in (0, 1)]
    fam("vllm:num_preemptions", "counter", "Cumulative number of preemption from the engine.")
    lines += [f"vllm:num_preemptions_total{{{lab(e)}}} {preempt[e]}" for e in (0, 1)]
    fam("vllm:iteration_tokens_total", "histogram", "Histogram of number of tokens per engine_step.")
    for e in (0, 1):
        for le, frac in (("1.0", 0.0), ("8.0", 0.25), ("512.0", 1.0), ("+Inf", 1.0)):
            lines.append(f'vllm:iteration_tokens_total_bucket{{{lab(e)},le="{le}"}} {steps[e] * frac}')
        lines.append(f"vllm:iteration_tokens_total_count{{{lab(e)}}} {steps[e]}")
        lines.append(f"vllm:iteration_tokens_total_sum{{{lab(e)}}} {step_tokens[e]}")
    fam("vllm:time_to_first_token_seconds", "histogram", "Histogram of time to first token in seconds.")
    for e in (0, 1):
        total, count = ttft[e]
        lines.append(f'vllm:time_to_first_token_seconds_bucket{{{lab(e)},le="+Inf"}} {count}')
        lines.append(f"vllm:time_to_first_token_seconds_count{{{lab(e)}}} {count}")
        lines.append(f"vllm:time_to_first_token_seconds_sum{{{lab(e)}}} {total}")
    fam("vllm:prompt_tokens", "counter", "Number of prefill tokens processed.")
    lines += [f"vllm:prompt_tokens_total{{{lab(e)}}} {queries[e]}" for e in (0, 1)]
    fam("vllm:generation_tokens", "counter", "Number of generation tokens processed.")
    lines += [f"vllm:generation_tokens_total{{{lab(e)}}} {steps[e] * 2}" for e in (0, 1)]
    fam("vllm:cache_config_info", "gauge", "Information of the LLMEngine CacheConfig")
    lines.append(f'vllm:cache_config_info{{{_CACHE_LABELS},engine="0"}} 1.0')
    fam("python_gc_objects_collected", "counter", "Objects collected during gc")
    lines.append('python_gc_objects_collected_total{generation="0"} 1234.0')
    return "\n".join(lines) + "\n"


def test_parse_sums_label_sets():
    snap = parse_metrics(exposition())
    v = snap["values"]
    assert v["vllm:prefix_cache_queries_total"] == 1500.0
    assert v["vllm:prefix_cache_hits_total"] == 700.0
    assert v["vllm:num_preemptions_total"] == 3.0
    assert v["vllm:iteration_tokens_total_count"] == 50.0
    assert v["vllm:iteration_tokens_total_sum"] == 4000.0
    # gauges are summed over engines too: right for one engine, not for a usage
    # fraction under data parallelism, so the sum is not asserted here
    assert "vllm:kv_cache_usage_perc" in v
    assert v["python_gc_objects_collected_total"] == 1234.0


def test_parse_keeps_info_labels():
    snap = parse_metrics(exposition())
    labels = snap["info"]["vllm:cache_config_info"]
    assert labels["num_gpu_blocks"] == "47430"
    assert labels["block_size"] == "16"
    assert labels["engine"] == "0"
    assert snap["values"]["vllm:cache_config_info"] == 1.0


def test_round_deltas_hit_rate_and_tokens_per_step():
    before = parse_metrics(exposition())
    after = parse_metrics(exposition(queries=(3000.0, 500.0), hits=(2200.0, 100.0),
                                     preempt=(5.0, 1.0), steps=(140.0, 10.0),
                                     step_tokens=(9200.0, 800.0), ttft=((20.9, 10.0), (5.3, 2.0))))
    d = round_deltas(before, after)
    assert d["server_ttft_count"] == 7.0
    assert d["server_ttft_mean_ms"] == pytest.approx(1000 * 1.2 / 7)  # 7 requests, 1.2 s of TTFT
    assert d["prefix_cache_queries"] == 2000.0
    assert d["prefix_cache_hits"] == 1600.0
    assert d["prefix_cache_hit_rate"] == pytest.approx(0.8)
    assert d["preemptions"] == 3.0
    assert d["engine_steps"] == 100.0
    assert d["step_tokens"] == 6000.0
    assert d["tokens_per_step"] == pytest.approx(60.0)
    assert d["server_prompt_tokens"] == 2000.0
    assert d["server_generation_tokens"] == 200.0


def test_round_deltas_idle_round_and_missing_metrics():
    snap = parse_metrics(exposition())
    d = round_deltas(snap, snap)
    assert d["prefix_cache_queries"] == 0.0
    assert d["prefix_cache_hit_rate"] is None   # no queries: no rate, not 0/0
    assert d["tokens_per_step"] is None and d["server_ttft_mean_ms"] is None
    empty = parse_metrics("")
    d = round_deltas(empty, snap)
    assert d["preemptions"] is None and d["prefix_cache_hit_rate"] is None


def test_cache_config_extracts_capacity_labels():
    cc = cache_config(parse_metrics(exposition()))
    assert cc == {"num_gpu_blocks": "47430", "block_size": "16", "kv_cache_size_tokens": "758880",
                  "kv_cache_memory_bytes": "None", "gpu_memory_utilization": "0.9",
                  "enable_prefix_caching": "True", "kv_cache_max_concurrency": "46.3"}
    assert cache_config(parse_metrics("")) == {}


def test_parse_what_prometheus_client_itself_writes():
    """Metrics declared as vLLM declares them (names without _total; the info metric
    as a gauge), exposed by prometheus_client: the names the kit looks for must match."""
    reg = CollectorRegistry()
    labels = ["model_name", "engine"]
    q = Counter("vllm:prefix_cache_queries", "q", labels, registry=reg)
    h = Counter("vllm:prefix_cache_hits", "h", labels, registry=reg)
    it = Histogram("vllm:iteration_tokens_total", "t", labels, buckets=[1, 8, 512], registry=reg)
    info = Gauge("vllm:cache_config_info", "i", ["block_size", "num_gpu_blocks", "engine"], registry=reg)
    for e in ("0", "1"):
        q.labels("tiny", e).inc(100)
        h.labels("tiny", e).inc(25)
        for n in (4, 12, 300):
            it.labels("tiny", e).observe(n)
    info.labels("128", "1000", "0").set(1)
    snap = parse_metrics(generate_latest(reg).decode())
    d = round_deltas(parse_metrics(""), snap)
    assert snap["values"]["vllm:prefix_cache_queries_total"] == 200
    assert snap["values"]["vllm:iteration_tokens_total_count"] == 6
    assert snap["values"]["vllm:iteration_tokens_total_sum"] == 2 * (4 + 12 + 300)
    assert cache_config(snap) == {"block_size": "128", "num_gpu_blocks": "1000"}
    assert d["prefix_cache_queries"] is None  # nothing to subtract from


def test_nvml_probe_says_why_when_no_gpu():
    """This machine has no NVIDIA driver: the probe must say so instead of raising.
    (On a GPU machine the same test checks the description instead.)"""
    probe = NvmlProbe()
    if not probe.available:
        assert isinstance(probe.why, str) and "GPU" in probe.why
        assert probe.describe() is None
    else:
        assert probe.why == ""
        gpus = probe.describe()
        assert gpus and all(g["memory_total_bytes"] > 0 and g["uuid"].startswith("GPU-") for g in gpus)
        sample = probe.sample()
        assert 0 < sample["mem_used"] <= sample["mem_total"]
