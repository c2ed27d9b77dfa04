"""The sweep command end to end: real papermill, servers of the fake engine (the sweep's
control flow: no figure of vLLM's is asserted here): a time budget that stops between
server starts, --resume that finishes the run with a failed point recorded as data and
the report; every point failing; SIGTERM that leaves nothing running. What vLLM itself
answers is asserted on vLLM elsewhere: its refusal of a KV cache too small for one request,
the step records and its own TTFT (test_e2e_failures.py); whole sweeps on vLLM
(test_e2e_models_and_export.py, test_e2e_predict_confirm.py)."""
from __future__ import annotations

import signal
import subprocess
import sys
import time

import pandas as pd
import pytest

from drawn import assert_drawn
from e2e_support import FAKE_ENGINE, REPO, UNI, fake_engine_study, kv_bytes, sweep, tiny, write
from procs import group_gone
from vllm_study.launch.slots import SLOT_LOCKS
from vllm_study.records.results import RunFolder, StartRecord

# the second point's 512-token KV cache cannot hold one 2,048-token request: it must fail
STUDY = tiny(grid={"max_num_batched_tokens": [256], "kv_cache_memory_bytes": [kv_bytes(16384), kv_bytes(512)]},
             rounds=2)
STUDY["engine_args"] = {k: v for k, v in STUDY["engine_args"].items() if k != "kv_cache_memory_bytes"}


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
@pytest.mark.fake_engine
def test_budget_resume_failure_and_report(tmp_path):
    results = tmp_path / "results"
    # the first slice skips the report; the resume renders it (checked below)
    first = sweep(write(tmp_path, fake_engine_study(STUDY)), "--results", results, "--max-minutes", "0.01",
                  "--no-report")
    assert first.returncode == 0, first.stderr[-3000:]
    (path,) = results.iterdir()
    run = RunFolder(path)
    order = run.manifest().order
    assert "stopped after" in first.stdout and "1 of 2 starts left" in first.stdout
    assert f"{sys.executable} -m vllm_study sweep --resume {path}" in first.stdout  # the interpreter that ran
    assert "/4 [" in first.stderr  # the progress bar counts 2 starts x 2 rounds (per round: a unit test)
    assert run.point(order[0].point).start(1).status in ("ok", "failed")
    assert run.point(order[1].point).start(1) is None

    second = sweep("--resume", path)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "1 of 2 starts already finished" in second.stdout
    # the start left, at the longest start the run recorded (its point never started)
    assert f"starts left, at their points' longest so far: {order[1].point}#s1 " in second.stdout
    # the report's kernel says nothing of its own on a run that went well
    assert "IPKernelApp" not in second.stderr + second.stdout, second.stderr[-2000:]

    summaries = {s.point: s for s in run.summaries()}
    (ok_id,) = [p for p, s in summaries.items() if s.status == "ok"]
    (bad_id,) = [p for p, s in summaries.items() if s.status == "failed"]
    assert summaries[ok_id].rounds_ok == 2
    assert "max_model_len too large for the KV cache" in summaries[bad_id].reasons[0]  # in vLLM's words
    assert (run.point(bad_id).start_dir(1) / "point.ipynb").exists()  # kept on failure too

    df = pd.read_csv(run.summary_csv)
    rounds = df[(df["point"] == ok_id) & (df["group"] == "all")]
    assert sorted(rounds["round"]) == [0, 1]
    for metric in ("ttft_p90_ms", "itl_p90_ms", "tpot_p50_ms", "output_throughput", "prefix_cache_hit_rate"):
        assert summaries[ok_id].estimates[metric].median == pytest.approx(rounds[metric].median()), metric
    # the server's own TTFT histogram, read per round through its counters (vLLM's against
    # the client's: test_e2e_failures.py)
    assert (0 < rounds["server_ttft_mean_ms"]).all()
    assert (rounds["server_ttft_mean_ms"] < rounds["ttft_mean_ms"]).all()

    assert (path / "report.ipynb").exists() and (path / "report.html").stat().st_size > 50_000
    for fig in ("heatmaps.png", "trends.png", "ttft_p90_by_round.png"):
        assert_drawn(path / "figures" / fig)
    manifest = run.manifest()
    assert manifest.versions.vllm and manifest.git.sha and manifest.cpu_dtype["dtype"] in ("float32", "bfloat16")
    assert manifest.machine.cpu.capability  # the CPU features that decide vLLM's CPU speed
    (resumed,) = manifest.resumes  # which code ran the second slice
    assert resumed.units_left == [f"{order[1].point}#s1"] and resumed.git.sha == manifest.git.sha
    assert resumed.machine.host == manifest.machine.host
    for s in run.point(ok_id).starts():  # nothing left running
        assert group_gone(s.launch.server_pgid)


@pytest.mark.e2e
@pytest.mark.fake_engine
def test_a_study_where_every_point_fails_is_reported_not_crashed(tmp_path):
    """No point's server becomes healthy in time (a 2-second start-up limit; the fake
    engine takes 3 s from its engine's init to healthy): the sweep still renders a report
    that shows the failures and says why nothing could be drawn, and exits 1 without a
    traceback; its header says no figure is vLLM's."""
    study = write(tmp_path, fake_engine_study({**tiny(grid={"max_num_batched_tokens": [128, 256]}, rounds=1),
                                               "server": {"startup_timeout_s": 2, "live_knobs": False}},
                                              FAKE_ENGINE_INIT_S="3"))  # a start each
    r = sweep(study, "--results", tmp_path / "results")
    assert r.returncode == 1, r.stdout[-2000:] + r.stderr[-2000:]
    assert "Traceback" not in r.stderr and "the study failed: no point measured a round" in r.stdout
    assert "2 of 2 starts FAILED" in r.stderr  # the bar ends at 2/2 rounds, but says what that hides
    (path,) = (tmp_path / "results").iterdir()
    run = RunFolder(path)
    assert [s.status for s in run.summaries()] == ["failed", "failed"]
    assert all("not healthy within 2 s" in s.reasons[0] for s in run.summaries())
    html = (path / "report.html").read_text()
    assert "not healthy within 2 s" in html and "nothing to draw" in html
    # served by the fake engine: each start's record and the report's header say so
    for p in run.point_ids():
        assert run.point(p).start(1).launch.program == [sys.executable, str(FAKE_ENGINE)]
    assert "NOT vLLM: every start ran" in html


@pytest.mark.e2e
@pytest.mark.fake_engine
def test_sigterm_stops_everything_and_resume_completes(tmp_path):
    """SIGTERM while the first server starts and the second start's notebook, already
    prepared, waits for the slot: the sweep exits 130, every process it started (both
    kernels and the server) is gone, the unfinished starts are left as such, and --resume
    runs them, the second server spawned only once the first had stopped. The fake engine
    stays in its engine's init until a file exists: the stop lands while it starts, as a
    vLLM start's would; the file is made before --resume, whose starts then take 5 s each
    from init to healthy (the second notebook waits at the slot meanwhile).
    (Finished starts surviving a stop: the budget test.)"""
    import psutil

    gate = tmp_path / "engine-may-finish-init"
    study = fake_engine_study(tiny(rounds=1, grid={"max_num_batched_tokens": [256, 512]},
                                   server={"extra_cli_args": UNI, "live_knobs": False}),  # two starts, one slot
                              FAKE_ENGINE_INIT_S="5", FAKE_ENGINE_INIT_UNTIL=str(gate))
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
        points = start_dir.parents[1]
        while time.monotonic() < deadline and len(list(points.glob("*/s1/start.json"))) < 2:
            time.sleep(0.5)  # the next start's notebook is prepared during this server's start-up
        time.sleep(3)
        started = psutil.Process(proc.pid).children(recursive=True)
        assert any(str(FAKE_ENGINE) in p.cmdline() for p in started)  # the server is among them
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
    assert [StartRecord.load(f).status for f in points.glob("*/s1/start.json")] == ["running"] * 2

    run = RunFolder(start_dir.parents[2])
    gate.touch()
    again = sweep("--resume", run.path, "--no-report")  # the budget test checks the report
    assert again.returncode == 0, again.stderr[-3000:]
    assert "0 of 2 starts already finished" in again.stdout
    first, second = sorted((StartRecord.load(f) for f in points.glob("*/s1/start.json")),
                           key=lambda r: r.timeline["spawn"])
    assert first.status == second.status == "ok"
    # the second notebook was ready and waited at the slot's lock; its server started
    # only after the first one's had stopped, so no two servers overlapped
    assert second.launch.slot_wait_s > 1 and second.timeline["spawn"] >= first.timeline["stopped"]
    assert run.manifest().overlaps == [] and not list(run.path.glob(SLOT_LOCKS))
