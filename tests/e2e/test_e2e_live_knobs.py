"""Live scheduler limits on one real vLLM CPU server: launched at chunk 512 and
max_num_seqs 8, then four short rounds at (256, 4), (512, 4), (256, 8), (512, 8), each
set through live_knobs. Every round's recorded limits must be those the engine reports
it used, and the engine's own records of the round (its largest step in tokens, its
most running requests) must show them binding. A message above the launch value and a
wrong value are refused and leave the limits as they were.
"""
from __future__ import annotations

import json
import random
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from e2e_support import UNI, serve_on_a_free_port
from procs import group_gone
from vllm_study.measure import counters, live_knobs
from vllm_study.define.models import kv_bytes_per_token
from vllm_study.launch.server import serve_command

pytestmark = pytest.mark.e2e

LAUNCH_CHUNK, LAUNCH_SEQS = 512, 8
ROUNDS = [(256, 4), (512, 4), (256, 8), (512, 8)]
# 8 prompts of 300 tokens fill the first step at either chunk; 32 output tokens keep the
# first request running until the last is admitted, so all max_num_seqs slots fill
PROMPT_TOKENS, OUTPUT_TOKENS, REQUESTS = 300, 32, 8
ENGINE = ["--max-model-len", "2048", "--enforce-eager", "--dtype", "float32",
          "--kv-cache-memory-bytes", str(16384 * kv_bytes_per_token("tiny-qwen2", 4)),
          "--max-num-batched-tokens", str(LAUNCH_CHUNK), "--max-num-seqs", str(LAUNCH_SEQS),
          "--scheduler-cls", live_knobs.SCHEDULER_CLS, *UNI]
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: no proxy


def _post(url: str, body: dict | None = None) -> dict:
    data = json.dumps(body).encode() if body is not None else b""
    req = urllib.request.Request(url, data, {"Content-Type": "application/json"}, method="POST")
    with _OPENER.open(req, timeout=600) as r:
        return json.loads(r.read() or b"{}")


def _complete(url: str, prompt: list[int]) -> dict:
    return _post(url + "/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": OUTPUT_TOKENS,
                                           "temperature": 0.0, "ignore_eos": True})


@pytest.fixture(scope="module")
def server(tmp_path_factory, qwen_dir):
    model = str(qwen_dir)
    work = tmp_path_factory.mktemp("live")
    stats, control = work / "counters.json", work / "control.json"
    # a start that fails stops its own server (VllmServer.start)
    srv = serve_on_a_free_port(lambda port: serve_command(model, port, ENGINE, "tiny", load_dummy=True),
                               work / "server.log", env=live_knobs.launch_env(control, stats), startup_timeout_s=900)
    try:
        _complete(srv.url, list(range(1000, 1100)))  # first request after a start: kernel set-up
        yield srv, stats, control
    finally:
        pgid = srv.proc.pid
        srv.stop()
        assert group_gone(pgid), "the server's process group outlived stop()"


def _round(url: str, stats, seed: int) -> None:
    """REQUESTS distinct prompts, all in the engine's queue before it schedules any:
    sent while the scheduler is paused (vLLM's dev endpoint; "keep" queues them), so the
    limits bind however this machine times the HTTP side. A paused engine does not step,
    so /metrics does not see them queued; the plugin's count of held requests does."""
    counters.reset_prefix_cache(url)  # no round reuses another's prompts from the cache
    rng = random.Random(seed)
    prompts = [[rng.randrange(1000, 100_000) for _ in range(PROMPT_TOKENS)] for _ in range(REQUESTS)]
    _post(url + "/pause?mode=keep")
    with ThreadPoolExecutor(REQUESTS) as pool:
        try:
            pending = [pool.submit(_complete, url, p) for p in prompts]
            deadline = time.monotonic() + 120
            while live_knobs.knobs_state(stats)["requests"] < REQUESTS:
                assert time.monotonic() < deadline, "the round's requests did not reach the engine"
                time.sleep(0.05)
        finally:
            _post(url + "/resume")
        results = [f.result() for f in pending]
    assert all(r["usage"]["completion_tokens"] == OUTPUT_TOKENS for r in results)


def test_rounds_run_under_the_limits_set_live_and_bad_messages_are_refused(server):
    srv, stats, control = server
    state = live_knobs.knobs_state(stats)
    launch = {"max_num_batched_tokens": LAUNCH_CHUNK, "max_num_seqs": LAUNCH_SEQS,
              "long_prefill_token_threshold": 0}
    assert state["launch"] == launch and state["in_force"] == launch and state["applied_seq"] == 0
    records = []
    for i, (chunk, seqs) in enumerate(ROUNDS):
        t0 = time.monotonic()
        recorded = live_knobs.set_limits(srv.url, stats, control, max_num_batched_tokens=chunk,
                                         max_num_seqs=seqs)
        set_s = time.monotonic() - t0
        assert recorded == {"seq": i + 1, "max_num_batched_tokens": chunk, "max_num_seqs": seqs,
                            "long_prefill_token_threshold": 0}
        _round(srv.url, stats, seed=i)
        time.sleep(0.5)  # the counters file is rewritten every 0.2 s
        used = live_knobs.limits_used(stats, recorded["seq"])
        records.append({"set_s": round(set_s, 2), **used})
        assert {k: used[k] for k in recorded} == recorded
        # the engine's own steps: the limits bound, and nothing went past them
        assert used["peak_step_tokens"] == chunk and used["peak_running"] == seqs, used
    print("\nrounds:", json.dumps(records))

    before = live_knobs.knobs_state(stats)
    for message, why in (({"max_num_batched_tokens": 1024}, "1024 is above its launch value 512"),
                         ({"max_num_seqs": 16}, "16 is above its launch value 8"),
                         ({"max_num_seqs": "eight"}, "max_num_seqs must be an integer"),
                         ({"max_num_batched_tokens": 0}, "max_num_batched_tokens must be >= 1")):
        with pytest.raises(live_knobs.Refused, match=why):
            live_knobs.send_message(srv.url, stats, control, message)
        after = live_knobs.knobs_state(stats)
        assert after["status"] == "refused" and why in after["reason"]
        assert after["applied_seq"] == before["applied_seq"] and after["in_force"] == before["in_force"]
    # the refusals left the last round's limits in force, and the engine runs under them
    _round(srv.url, stats, seed=99)
    time.sleep(0.5)
    used = live_knobs.limits_used(stats, before["applied_seq"])
    assert (used["max_num_batched_tokens"], used["max_num_seqs"]) == ROUNDS[-1]
    assert used["steps"] > records[-1]["steps"]
    log = srv.log_path.read_text()
    assert "live limits: message 4 applied" in log and "message 8 refused" in log
