"""The sweep command end to end: real papermill, real vLLM CPU servers, a time budget
that stops between server starts, --resume that finishes the run, failures recorded as
data (one point, or every point), SIGTERM that leaves nothing running, a model with a
non-ChatML template, and an endpoint study of a plain vLLM server."""
from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
import yaml

from e2e_support import kv_bytes, no_proxy_env, tiny
from procs import group_gone
from vllm_study import models
from vllm_study.params import ModelSpec
from vllm_study.results import RunFolder, StartRecord
from vllm_study.server import VllmServer, free_port

REPO = Path(__file__).resolve().parents[1]

# the second point's 512-token KV cache cannot hold one 2,048-token request: it must fail
STUDY = tiny(grid={"max_num_batched_tokens": [256], "kv_cache_memory_bytes": [kv_bytes(16384), kv_bytes(512)]},
             rounds=2)
STUDY["engine_args"] = {k: v for k, v in STUDY["engine_args"].items() if k != "kv_cache_memory_bytes"}


def sweep(*args, timeout=1500):
    return subprocess.run([sys.executable, "-m", "vllm_study", "sweep", *map(str, args)], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)


def write(tmp_path: Path, study: dict) -> Path:
    f = tmp_path / "study.yaml"
    f.write_text(yaml.safe_dump(study, sort_keys=False))
    return f


def test_bad_params_fail_fast_with_a_fix(tmp_path):
    bad = write(tmp_path, {**STUDY, "workload": {**STUDY["workload"], "concurency": 4},
                           "engine_args": {**STUDY["engine_args"], "gpu_memory_utilization": 1.5}})
    r = sweep(bad, "--results", tmp_path / "results")
    assert r.returncode == 2
    assert "workload.concurency: unknown key (did you mean 'concurrency'?)" in r.stderr
    assert "gpu_memory_utilization" in r.stderr
    assert not (tmp_path / "results").exists()  # nothing was started or written


def test_a_missing_model_folder_is_refused_before_anything_starts(tmp_path):
    study = write(tmp_path, {**STUDY, "model": {"path": "/models/no-such-model", "served_name": "x"}})
    t0 = time.monotonic()
    r = sweep(study, "--results", tmp_path / "results")
    assert r.returncode == 2 and time.monotonic() - t0 < 60
    assert "model.path /models/no-such-model is not a folder on this machine" in r.stderr
    assert "Traceback" not in r.stderr and not (tmp_path / "results").exists()
    doc = subprocess.run([sys.executable, "-m", "vllm_study", "doctor", str(study)], cwd=REPO,
                         capture_output=True, text=True, timeout=300)
    assert doc.returncode == 1 and "[FAIL] model: model.path /models/no-such-model" in doc.stdout


@pytest.mark.e2e
def test_budget_resume_failure_and_report(tmp_path):
    results = tmp_path / "results"
    first = sweep(write(tmp_path, STUDY), "--results", results, "--max-minutes", "0.01")
    assert first.returncode == 0, first.stderr[-3000:]
    (path,) = results.iterdir()
    run = RunFolder(path)
    order = run.manifest().order
    assert "stopped after" in first.stdout and "1 of 2 starts left" in first.stdout
    assert f"{sys.executable} -m vllm_study sweep --resume {path}" in first.stdout  # the interpreter that ran
    assert "1/4" in first.stderr  # the progress bar (2 starts x 2 rounds) moves per round, not per start
    assert run.point(order[0].point).start(1).status in ("ok", "failed")
    assert run.point(order[1].point).start(1) is None

    second = sweep("--resume", path)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "1 of 2 starts already finished" in second.stdout

    summaries = {s.point: s for s in run.summaries()}
    (ok_id,) = [p for p, s in summaries.items() if s.status == "ok"]
    (bad_id,) = [p for p, s in summaries.items() if s.status == "failed"]
    assert summaries[ok_id].rounds_ok == 2
    assert "max_model_len too large for the KV cache" in summaries[bad_id].reasons[0]
    assert (run.point(bad_id).start_dir(1) / "point.ipynb").exists()  # kept on failure too

    df = pd.read_csv(run.summary_csv)
    rounds = df[(df["point"] == ok_id) & (df["group"] == "all")]
    assert sorted(rounds["round"]) == [0, 1]
    for metric in ("ttft_p90_ms", "itl_p90_ms", "tpot_p50_ms", "output_throughput", "prefix_cache_hit_rate"):
        assert summaries[ok_id].estimates[metric].median == pytest.approx(rounds[metric].median()), metric
    # vLLM's own TTFT starts when the request reaches the server and ends before the
    # token reaches the client: below the client's, in every round
    assert (0 < rounds["server_ttft_mean_ms"]).all()
    assert (rounds["server_ttft_mean_ms"] < rounds["ttft_mean_ms"]).all()

    assert (path / "report.ipynb").exists() and (path / "report.html").stat().st_size > 50_000
    for fig in ("heatmaps.png", "trends.png", "ttft_p90_by_round.png"):
        assert (path / "figures" / fig).stat().st_size > 10_000, fig
    manifest = run.manifest()
    assert manifest.versions.vllm and manifest.git.sha and manifest.cpu_dtype["dtype"] in ("float32", "bfloat16")
    assert manifest.machine.cpu.capability  # the CPU features that decide vLLM's CPU speed
    (resumed,) = manifest.resumes  # which code ran the second slice
    assert resumed.units_left == [f"{order[1].point}#s1"] and resumed.git.sha == manifest.git.sha
    assert resumed.machine.host == manifest.machine.host
    for s in run.point(ok_id).starts():  # nothing left running
        assert group_gone(s.launch.server_pgid)


@pytest.mark.e2e
def test_a_study_where_every_point_fails_is_reported_not_crashed(tmp_path):
    """No point's server becomes healthy in time (a 2-second start-up limit): the sweep
    still renders a report that shows the failures and says why nothing could be drawn,
    and exits 1 without a traceback."""
    study = write(tmp_path, {**tiny(grid={"max_num_batched_tokens": [128, 256]}, rounds=1),
                             "server": {"startup_timeout_s": 2}})
    r = sweep(study, "--results", tmp_path / "results")
    assert r.returncode == 1, r.stdout[-2000:] + r.stderr[-2000:]
    assert "Traceback" not in r.stderr and "the study failed: no point measured a round" in r.stdout
    (path,) = (tmp_path / "results").iterdir()
    run = RunFolder(path)
    assert [s.status for s in run.summaries()] == ["failed", "failed"]
    assert all("not healthy within 2 s" in s.reasons[0] for s in run.summaries())
    html = (path / "report.html").read_text()
    assert "not healthy within 2 s" in html and "nothing to draw" in html


@pytest.mark.e2e
def test_sigterm_stops_everything_and_resume_completes(tmp_path):
    """SIGTERM while the server starts: the sweep exits 130, every process it started
    (papermill kernel, vLLM and its engine) is gone, the unfinished start is left as
    such, and --resume runs it. (Finished starts surviving a stop: the budget test.)"""
    import psutil

    study = tiny(rounds=1)
    results = tmp_path / "results"
    proc = subprocess.Popen([sys.executable, "-m", "vllm_study", "sweep", str(write(tmp_path, study)),
                             "--results", str(results)], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 900
        start_dir = None
        while time.monotonic() < deadline and start_dir is None:
            pgids = list(results.glob("*/points/*/s1/server.pgid")) if results.exists() else []
            if pgids:
                start_dir = pgids[0].parent
            assert proc.poll() is None, proc.stdout.read()
            time.sleep(0.5)
        assert start_dir is not None, "the server start never began"
        time.sleep(3)  # well into vLLM's own start-up
        started = psutil.Process(proc.pid).children(recursive=True)
        assert any("vllm" in " ".join(p.cmdline()) for p in started)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, out[-2000:]
    assert "interrupted: finished rounds are kept" in out
    assert f"{sys.executable} -m vllm_study sweep --resume" in out
    _, alive = psutil.wait_procs(started, timeout=30)
    assert not alive, [p.cmdline() for p in alive]
    assert StartRecord.load(start_dir / "start.json").status == "running"

    run = RunFolder(start_dir.parents[2])
    again = sweep("--resume", run.path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "0 of 1 starts already finished" in again.stdout
    assert StartRecord.load(start_dir / "start.json").status == "ok"


@pytest.mark.e2e
def test_a_model_with_a_mistral_template_runs_end_to_end(tmp_path):
    """A model folder with a SentencePiece-style tokenizer and Mistral's [INST] template
    (no system role: the system prompt goes in front of the first user turn), dummy
    weights, served with the Prefix Reuse Budget scheduler: the study runs, the server
    counts exactly the prompt tokens the kit sent, the prefix cache reuses the shared
    prompt, and the plugin's counters are recorded per round."""
    import offline_tokenizers as ot
    folder = ot.model_folder(ot.mistral_style(), tmp_path / "mistral-style")
    study = tiny(model={"path": str(folder), "dummy_weights": True, "served_name": "tiny"}, rounds=1,
                 scheduler={"min_reuse_ratio": 0.5, "max_defer_ms": 200})
    r = sweep(write(tmp_path, study), "--results", tmp_path / "results")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    (path,) = (tmp_path / "results").iterdir()
    run = RunFolder(path)
    (s,) = run.summaries()
    assert s.status == "ok", s.reasons
    (rnd,) = run.point(s.point).rounds()
    assert rnd.metrics["server_prompt_tokens"] == rnd.metrics["prompt_tokens"]  # the server's own count
    assert rnd.metrics["prefix_cache_hit_rate"] > 0.5
    assert rnd.metrics["prefix_cache_hit_rate"] <= rnd.metrics["expected_prefix_hit_rate"] + 0.01
    (start,) = run.point(s.point).starts()
    assert "vllm_study.prefix_budget.PrefixBudgetScheduler" in start.launch.command
    assert rnd.metrics["pb_deferred"] >= 0 and rnd.metrics["pb_admitted_by_age"] >= 0  # the plugin's counters


@pytest.mark.e2e
def test_an_exported_config_serves_and_is_measured_as_a_plain_endpoint(tmp_path):
    """A point exported as a `vllm serve --config` file starts the CPU engine as it is;
    that server, run by hand without dev mode, is then measured as a target with a random
    workload on /v1/completions: /metrics is scraped, the missing cache reset is said
    plainly, and the report renders."""
    from synthetic_run import make_run
    from vllm_study.export import export
    point = "mbt=256__kv=16MiB"
    synthetic = make_run(tmp_path / "synthetic", {point: {"output_throughput": 100.0, "ttft_p90_ms": 50.0}})
    cfg, _ = export(synthetic.path, point, tmp_path / "export")
    model, _ = models.resolve(ModelSpec(card="tiny-qwen2"))
    port = free_port()
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--config", str(cfg), "--model", model,
           "--load-format", "dummy", "--host", "127.0.0.1", "--port", str(port), "--enforce-eager"]
    with VllmServer(cmd, port, tmp_path / "server.log", env={"VLLM_SERVER_DEV_MODE": "0"}, startup_timeout_s=600):
        study = {"name": "plain", "model": {"card": "tiny-qwen2"}, "rounds": 2,
                 "targets": [{"name": "direct", "base_url": f"http://127.0.0.1:{port}/v1", "model": "tiny"}],
                 "workload": {"kind": "random", "api": "completions", "input_tokens": 256, "output_tokens": 8,
                              "requests_per_round": 8, "concurrency": 4, "warmup_requests": 1}}
        r = subprocess.run([sys.executable, "-m", "vllm_study", "sweep", str(write(tmp_path, study)), "--results",
                            str(tmp_path / "results")], cwd=REPO, capture_output=True, text=True, timeout=900,
                           env=no_proxy_env())
    log = (tmp_path / "server.log").read_text()
    assert "'max_num_batched_tokens': 256" in log and "'kv_cache_memory_bytes': 16777216" in log  # from the config
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    (path,) = (tmp_path / "results").iterdir()
    (s,) = RunFolder(path).summaries()
    assert s.status == "ok", s.reasons
    assert s.launch.has_metrics and not s.launch.cache_reset
    assert any("NOT reset between rounds" in w for w in s.warnings)
    assert s.estimates["engine_steps"].median > 0  # server counters collected
    assert "direct" in (path / "report.html").read_text()
