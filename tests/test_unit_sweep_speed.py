"""benchmarks/sweep_speed.py's reading of both tools' files, and vLLM's start-up lines."""
from __future__ import annotations

import gzip
import importlib.util
import json
import sys
from pathlib import Path

import pytest

from vllm_study.launch import startup_log
from vllm_study.define.params import Study

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"

# vLLM's own lines, as 0.26 on an H200, 0.32 on a GPU and the 0.32 CPU build print them
E, A = "(EngineCore pid=1386) INFO 11-30", "(APIServer pid=1300) INFO 11-30"
GPU_026 = "\n".join([
    f"{E} 17:40:02 [core.py:93] Initializing a V1 LLM engine (v0.26.0) with config: x",
    f"{E} 17:40:32 [model_runner.py:305] Model loading took 0.93 GiB and 1.540827 seconds",
    f"{E} 17:40:40 [backends.py:1] torch.compile took 2.88 s in total",
    f"{E} 17:40:50 [gpu_model_runner.py:1] Graph capturing finished in 3 secs, took 0.5 GiB",
    f"{E} 17:40:53 [core.py:340] init engine (profile, create kv cache, warmup model) took 21.60 s "
    "(compilation: 2.88 s)",
    f"{A} 17:40:58 [api_server.py:1] Starting vLLM server on http://127.0.0.1:8000", ""])
GPU_032 = "INFO 12-02 04:32:42 [gpu_model_runner.py:5150] Model loading took 14.2 GiB memory and 4.500000 seconds\n" \
          "INFO 12-02 04:33:30 [core.py:402] init engine (profile, create kv cache, warmup model) took 40.10 s\n"
CPU_032 = "\x1b[32mINFO\x1b[0m 12-02 04:32:42 [base_loader.py:82] Initializing model took 1.156041 seconds\n" \
          "INFO 12-02 04:32:46 [core.py:402] init engine (profile, create kv cache, warmup model) took 0.42 s\n"


def _sweep_speed():
    sys.path.insert(0, str(BENCHMARKS))  # it imports client_agreement from its own folder
    try:
        spec = importlib.util.spec_from_file_location("sweep_speed", BENCHMARKS / "sweep_speed.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod
    finally:
        sys.path.remove(str(BENCHMARKS))


def test_vllms_start_up_lines_are_read_in_each_releases_wording():
    old = startup_log.figures(GPU_026)
    assert old == {"weights_s": pytest.approx(1.540827), "compile_s": 2.88, "graphs_s": 3.0, "engine_init_s": 21.6,
                   "gpu_startup_s": pytest.approx(23.140827)}
    assert startup_log.engine_to_serving_s(GPU_026) == 56.0
    assert startup_log.figures(GPU_032)["gpu_startup_s"] == pytest.approx(44.6)
    cpu = startup_log.figures(CPU_032)  # coloured, and dummy weights made as the model is built
    assert cpu["weights_s"] == pytest.approx(1.156041) and cpu["gpu_startup_s"] == pytest.approx(1.576041)
    assert startup_log.figures("no such lines")["gpu_startup_s"] is None
    assert startup_log.engine_to_serving_s(GPU_032) is None


def _write(path: Path, data) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))


def test_vllm_bench_runs_are_matched_to_points_by_their_serve_values(tmp_path):
    mod = _sweep_speed()
    exp = tmp_path / "bench" / "sweep"
    points = {"mbt=256": {"max_num_batched_tokens": 256}, "mbt=1024": {"max_num_batched_tokens": 1024}}
    for mbt, ttfts in ((256, (300.0, 320.0)), (1024, (250.0, 270.0))):
        folder = exp / f"SERVE--max_num_batched_tokens={mbt}"
        for i, ttft in enumerate(ttfts):
            _write(folder / f"run={i}.json", {"max_num_batched_tokens": mbt, "run_number": i, "duration": 5.0,
                                               "median_ttft_ms": ttft, "median_tpot_ms": 50.0,
                                               "output_throughput": 100.0})
        _write(folder / "warmup.json", {"duration": 1.0, "median_ttft_ms": 1.0})  # carries no serve values
        _write(folder / "summary.json", [{"max_num_batched_tokens": mbt}])
    with gzip.open(tmp_path / "bench" / "bench.log.gz", "wt") as f:  # servers start in serve-params order
        f.write("[BEGIN SERVER]\n" + GPU_026 + "[END SERVER]\n[BEGIN SERVER]\n" + GPU_032 + "[END SERVER]\n")
    got = mod.bench_points(exp, points)
    assert [r["median_ttft_ms"] for r in got["mbt=256"]["runs"]] == [300.0, 320.0]
    assert [r["median_ttft_ms"] for r in got["mbt=1024"]["runs"]] == [250.0, 270.0]
    assert got["mbt=256"]["measure_s"] == 11.0  # two runs and the warm-up
    assert got["mbt=256"]["gpu_startup_s"] == pytest.approx(23.140827)
    assert got["mbt=1024"]["gpu_startup_s"] == pytest.approx(44.6)


def test_a_study_the_two_tools_cannot_run_alike_is_refused_with_its_fix():
    mod = _sweep_speed()
    ok = {"name": "s", "grid": {"max_num_batched_tokens": [256, 512]},
          "workload": {"kind": "shared_prefix", "api": "completions", "output_tokens": 16}}
    assert mod.problems(Study.model_validate(ok)) == []
    bad = Study.model_validate({**ok, "replicates": 2, "workload": {**ok["workload"], "api": "chat",
                                                                    "output_tokens": {"uniform": [8, 32]}}})
    found = mod.problems(bad)
    assert any("api must be completions" in p for p in found)
    assert any("output_tokens must be one number" in p for p in found)
    assert any("one server start a point" in p for p in found)
