"""/metrics parsing, per-round counter deltas, cache config labels, what an endpoint
offers beyond the OpenAI API (against a stub on loopback), the round sampler, NVML probe."""
from __future__ import annotations

import http.server
import threading
import time

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from vllm_study.measure.counters import (RoundSampler, budget_buckets, cache_config, long_prefills, parse_metrics,
                                         probe_server_api, round_deltas)
from vllm_study.launch.machine import GpuInfo, NvmlProbe

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


def test_round_deltas_hit_rate_and_tokens_per_output_step():
    before = parse_metrics(exposition())
    after = parse_metrics(exposition(queries=(3000.0, 500.0), hits=(2200.0, 100.0),
                                     preempt=(5.0, 1.0), steps=(140.0, 10.0),
                                     step_tokens=(9200.0, 800.0), ttft=((20.9, 10.0), (5.3, 2.0))))
    d = round_deltas(before, after)
    # 7 requests (count delta 6 + 1), 1.2 s of TTFT (sum delta 0.9 + 0.3): only the mean is kept
    assert d["server_ttft_mean_ms"] == pytest.approx(1000 * 1.2 / 7)
    assert "server_ttft_count" not in d and "server_ttft_sum_s" not in d
    assert d["prefix_cache_queries"] == 2000.0
    assert d["prefix_cache_hits"] == 1600.0
    assert d["prefix_cache_hit_rate"] == pytest.approx(0.8)
    assert d["preemptions"] == 3.0
    assert d["output_steps"] == 100.0
    assert d["computed_tokens"] == 6000.0
    assert d["tokens_per_output_step"] == pytest.approx(60.0)
    assert d["server_prompt_tokens"] == 2000.0
    assert d["server_generation_tokens"] == 200.0


def test_round_deltas_idle_round_and_missing_metrics():
    snap = parse_metrics(exposition())
    d = round_deltas(snap, snap)
    assert d["prefix_cache_queries"] == 0.0
    assert d["prefix_cache_hit_rate"] is None   # no queries: no rate, not 0/0
    assert d["tokens_per_output_step"] is None and d["server_ttft_mean_ms"] is None
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


def _prefills(buckets: list[float], computed: list[int]) -> dict:
    """A /metrics snapshot of vLLM's per-request prefill histogram, written by
    prometheus_client with the given bucket bounds."""
    reg = CollectorRegistry()
    h = Histogram("vllm:request_prefill_kv_computed_tokens", "p", ["model_name"], buckets=buckets, registry=reg)
    for n in computed:
        h.labels("tiny").observe(n)
    return parse_metrics(generate_latest(reg).decode())


def test_long_prefills_count_requests_split_by_the_chunk_exactly_with_the_kits_bucket():
    before = _prefills(budget_buckets(256)["request_tokens"], [40, 900])
    after = _prefills(budget_buckets(256)["request_tokens"], [40, 900, 256, 257, 5000, 12])
    assert long_prefills(before, after, 256) == {"long_prefills": 2.0, "long_prefill_edge_tokens": 256}


def test_long_prefills_with_coarse_buckets_count_above_the_bound_below_the_chunk_and_say_so():
    coarse = [1, 8, 16, 32, 64, 128, 200, 500, 1000, 2000, 5000]  # vLLM's default style: no 256
    after = _prefills(coarse, [230, 240, 300, 3000])
    assert long_prefills(_prefills(coarse, []), after, 256) == {"long_prefills": 4.0, "long_prefill_edge_tokens": 200}


def test_nvml_probe_says_why_when_no_gpu():
    """This machine has no NVIDIA driver: the probe must say so instead of raising.
    (On a GPU machine the same test checks the description instead.)"""
    probe = NvmlProbe()
    if not probe.available:
        assert isinstance(probe.why, str) and "GPU" in probe.why
        assert probe.describe() == []
    else:
        assert probe.why == ""
        gpus = probe.describe()
        assert gpus and all(isinstance(g, GpuInfo) for g in gpus)
        assert all(g.memory_total_bytes > 0 and g.uuid.startswith("GPU-") for g in gpus)
        assert [g.index for g in gpus] == probe.indices
        sample = probe.sample()
        assert 0 < sample["mem_used"] <= sample["mem_total"]


# ---------------------------------------------------------------- probe_server_api, RoundSampler

class _Stub(http.server.ThreadingHTTPServer):
    """Loopback HTTP: /<mode>/metrics and /<mode>/reset_prefix_cache answer as `mode`
    says (full: both; metrics: no reset; none: neither). /<mode>/metrics serves
    `self.metrics_text`, which a test may change while a sampler runs."""

    def __init__(self):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.metrics_text = exposition()
        self.resets = 0
        self.thread = threading.Thread(target=self.serve_forever, daemon=True)
        self.thread.start()

    def url(self, mode: str) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/{mode}"


class _Handler(http.server.BaseHTTPRequestHandler):
    def _answer(self, status: int, body: str = ""):
        data = body.encode()
        self.send_response(status)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        mode, _, rest = self.path.lstrip("/").partition("/")
        if rest == "metrics" and mode in ("full", "metrics"):
            return self._answer(200, self.server.metrics_text)
        self._answer(404, "Not Found")

    def do_POST(self):
        mode, _, rest = self.path.lstrip("/").partition("/")
        if rest == "reset_prefix_cache" and mode == "full":
            self.server.resets += 1
            return self._answer(200)
        self._answer(404, '{"detail":"Not Found"}')

    def log_message(self, *a):
        pass


@pytest.fixture
def stub(monkeypatch):
    # A proxy variable that would capture loopback for urllib's default opener: the
    # kit's requests must go direct anyway (net.open_url), or every call here fails.
    monkeypatch.setenv("HTTP_PROXY", "http://127.0.0.1:9")
    monkeypatch.setenv("http_proxy", "http://127.0.0.1:9")
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    s = _Stub()
    yield s
    s.shutdown()
    s.server_close()


def test_probe_full_endpoint_gives_snapshot_no_warnings_and_resets(stub):
    api = probe_server_api(stub.url("full"))
    snap, notes = api.snapshot, api.notes
    assert notes == [] and api.cache_reset
    assert snap["values"]["vllm:prefix_cache_queries_total"] == 1500.0
    assert stub.resets == 1


def test_probe_metrics_without_reset_warns_that_the_cache_stays_warm(stub):
    api = probe_server_api(stub.url("metrics"))
    snap, notes = api.snapshot, api.notes
    assert not api.cache_reset
    assert snap is not None and snap["values"]["vllm:num_preemptions_total"] == 3.0
    (note,) = notes
    assert f"{stub.url('metrics')}/reset_prefix_cache is refused (HTTP 404" in note
    assert "VLLM_SERVER_DEV_MODE=1" in note
    assert "NOT reset between rounds" in note


def test_probe_without_metrics_or_reset_gives_none_and_two_warnings(stub):
    api = probe_server_api(stub.url("none"))
    snap, notes = api.snapshot, api.notes
    assert snap is None and not api.cache_reset
    assert len(notes) == 2
    metrics_note, reset_note = notes
    assert f"{stub.url('none')}/metrics does not answer (HTTP 404)" in metrics_note
    assert "server-side counters are absent" in metrics_note
    assert "NOT reset between rounds" in reset_note


def test_probe_of_nothing_listening_says_why():
    with http.server.HTTPServer(("127.0.0.1", 0), _Handler) as closed:
        port = closed.server_address[1]
    api = probe_server_api(f"http://127.0.0.1:{port}")
    snap, notes = api.snapshot, api.notes
    assert snap is None and len(notes) == 2
    assert all("Error" in n for n in notes)  # the exception is named (URLError, ConnectionRefusedError)


class _NoGpu:
    available = False


class _FakeGpu:
    available = True

    def __init__(self):
        self.samples = iter([{"mem_used": 10, "mem_total": 100, "util": 20.0},
                             {"mem_used": 40, "mem_total": 100, "util": 60.0}])
        self.last = None

    def sample(self):
        self.last = next(self.samples, self.last)
        return self.last


def _gauges(kv: float, running: int, waiting: int) -> str:
    return (f"# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc{{engine=\"0\"}} {kv}\n"
            f"# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{{engine=\"0\"}} {running}\n"
            f"# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{{engine=\"0\"}} {waiting}\n")


def _wait_for(cond, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "the sampler took no sample"
        time.sleep(0.01)


def test_round_sampler_keeps_peaks_and_means_of_the_gauges(stub):
    stub.metrics_text = _gauges(0.2, 3, 0)
    with RoundSampler(stub.url("metrics"), _NoGpu(), period_s=0.01) as s:
        _wait_for(lambda: len(s.gauges.get("kv", [])) >= 2)
        stub.metrics_text = _gauges(0.8, 5, 7)
        n = len(s.gauges["kv"])
        _wait_for(lambda: len(s.gauges["kv"]) >= n + 3)
    r = s.result()
    kv = s.gauges["kv"]
    assert r["kv_usage_peak"] == 0.8 and r["kv_usage_mean"] == pytest.approx(sum(kv) / len(kv))
    assert 0.2 < r["kv_usage_mean"] < 0.8
    assert r["running_peak"] == 5 and r["waiting_peak"] == 7
    # no GPU: the fields are there and None
    assert r["gpu_mem_peak_bytes"] is None and r["gpu_mem_peak_frac"] is None and r["gpu_util_mean"] is None
    assert s.scrape_errors == 0


def test_round_sampler_without_metrics_counts_errors_and_samples_the_gpu(stub):
    gpu = _FakeGpu()
    with RoundSampler(stub.url("none"), gpu, period_s=0.01) as s:
        _wait_for(lambda: len(s.gpu) >= 3 and s.scrape_errors >= 3)
    r = s.result()
    assert r["kv_usage_peak"] is None and r["kv_usage_mean"] is None
    assert r["running_peak"] is None and r["waiting_peak"] is None
    assert r["gpu_mem_peak_bytes"] == 40 and r["gpu_mem_peak_frac"] == pytest.approx(0.4)
    utils = [x["util"] for x in s.gpu]
    assert r["gpu_util_mean"] == pytest.approx(sum(utils) / len(utils))


def test_round_sampler_with_no_url_samples_only_the_gpu():
    with RoundSampler(None, _FakeGpu(), period_s=0.01) as s:
        _wait_for(lambda: len(s.gpu) >= 2)
    r = s.result()
    assert s.scrape_errors == 0 and s.gauges == {}
    assert r["kv_usage_peak"] is None and r["gpu_mem_peak_bytes"] == 40
