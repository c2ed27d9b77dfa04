"""The sweep command end to end: real papermill, real vLLM CPU servers, a time budget
that stops between points, --resume that finishes the run, a failed point recorded
as data, and a report rendered from the results."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]

STUDY = {
    "name": "e2e-sweep",
    "model": {"card": "tiny-qwen2", "served_name": "tiny"},
    "engine_args": {"max_model_len": 2048, "enable_prefix_caching": True, "enforce_eager": True,
                    "dtype": "bfloat16"},
    # the second point's 1 MiB KV cache cannot hold one 2,048-token request: it must fail
    "grid": {"max_num_batched_tokens": [256], "kv_cache_memory_bytes": [33554432, 1048576]},
    "workload": {"system_prompt_tokens": 512, "question_tokens": 16, "output_tokens": 16,
                 "concurrency": 4, "requests_per_round": 8, "warmup_requests": 2},
    "rounds": 3,
}


def sweep(*args, cwd=REPO):
    return subprocess.run([sys.executable, "-m", "vllm_study", "sweep", *map(str, args)], cwd=cwd,
                          capture_output=True, text=True, timeout=1200)


def test_bad_params_fail_fast_with_a_fix(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({**STUDY, "workload": {**STUDY["workload"], "concurency": 4},
                                   "engine_args": {**STUDY["engine_args"], "gpu_memory_utilization": 1.5}}))
    r = sweep(bad, "--results", tmp_path / "results")
    assert r.returncode == 2
    assert "workload.concurency: unknown key (did you mean 'concurrency'?)" in r.stderr
    assert "gpu_memory_utilization" in r.stderr
    assert not (tmp_path / "results").exists()  # nothing was started or written


@pytest.mark.e2e
def test_budget_resume_failure_and_report(tmp_path):
    params = tmp_path / "study.yaml"
    params.write_text(yaml.safe_dump(STUDY, sort_keys=False))  # the grid order names the points
    results = tmp_path / "results"

    first = sweep(params, "--results", results, "--max-minutes", "0.01")
    assert first.returncode == 0, first.stderr[-3000:]
    (run,) = results.iterdir()
    assert "stopped after 0.01 minutes with 1 point(s) left" in first.stdout
    points = run / "points"
    assert [p.name for p in points.iterdir()] == ["mbt=256__kv=32MiB"]

    second = sweep("--resume", run)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "1 already finished" in second.stdout

    ok = json.loads((points / "mbt=256__kv=32MiB" / "summary.json").read_text())
    bad = json.loads((points / "mbt=256__kv=1MiB" / "summary.json").read_text())
    assert ok["status"] == "ok" and ok["rounds_ok"] == 3
    assert bad["status"] == "failed"
    assert "max_model_len too large for the KV cache" in bad["reason"]
    assert (points / "mbt=256__kv=1MiB" / "point.ipynb").exists()  # kept on failure too

    df = pd.read_csv(run / "summary.csv")
    good = df[df["point"] == "mbt=256__kv=32MiB"]
    rounds, median = good[good["round"] != "median"], good[good["round"] == "median"].iloc[0]
    assert sorted(rounds["round"]) == ["0", "1", "2"]
    for metric in ("ttft_p90_ms", "itl_p90_ms", "tpot_p50_ms", "output_throughput", "prefix_cache_hit_rate"):
        assert median[metric] == pytest.approx(rounds[metric].median()), metric
    # vLLM's own TTFT starts when the request reaches the server and ends before the
    # token reaches the client: below the client's, for every round
    assert (0 < rounds["server_ttft_mean_ms"]).all()
    assert (rounds["server_ttft_mean_ms"] < rounds["ttft_mean_ms"]).all()
    failed_row = df[df["point"] == "mbt=256__kv=1MiB"].iloc[0]
    assert failed_row["status"] == "failed" and "KV cache" in failed_row["reason"]

    assert (run / "report.ipynb").exists()
    for fig in ("heatmaps.png", "trends.png", "ttft_p90_by_round.png"):
        assert (run / "figures" / fig).stat().st_size > 10_000, fig
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["versions"]["vllm"] and manifest["git"]["sha"]
    (resumed,) = manifest["resumes"]  # which code ran the second slice
    assert resumed["points_left"] == ["mbt=256__kv=1MiB"] and resumed["git"]["sha"] == manifest["git"]["sha"]
    assert resumed["host"] == manifest["host"] and "GPU" in resumed["gpu"]  # CPU machine: the reason
    for s in (ok, bad):  # nothing left running
        if s.get("server_pgid"):
            with pytest.raises(ProcessLookupError):
                os.killpg(s["server_pgid"], 0)


@pytest.mark.e2e
def test_sigterm_stops_everything_and_resume_completes(tmp_path):
    """SIGTERM while the second point's server starts: the sweep exits 130, every
    process it started (papermill kernel, vLLM and its engine) is gone, the finished
    point is kept, and --resume runs only the rest."""
    import time

    import psutil

    study = {**STUDY, "grid": {"max_num_batched_tokens": [256, 512]}, "rounds": 1,
             "engine_args": {**STUDY["engine_args"], "kv_cache_memory_bytes": 33554432}}
    params = tmp_path / "study.yaml"
    params.write_text(yaml.safe_dump(study, sort_keys=False))
    results = tmp_path / "results"
    proc = subprocess.Popen([sys.executable, "-m", "vllm_study", "sweep", str(params), "--results", str(results)],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 600
        second = None
        while time.monotonic() < deadline:
            runs = list(results.glob("*/points/mbt=512"))
            if runs and (runs[0] / "server.pgid").exists():
                second = runs[0]
                break
            assert proc.poll() is None, proc.stdout.read()
            time.sleep(0.5)
        assert second is not None, "the second point's server never started"
        started = psutil.Process(proc.pid).children(recursive=True)
        assert any("vllm" in " ".join(p.cmdline()) for p in started)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, out[-2000:]
    assert "interrupted: finished points are kept" in out
    _, alive = psutil.wait_procs(started, timeout=30)
    assert not alive, [p.cmdline() for p in alive]
    run = second.parent.parent
    first = json.loads((run / "points" / "mbt=256" / "summary.json").read_text())
    assert first["status"] == "ok"
    assert json.loads((second / "summary.json").read_text())["status"] == "running"

    again = sweep("--resume", run)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "1 already finished" in again.stdout
    assert json.loads((second / "summary.json").read_text())["status"] == "ok"
