"""End to end with servers of their own on loopback: a start's record, its step records
and a server killed mid-round, a KV cache too small for one request refused at start,
and the prefix cache evicting under a small KV cache against what a never-evicting cache
would hit (real vLLM CPU builds: what vLLM records, refuses and caches); a server killed
before its warm-up and a port another process holds (the fake engine: the kit's own
handling of a dead or unbound server). (A failed point within a sweep, resumed and
reported: test_e2e_sweep, on the fake engine.)"""
from __future__ import annotations

import os
import signal
import socket
import threading
import time

import pytest

from e2e_support import fake_engine_study, kv_bytes, measure, plan_of, serve_on_a_free_port, tiny
from procs import group_gone
from test_e2e_server import _target_study
from vllm_study.measure import counters
from vllm_study.define import models
from vllm_study.measure.point import PointStart
from vllm_study.launch.server import serve_command
from vllm_study.scheduler_plugin import steps

pytestmark = pytest.mark.e2e

PROMPT_TOKENS = "vllm:prompt_tokens_total"


def _kill_when_busy(url: str, pgid: int, sending: threading.Event, killed: threading.Event,
                    ended: threading.Event) -> None:
    """SIGKILL the server's group once the next round's requests have reached it: the kit
    has built the round's requests (`sending`: after its cache reset and first scrape, just
    before it sends) and vLLM's prompt tokens counter has moved since. Server-side signals
    alone raced on a loaded machine (a fixed delay outlasted a whole round; the running
    gauge, and the counter read after the previous round settled, still moved between
    rounds), killing the server before the round began. `ended`: the round returned."""
    while not sending.wait(0.05):
        if ended.is_set():
            return
    seen = counters.scrape(url)["values"].get(PROMPT_TOKENS, 0)
    while not ended.is_set():
        if counters.scrape(url)["values"].get(PROMPT_TOKENS, 0) > seen:
            os.killpg(pgid, signal.SIGKILL)
            killed.set()
            return
        time.sleep(0.01)


def test_a_point_start_is_recorded_and_a_killed_server_keeps_its_rounds(tmp_path):
    """One server start through the kit's steps: round 0 completes and is recorded, with
    vLLM's step records and its own TTFT; the server is then SIGKILLed during round 1: that
    round is recorded as failed, round 0 stays, the start fails with the signal as its
    reason, and nothing runs on; also when the round ends before the server's exit shows."""
    plan = plan_of(tiny(rounds=3, workload={**tiny()["workload"], "requests_per_round": 16, "output_tokens": 32}))
    run = PointStart(plan, tmp_path / "s1", 1)
    run.launch()
    assert not run.failed, run.record.reason
    rounds, server = run.protocol, run.launcher.server  # the start's parts: its rounds, its server
    launch = run.record.launch
    assert launch.startup_s > 0 and launch.cache_config["kv_cache_memory_bytes"] == str(kv_bytes(16384))
    assert launch.vllm_non_default_args["max_num_batched_tokens"] == 256
    assert run.record.gpus == [] and "no NVIDIA GPU" in run.record.no_gpu_reason  # said plainly on a CPU
    run.warmup()
    rounds.run_round(0)
    _check_step_records(tmp_path / "s1", run, run.rounds[0])
    m = run.rounds[0].metrics
    # vLLM's own TTFT starts when the request reaches the server and ends before the
    # token reaches the client: below the client's
    assert 0 < m["server_ttft_mean_ms"] < m["ttft_mean_ms"], m
    pgid = server.proc.pid
    killed, sending, ended = threading.Event(), threading.Event(), threading.Event()
    prepare = rounds._prepare_round

    def prepared(*a, **k):  # the round's requests built: what the round does next is send them
        out = prepare(*a, **k)
        sending.set()
        return out
    rounds._prepare_round = prepared
    # as in the moment between a killed server's sockets closing and its exit showing: the
    # round ends on its errors with the server not yet seen gone, and the scrape after it fails
    exited = server.exited
    server.exited = lambda wait_s=0: wait_s > 0 and exited(wait_s)
    killer = threading.Thread(target=_kill_when_busy, args=(server.url, pgid, sending, killed, ended))
    killer.start()
    rounds.run_round(1)
    ended.set()
    killer.join()
    assert killed.is_set(), "round 1 ended before the server was seen running requests"
    rounds.run_round(2)  # a no-op once the start has failed
    summary = run.finish()
    assert [r.status for r in run.rounds] == ["ok", "failed"], run.record.reason
    assert run.rounds[1].metrics["failed"] > 0
    assert run.record.status == "failed" and run.record.reason.startswith("server died during round 2 of 3: ")
    assert "killed by SIGKILL" in run.record.reason and "\x1b[" not in run.record.reason
    assert summary.status == "partial" and summary.rounds_ok == 1
    assert summary.estimates["ttft_p90_ms"].median == run.rounds[0].metrics["ttft_p90_ms"]
    assert len((tmp_path / "s1" / "rounds.jsonl").read_text().splitlines()) == 2  # both rounds on disk
    assert (tmp_path / "s1" / "server.log.gz").exists() and not (tmp_path / "s1" / "server.log").exists()
    assert not (tmp_path / "s1" / "steps.raw").exists()  # the raw step records went with the server
    assert group_gone(pgid)


def _check_step_records(start_dir, run: PointStart, rec) -> None:
    """The engine's step records of round `rec`, as the kit's scheduler plugin wrote them
    inside vLLM and the round cut them: every prompt token computed once less what the
    cache held, one decode step per output token past the first (each prefill's last step
    samples the first), every step inside the round's sending."""
    launch = run.record.launch
    assert "VLLM_STUDY_STEPS" in launch.kit_env and "--scheduler-cls" in launch.command
    rows = steps.load_round(steps.round_path(start_dir, rec.round))
    m = rec.metrics
    assert m["completed"] == m["requests"] and rows["preempted"].sum() == 0
    assert rows["prefill_tokens"].sum() + rows["cached_tokens"].sum() == m["prompt_tokens"]
    assert rows["decode_tokens"].sum() == m["output_tokens"] - m["completed"]
    assert rows["cached_tokens"].sum() > 0  # the shared system prompt, from the second request on
    assert (rows["t_done"] > rows["t_scheduled"]).all() and (steps.cycles(rows) > 0).all()
    assert rows["t_scheduled"][-1] - rows["t_scheduled"][0] <= m["duration_s"]


def test_a_kv_cache_too_small_for_one_request_is_vllms_refusal_and_the_reason(tmp_path):
    """A KV cache of 512 tokens for a max_model_len of 2,048: vLLM refuses to start, and
    the start fails with the reason read from vLLM's own words (pinned in
    test_unit_server.py; the fake engine prints them for the sweep's and the search's
    failed points), its server gone."""
    study = tiny()
    study["engine_args"] = {**study["engine_args"], "kv_cache_memory_bytes": kv_bytes(512)}
    run = PointStart(plan_of(study), tmp_path / "s1", 1)
    run.launch()
    assert run.failed and "max_model_len too large for the KV cache" in run.record.reason, run.record.reason
    assert group_gone(run.launcher.server.proc.pid)


@pytest.mark.fake_engine
def test_a_server_that_dies_before_its_warm_up_fails_the_start_with_its_own_reason(tmp_path):
    """SIGKILLed once up (as vLLM dies of CUDA out of memory on its first long prompts):
    the warm-up's requests find nothing listening; the start fails with what ended the
    server, not with a connection error, and no round runs."""
    plan = plan_of(fake_engine_study(tiny(rounds=2)))
    run = PointStart(plan, tmp_path / "s1", 1)
    run.launch()
    assert not run.failed, run.record.reason
    rounds, server = run.protocol, run.launcher.server
    pgid = server.proc.pid
    os.killpg(pgid, signal.SIGKILL)
    run.warmup()
    assert run.record.warmup_errors == plan.study.workload.warmup_requests > 0
    assert run.record.reason.startswith("server died during warm-up: ") and "killed by SIGKILL" in run.record.reason
    rounds.run_round(0)  # a no-op once the start has failed
    summary = run.finish()
    assert run.rounds == [] and summary.status == "failed" and "died during warm-up" in summary.reasons[0]
    assert group_gone(pgid)


@pytest.mark.fake_engine
def test_a_port_held_by_another_process_is_the_reason(tmp_path, monkeypatch):
    """Another process holds the port the kit picked (a race the kit cannot rule out):
    the server cannot bind it and the start records 'port in use' (from uvicorn's words,
    which the fake engine prints as vLLM's server does)."""
    from vllm_study.launch import deployment
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    try:
        monkeypatch.setattr(deployment, "free_port", lambda: holder.getsockname()[1])
        run = PointStart(plan_of(fake_engine_study(tiny())), tmp_path / "s1", 1)
        run.launch()
    finally:
        holder.close()
    assert run.failed and "port in use" in run.record.reason, run.record.reason
    assert group_gone(run.launcher.server.proc.pid)


def test_prefix_reuse_expected_vs_measured_shows_eviction(tmp_path):
    """A KV cache of 4,096 tokens and 1,024-token prefixes sent one after another: with 2
    prefixes both stay cached and the measured hit rate meets the expected one; with 6,
    each is evicted before its turn comes again and the measured rate falls far below
    what a never-evicting cache would reach. The chunk (200 tokens) is not a multiple of
    the 128-token block: prefill chunks end inside blocks, and the hit rate still meets
    what full-block reuse predicts (vLLM caches a block once a later chunk completes it)."""
    plan = plan_of(tiny(engine_args={**tiny()["engine_args"], "kv_cache_memory_bytes": kv_bytes(4096)},
                        grid={"max_num_batched_tokens": [200]}))
    assert any("fall inside a block" in w for w in plan_of(tiny(
        grid={"max_num_batched_tokens": [200]}, workload={**tiny()["workload"], "system_prompt_tokens": 1024})
    ).point.warnings)
    model, dummy = models.resolve(plan.study.model)
    # vLLM's CPU default here: a worker process of its own (no UNI)
    srv = serve_on_a_free_port(lambda port: serve_command(model, port, plan.point.engine_args.cli(), "tiny",
                                                          load_dummy=dummy),
                               tmp_path / "server.log", startup_timeout_s=600)
    assert srv.uni_env == {}
    rates = {}
    try:
        for prefixes in (2, 6):
            study = _target_study(srv.url, {"system_prompt_tokens": 1024, "question_tokens": 16, "output_tokens": 8,
                                            "prefixes": prefixes, "concurrency": 1, "requests_per_round": 24})
            run, summary = measure(plan_of(study), tmp_path / f"p{prefixes}" / "s1")
            assert summary.status == "ok", summary.reasons
            rates[prefixes] = (run.record.expected_prefix_hit_rate, run.rounds[0].metrics["prefix_cache_hit_rate"])
    finally:
        srv.stop()
    (exp2, got2), (exp6, got6) = rates[2], rates[6]
    assert got2 == pytest.approx(exp2, abs=0.02)
    assert exp6 > 0.6 and got6 < exp6 / 2, rates
