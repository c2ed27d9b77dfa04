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
from paths import REPO

BENCHMARKS = REPO / "benchmarks"

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
    assert any("the same points and runs in both tools" in p for p in found)


def _kit_run(root: Path):
    """A kit run of 2 points that shared one start (live knobs): mbt=512 launched the
    server and served mbt=256 too; each point has its own rounds."""
    from synthetic_run import _new_run, study
    from vllm_study.define.grid import expand
    from vllm_study.define.study_file import study_from_dict
    from vllm_study.records.results import Launch, RoundRecord, StartRecord, append_round
    s = study_from_dict(study(grid={"max_num_batched_tokens": [256, 512]}, replicates=1))
    run = _new_run(root, s, expand(s, "cpu"))
    for pid, served_by, timeline, ttfts in (
            ("mbt=512", None, {"spawn": 0.0, "warmup": 100.0, "measured": 160.0}, (200.0, 210.0)),
            ("mbt=256", "mbt=512/s1", {"measured": 160.0}, (300.0, 330.0))):
        d = run.point(pid).start_dir(1)
        d.mkdir(parents=True)
        StartRecord(point=pid, start=1, status="ok", started_utc="x", host="h", launch=Launch(), rounds_planned=2,
                    serves=["mbt=512", "mbt=256"] if served_by is None else [], served_by=served_by,
                    timeline=timeline).save(d / "start.json")
        for i, ttft in enumerate(ttfts):
            append_round(d, RoundRecord(point=pid, start=1, round=i, status="ok", utc="x",
                                        metrics={"ttft_p50_ms": ttft, "tpot_p50_ms": 20.0,
                                                 "output_throughput": 500.0}), [])
        if served_by is None:  # the shared server's log is in the launching start's folder only
            with gzip.open(d / "server.log.gz", "wt") as f:
                f.write(GPU_026)
    return run


def test_the_kits_limit_counts_the_starts_it_launched_not_its_points(tmp_path):
    mod = _sweep_speed()
    run = _kit_run(tmp_path / "kit")
    (start,) = mod.kit_starts(run)  # one start served both points
    assert start["start"] == "mbt=512/s1" and start["serves"] == ["mbt=512", "mbt=256"]
    assert start["gpu_startup_s"] == pytest.approx(23.140827) and start["measure_s"] == 60.0
    points = mod.kit_points(run)
    assert points["mbt=256"]["served_by"] == "mbt=512/s1"
    assert points["mbt=256"]["gpu_startup_s"] is None and points["mbt=256"]["measure_s"] is None
    assert [r["ttft_p50_ms"] for r in points["mbt=256"]["runs"]] == [300.0, 330.0]


def test_the_summary_sets_the_kit_against_its_own_plan_and_vllm_bench_one_start_a_point(tmp_path, capsys):
    mod = _sweep_speed()
    _kit_run(tmp_path / "kit")
    points = {"mbt=256": {"max_num_batched_tokens": 256}, "mbt=512": {"max_num_batched_tokens": 512}}
    exp = tmp_path / "bench" / "sweep"
    for mbt in (256, 512):
        for i in range(2):
            _write(exp / f"SERVE--max_num_batched_tokens={mbt}" / f"run={i}.json",
                   {"max_num_batched_tokens": mbt, "duration": 20.0, "median_ttft_ms": 250.0,
                    "median_tpot_ms": 20.0, "output_throughput": 500.0})
    with gzip.open(tmp_path / "bench" / "bench.log.gz", "wt") as f:  # two servers: 23.14 s and 44.6 s
        f.write("[BEGIN SERVER]\n" + GPU_026 + "[END SERVER]\n[BEGIN SERVER]\n" + GPU_032 + "[END SERVER]\n")
    _write(tmp_path / "sweep_speed.json", {"runs": 2, "order": ["kit", "vllm_bench"], "points": points,
                                           "wall_s": {"kit": 100.0, "vllm_bench": 400.0}})
    got = mod.summarize(tmp_path, ratio_target=0.25, limit_target=1.3)
    assert got["starts"] == {"kit": 1, "vllm_bench": 2}
    # the kit's limit: its one start's start-up (23.14 s) and its measuring (60 s), not per point
    assert got["limit_s"] == pytest.approx(83.140827)
    assert got["kit_over_limit"] == pytest.approx(100.0 / 83.140827)
    assert got["vllm_bench_plan_s"] == {"gpu_startup_s": pytest.approx(67.740827), "measure_s": 80.0}
    assert got["targets_met"] == {"ratio": True, "limit": True}
    assert got["ratio_floor"] == pytest.approx(83.140827 / 400.0)  # the kit at its limit
    out = capsys.readouterr().out
    assert "1 server start(s)" in out and "2 server start(s)" in out and "floor of the ratio          0.21" in out
    # one kit start and one vllm bench start a point: the per-point ranges leave out start-to-start spread
    assert "one start a side: the interval is over rounds of one start and leaves out start-to-start spread" in out


def test_a_study_with_live_knobs_is_one_both_tools_can_run():
    mod = _sweep_speed()
    live = {"name": "s", "grid": {"max_num_batched_tokens": [256, 512], "max_num_seqs": [2, 4]},
            "workload": {"kind": "shared_prefix", "api": "completions", "output_tokens": 16},
            "server": {"live_knobs": True}}
    assert mod.problems(Study.model_validate(live)) == []


def test_the_h200_study_runs_its_4_points_in_one_kit_start_and_alike_in_both_tools():
    from vllm_study.define.grid import expand, live_groups
    from vllm_study.define.study_file import load_study
    mod = _sweep_speed()
    study = load_study(BENCHMARKS.parent / "params" / "h200-sweep-speed.yaml")
    assert mod.problems(study) == [] and study.rounds == 3
    points = expand(study, "gpu")
    groups, _ = live_groups(study, "gpu", points)
    assert len(points) == 4 and len(groups) == 1 and groups[0][0].id == "mbt=2048__mns=32"


def test_vllms_sweep_options_are_read_from_its_whole_help():
    """vLLM 0.26's CLI lists a subcommand's options only under --help=all: read from a
    plain --help, the tool seemed to have no --warmup-num-prompts and its runs lost their
    warm-up. The installed vLLM's tool, asked as the benchmark asks it."""
    import os
    text = _sweep_speed().sweep_help(dict(os.environ))
    assert "--serve-cmd" in text and "--warmup-num-prompts" in text and "--num-runs" in text


def test_an_unfinished_invocation_goes_on_keeping_the_tool_that_finished(tmp_path):
    """The machine ended during vllm bench: the kit's run and wall time are kept, vllm
    bench's partial files go (it runs again) and its prompts stay; another study's
    folder, or a folder with no record, is refused."""
    mod = _sweep_speed()
    meta = {"study": "s.yaml", "engine": "gpu", "runs": 3, "order": ["kit", "vllm_bench"],
            "points": {"mbt=512": {"max_num_batched_tokens": 512}}, "wall_s": {}, "ran": {}}
    _write(tmp_path / "sweep_speed.json", {**meta, "wall_s": {"kit": 300.0},
                                           "ran": {"kit": {"host": "a", "began": "2026-12-05T05:00"}}})
    _write(tmp_path / "kit" / "run" / "manifest.json", {})
    _write(tmp_path / "bench" / "sweep" / "point" / "run=0.json", {"duration": 1})
    (tmp_path / "bench" / "prompts.jsonl").write_text("{}\n")
    (tmp_path / "bench" / "bench.log").write_text("partial")
    resumed, wrong = mod.earlier(tmp_path, meta)
    assert wrong is None and resumed["wall_s"] == {"kit": 300.0} and resumed["ran"]["kit"]["host"] == "a"
    mod.unfinished(tmp_path, "vllm_bench")
    assert [f.name for f in (tmp_path / "bench").iterdir()] == ["prompts.jsonl"]
    assert (tmp_path / "kit" / "run" / "manifest.json").exists()
    other = {**meta, "points": {"mbt=2048": {"max_num_batched_tokens": 2048}}}
    assert "another study's" in mod.earlier(tmp_path, other)[1]
    assert "no sweep_speed.json" in mod.earlier(tmp_path / "bench", meta)[1]


def test_a_resumed_invocation_on_another_device_is_refused():
    """The kit finished on an H200 and the session ended: vllm bench resumed on an H100
    would put two cards' wall times in one ratio."""
    mod = _sweep_speed()
    meta = {"study": "s.yaml", "wall_s": {"kit": 300.0},
            "ran": {"kit": {"host": "a", "device": "NVIDIA H200", "began": "2026-12-05T05:00"},
                    "vllm_bench": {"host": "a", "device": "NVIDIA H100 80GB HBM3", "began": "2026-12-05T05:06"}}}
    assert mod.other_device(meta, "NVIDIA H200") is None  # vllm bench did not finish: it runs again here
    wrong = mod.other_device(meta, "NVIDIA H100 80GB HBM3")
    assert "NVIDIA H200" in wrong and "resume on that device" in wrong
    older = {**meta, "ran": {"kit": {"host": "a", "began": "x"}}}  # a record from before devices were kept
    assert mod.other_device(older, "NVIDIA H200") is None
    assert isinstance(mod.this_device(), str) and mod.this_device()
