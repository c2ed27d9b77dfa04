"""The fake engine (tests/fake_engine.py) against the kit's own parts: started by the
kit's VllmServer, measured by its client, its /metrics read by its counters parser, its
live limits set through the kit's control channel. Each server is stopped by its
process group."""
from __future__ import annotations

import os
import signal
import statistics
import sys
import time
from pathlib import Path

import pytest

from e2e_support import serve_on_a_free_port
from procs import group_gone
from vllm_study.define import models
from vllm_study.launch.server import ServerStartError
from vllm_study.measure import client, counters, live_knobs
from vllm_study.scheduler_plugin import Refused
from vllm_study.workload.workload import Request
from paths import FAKE_ENGINE

FAKE = FAKE_ENGINE
BLOCK = 16


@pytest.fixture(scope="module")
def model_dir() -> str:
    return str(models.build_model_dir("tiny-qwen2", models.cache_dir() / "tiny-qwen2"))


def fake_command(model: str, *flags: str):
    return lambda port: [sys.executable, str(FAKE), "--model", model, "--host", "127.0.0.1", "--port", str(port),
                         "--served-model-name", "tiny", "--load-format", "dummy", "--dtype", "bfloat16",
                         "--enforce-eager", "--block-size", str(BLOCK), *flags]


def start(tmp: Path, model: str, *flags: str, env: dict | None = None):
    return serve_on_a_free_port(fake_command(model, *flags), tmp / "server.log", env=env, startup_timeout_s=30)


@pytest.fixture(scope="module")
def fake(model_dir, tmp_path_factory):
    """max_num_seqs 4, a 256-token budget, 4096 tokens of KV cache."""
    srv = start(tmp_path_factory.mktemp("fake"), model_dir, "--max-num-seqs", "4", "--max-num-batched-tokens",
                "256", "--num-gpu-blocks-override", str(4096 // BLOCK), "--max-model-len", "2048")
    yield srv
    srv.stop()


def text_requests(n: int, prompt: str, max_tokens: int) -> list[Request]:
    return [Request(i, None, prompt, 0, max_tokens) for i in range(n)]


def run(srv, requests, concurrency: int) -> list[client.RequestResult]:
    return client.run_sync(client.run_closed_loop(srv.url, "tiny", "completions", requests, concurrency))


def test_it_starts_in_about_a_second_and_logs_what_the_launcher_reads(fake):
    assert fake.startup_s < 5, fake.startup_s  # ~1 s alone; 2 shared cores under a test run
    log = fake.log_path.read_text()
    for line in ("non-default args: {", "Initializing a V1 LLM engine", "KV cache size: 4,096 tokens",
                 "Starting vLLM server on"):
        assert line in log
    from vllm_study.measure.launcher import _non_default_args
    args = _non_default_args(log)
    assert args["max_num_seqs"] == 4 and args["load_format"] == "dummy" and args["enforce_eager"] is True
    info = counters.cache_config(counters.scrape(fake.url))
    assert info["num_gpu_blocks"] == str(4096 // BLOCK) and info["block_size"] == str(BLOCK)
    client.check_endpoint(fake.url, "tiny")
    with pytest.raises(client.EndpointError, match="not served"):
        client.check_endpoint(fake.url, "other")


def test_the_kits_client_gets_streamed_tokens_and_the_kits_own_prompt_length(fake, model_dir):
    import copy

    from transformers import AutoTokenizer
    from vllm_study.workload.workload import SharedPrefixWorkload
    chat = SharedPrefixWorkload(AutoTokenizer.from_pretrained(model_dir), api="chat", system_prompt_tokens=200,
                                question_tokens=12, output_tokens=7, prefixes=1, seed=0)
    completions = copy.copy(chat)  # the same prompts as one text: its word pieces take seconds to find
    completions.api = "completions"
    for api, wl in (("chat", chat), ("completions", completions)):
        requests = wl.requests(3)
        results = client.run_sync(client.run_closed_loop(fake.url, "tiny", api, requests, 2))
        for req, res in zip(requests, results):
            assert res.ok, res.error_detail
            assert res.prompt_tokens == req.prompt_tokens  # counted as the kit counts it
            assert res.output_tokens == 7 and len(res.itl_s) == 6 and res.ttft_s > 0
        assert (requests[0].messages is None) == (api == "completions")


def test_prefix_cache_hits_and_reset_as_vllm_counts_them(fake):
    prompt = "tell me a story about a cat and a dog " * 20
    counters.reset_prefix_cache(fake.url)
    before = counters.scrape(fake.url)
    assert run(fake, text_requests(1, prompt, 2), 1)[0].ok
    first = counters.scrape(fake.url)
    res = run(fake, text_requests(1, prompt, 2), 1)[0]
    second = counters.round_deltas(first, counters.scrape(fake.url))
    assert counters.round_deltas(before, first)["prefix_cache_hits"] == 0
    assert second["prefix_cache_queries"] == res.prompt_tokens
    # every full block but the one holding the last prompt token
    assert second["prefix_cache_hits"] == (res.prompt_tokens - 1) // BLOCK * BLOCK > 0
    counters.reset_prefix_cache(fake.url)
    after_reset = counters.scrape(fake.url)
    assert after_reset["values"]["vllm:prefix_cache_hits_total"] == \
        second["prefix_cache_hits"] + first["values"]["vllm:prefix_cache_hits_total"]  # counters stay
    run(fake, text_requests(1, prompt, 2), 1)
    assert counters.round_deltas(after_reset, counters.scrape(fake.url))["prefix_cache_hits"] == 0  # cache cold


def test_a_closed_load_above_max_num_seqs_queues(fake):
    prompt = "a b c d e f g h " * 8
    ttft, peaks = {}, {}
    for c in (4, 16):
        sampler = counters.RoundSampler(fake.url, _NoGpu(), period_s=0.05)
        with sampler:
            res = run(fake, text_requests(2 * c, prompt, 16), c)
        assert all(r.ok for r in res)
        ttft[c] = statistics.median(r.ttft_s for r in res)
        peaks[c] = sampler.result()
    assert peaks[4]["running_peak"] <= 4 and peaks[16]["running_peak"] == 4  # max_num_seqs holds
    assert peaks[16]["waiting_peak"] > 0
    assert ttft[16] > 3 * ttft[4], ttft  # past the knee, the queue adds whole requests' time


def test_a_kv_pool_too_small_preempts(model_dir, tmp_path):
    # 8 blocks of 16 tokens; each request needs 4 blocks by its end: four at once cannot all fit
    srv = start(tmp_path, model_dir, "--num-gpu-blocks-override", "8", "--max-model-len", "64",
                "--max-num-seqs", "4", "--max-num-batched-tokens", "256")
    try:
        before = counters.scrape(srv.url)
        res = run(srv, text_requests(8, "x y z " * 6, 40), 4)
        assert all(r.ok and r.output_tokens == 40 for r in res)
        assert counters.round_deltas(before, counters.scrape(srv.url))["preemptions"] > 0
    finally:
        srv.stop()


def test_a_start_vllm_would_refuse_fails_with_the_reason_the_kit_reads(model_dir, tmp_path):
    with pytest.raises(ServerStartError, match="max_num_seqs above max_num_batched_tokens"):
        start(tmp_path, model_dir, "--max-num-seqs", "64", "--max-num-batched-tokens", "32")
    with pytest.raises(ServerStartError, match="max_model_len too large for the KV cache"):
        start(tmp_path, model_dir, "--num-gpu-blocks-override", "4", "--max-model-len", "2048")


def test_live_limits_round_trip_through_the_kits_plugin(model_dir, tmp_path):
    control, stats = tmp_path / "control.json", tmp_path / "stats.json"
    srv = start(tmp_path, model_dir, "--max-num-seqs", "8", "--max-num-batched-tokens", "512",
                "--scheduler-cls", live_knobs.SCHEDULER_CLS, env=live_knobs.launch_env(control, stats))
    try:
        assert live_knobs.knobs_state(stats)["launch"]["max_num_seqs"] == 8
        limits = live_knobs.set_limits(srv.url, stats, control, max_num_batched_tokens=64, max_num_seqs=2)
        assert limits["max_num_seqs"] == 2 and limits["max_num_batched_tokens"] == 64
        res = run(srv, text_requests(6, "hello there " * 40, 8), 6)
        assert all(r.ok for r in res)
        used = live_knobs.limits_used(stats, limits["seq"])
        assert used["peak_running"] == 2 and used["peak_step_tokens"] == 64  # the prompts (~80) were chunked
        with pytest.raises(Refused, match="above its launch value"):
            live_knobs.send_message(srv.url, stats, control, {"max_num_seqs": 9})
        back = live_knobs.set_limits(srv.url, stats, control)  # the launch values again
        assert back["max_num_seqs"] == 8 and back["seq"] > limits["seq"]
    finally:
        srv.stop()


def test_a_start_ahead_is_frozen_at_the_engine_init_line_until_its_slot_is_free(model_dir, tmp_path):
    seen = {}

    def hold():  # the slot's previous server still measures: this one is frozen, not serving
        time.sleep(1)
        seen["healthy while held"] = _healthy(srv_url[0])

    srv_url = []
    srv = serve_on_a_free_port(fake_command(model_dir), tmp_path / "server.log", hold=hold,
                               made=lambda s: srv_url.append(s.url), startup_timeout_s=30)
    try:
        assert not srv.hold_missed and srv.held_s >= 1 and seen == {"healthy while held": False}
        assert run(srv, text_requests(1, "after the hold", 2), 1)[0].ok
    finally:
        srv.stop()


def test_an_init_gated_on_a_file_lasts_until_the_file_exists(model_dir, tmp_path):
    """FAKE_ENGINE_INIT_UNTIL: a test's gate (a stop that must land while the server
    starts): not healthy while the file is missing, serving once it exists."""
    import threading
    gate, seen, openers = tmp_path / "gate", {}, []

    def open_later(url: str) -> None:
        time.sleep(2)
        seen["healthy before the file"] = _healthy(url)
        gate.touch()

    def made(srv) -> None:
        openers.append(threading.Thread(target=open_later, args=(srv.url,)))
        openers[-1].start()

    t0 = time.monotonic()
    srv = serve_on_a_free_port(fake_command(model_dir), tmp_path / "server.log", made=made,
                               env={"FAKE_ENGINE_INIT_UNTIL": str(gate)}, startup_timeout_s=30)
    try:
        assert time.monotonic() - t0 >= 2 and seen == {"healthy before the file": False}
        assert run(srv, text_requests(1, "after the gate", 2), 1)[0].ok
    finally:
        srv.stop()
        for t in openers:
            t.join()


def _healthy(url: str) -> bool:
    from vllm_study.launch import net
    try:
        with net.open_url(url + "/health", timeout=0.5) as r:
            return r.status == 200
    except OSError:
        return False


def test_sigterm_stops_the_whole_group(model_dir, tmp_path):
    srv = start(tmp_path, model_dir)
    pgid = srv.proc.pid
    t0 = time.monotonic()
    os.killpg(pgid, signal.SIGTERM)
    srv.proc.wait(timeout=10)
    assert time.monotonic() - t0 < 5 and group_gone(pgid)
    srv.stop()


class _NoGpu:
    available = False
