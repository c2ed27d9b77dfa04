"""End to end against a real vLLM (the CPU build) on loopback: a server starts,
answers, is measured, and is stopped with nothing left running."""
from __future__ import annotations

import os

import pytest

from procs import group_gone
from vllm_study import client, counters
from vllm_study.params import study_from_dict, expand
from vllm_study.point import PointRun, prepare_model
from vllm_study.server import ServerStartError, VllmServer, free_port, serve_command
from vllm_study.workload import SharedPrefixWorkload

pytestmark = pytest.mark.e2e

TINY = {"name": "e2e", "model": {"card": "tiny-qwen2", "served_name": "tiny"},
        "engine_args": {"max_model_len": 2048, "enable_prefix_caching": True, "enforce_eager": True,
                        "dtype": "bfloat16", "kv_cache_memory_bytes": 32 * 2**20},
        "grid": {"max_num_batched_tokens": [256]},
        "workload": {"system_prompt_tokens": 512, "question_tokens": 16, "output_tokens": 16,
                     "concurrency": 4, "requests_per_round": 8, "warmup_requests": 2},
        "rounds": 2}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    study = study_from_dict(TINY)
    point = expand(study, "cpu")[0]
    model, dummy = prepare_model(study)
    port = free_port()
    cmd = serve_command(model, port, point.engine_args.cli(), "tiny", load_dummy=dummy)
    srv = VllmServer(cmd, port, tmp_path_factory.mktemp("srv") / "server.log", startup_timeout_s=600)
    srv.start()
    yield srv, study, model
    pgid = srv.proc.pid
    srv.stop()
    assert group_gone(pgid), "the server's process group outlived stop()"


def test_server_answers_and_counts_prefix_hits(server):
    srv, study, model = server
    from transformers import AutoTokenizer
    w = SharedPrefixWorkload(AutoTokenizer.from_pretrained(model), api="chat", system_prompt_tokens=512,
                             question_tokens=16, output_tokens=16, seed=1)
    client.check_endpoint(srv.url, "tiny")
    counters.reset_prefix_cache(srv.url)
    before = counters.scrape(srv.url)
    # one request first, so the shared prefix is cached when the others arrive
    reqs = w.requests(5)
    first = client.run_sync(client.run_closed_loop(srv.url, "tiny", "chat", reqs[:1], 1))
    rest = client.run_sync(client.run_closed_loop(srv.url, "tiny", "chat", reqs[1:], 4))
    after = counters.scrape(srv.url)
    results = first + rest
    assert all(r.ok for r in results), [r.error_detail for r in results]
    for r, q in zip(results, reqs):
        assert r.prompt_tokens == q.prompt_tokens  # the workload's exact length, as the server counts it
        assert r.output_tokens == 16               # ignore_eos: fixed output length
        assert len(r.itl_s) == 15 and r.ttft_s > 0 and r.tpot_s > 0
    d = counters.round_deltas(before, after)
    assert d["prefix_cache_queries"] == sum(q.prompt_tokens for q in reqs)
    # 4 later requests reuse the 512-token prefix: at least 3 full 128-token blocks each
    assert d["prefix_cache_hits"] >= 4 * 384
    assert d["engine_steps"] > 0 and d["tokens_per_step"] > 0
    assert counters.cache_config(after)["block_size"] == "128"


def test_unknown_model_lists_served_models(server):
    srv, _, _ = server
    with pytest.raises(client.EndpointError, match="it serves: tiny"):
        client.check_endpoint(srv.url, "no-such-model")
    res = client.run_sync(client.run_closed_loop(
        srv.url, "no-such-model", "completions",
        [client.Request(0, None, "hello", 1, 4)], 1))
    assert res[0].error == "unknown_model"


def test_kv_cache_too_small_is_a_clear_start_failure(tmp_path):
    """1 MiB of KV (1,024 tokens) cannot hold one 2,048-token request: vLLM refuses to
    start, and the kit says why in one line."""
    study = study_from_dict(TINY)
    model, dummy = prepare_model(study)
    args = expand(study, "cpu")[0].engine_args.model_copy(update={"kv_cache_memory_bytes": 2**20})
    port = free_port()
    srv = VllmServer(serve_command(model, port, args.cli(), "tiny", load_dummy=dummy), port,
                     tmp_path / "server.log", startup_timeout_s=600)
    with pytest.raises(ServerStartError) as e:
        srv.start()
    assert e.value.reason.startswith("max_model_len too large for the KV cache"), e.value.reason
    assert group_gone(srv.proc.pid)


def test_point_run_records_rounds_and_medians(tmp_path):
    study = study_from_dict(TINY)
    point = expand(study, "cpu")[0]
    run = PointRun(study, point, tmp_path, "cpu")
    run.launch()
    run.warmup()
    run.run_rounds()
    s = run.finish()
    assert s["status"] == "ok", s["reason"]
    assert s["rounds_ok"] == 2 and len(run.rounds) == 2
    ttft = sorted(r["ttft_p90_ms"] for r in run.rounds)
    assert s["medians"]["ttft_p90_ms"] == pytest.approx(sum(ttft) / 2)  # median of two
    assert s["effective"]["cache_config"]["kv_cache_memory_bytes"] == str(32 * 2**20)
    assert s["effective"]["vllm_non_default_args"]["max_num_batched_tokens"] == 256
    assert isinstance(s["gpu"], str) and "no NVIDIA GPU" in s["gpu"]  # said plainly on a CPU
    assert (tmp_path / "requests.jsonl.gz").exists() and (tmp_path / "server.log").exists()
    assert group_gone(s["server_pgid"])


def test_server_dying_mid_round_keeps_finished_rounds(tmp_path):
    """Round 0 completes; the server is killed during round 1: that round is recorded
    as failed, round 0 stays, the point is failed with the reason, nothing runs on."""
    import signal
    import threading

    study = study_from_dict({**TINY, "rounds": 3,
                             "workload": {**TINY["workload"], "requests_per_round": 48, "output_tokens": 64}})
    run = PointRun(study, expand(study, "cpu")[0], tmp_path, "cpu")
    run.launch()
    assert not run.failed, run.summary["reason"]
    run.run_round(0)
    killer = threading.Timer(1.0, lambda: os.killpg(run.server.proc.pid, signal.SIGKILL))
    killer.start()
    run.run_round(1)
    killer.join()
    run.run_round(2)  # a no-op once the point has failed
    s = run.finish()
    assert [r["status"] for r in run.rounds] == ["ok", "failed"]
    assert run.rounds[1]["failed"] > 0
    assert s["status"] == "failed" and s["reason"].startswith("server died during round 1")
    assert s["rounds_ok"] == 1 and s["medians"]["ttft_p90_ms"] == run.rounds[0]["ttft_p90_ms"]
    lines = (tmp_path / "rounds.jsonl").read_text().splitlines()
    assert len(lines) == 2  # both rounds on disk


def _gateway(upstream: str, key: str, delay_s: float):
    """A small reverse proxy on loopback: checks a bearer key, waits delay_s, then
    streams the upstream vLLM answer through, as an API gateway would."""
    import asyncio
    import threading

    from aiohttp import ClientSession, web

    async def forward(request: web.Request):
        if request.headers.get("Authorization") != f"Bearer {key}":
            return web.json_response({"error": "bad key"}, status=401)
        await asyncio.sleep(delay_s)
        async with ClientSession(trust_env=False) as s:
            async with s.request(request.method, upstream + request.path_qs, data=await request.read(),
                                 headers={"Content-Type": request.headers.get("Content-Type", "application/json")}) as up:
                resp = web.StreamResponse(status=up.status, headers={"Content-Type": up.headers["Content-Type"]})
                await resp.prepare(request)
                async for chunk in up.content.iter_any():
                    await resp.write(chunk)
                await resp.write_eof()
                return resp

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", forward)
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(app)
    loop.run_until_complete(runner.setup())
    port = free_port()
    loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", port).start())
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    def close():
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
    return f"http://127.0.0.1:{port}", close


def test_endpoint_targets_side_by_side_with_a_gateway(server, tmp_path, monkeypatch):
    """The vLLM port directly and the same server behind a gateway that adds 200 ms and
    wants a key: both measured, the gateway's TTFT higher by about its delay; the key is
    read from the variable the params name and never written; a third target without
    the key fails with a 401 reason."""
    srv, _, _ = server
    secret = "s3cret-key-for-test"
    monkeypatch.setenv("GATEWAY_KEY", secret)
    gw_url, close = _gateway(srv.url, secret, delay_s=0.2)
    try:
        study = study_from_dict({
            **{k: v for k, v in TINY.items() if k not in ("grid", "engine_args")},
            "targets": [{"name": "direct", "base_url": srv.url + "/v1/", "model": "tiny"},
                        {"name": "gateway", "base_url": gw_url, "model": "tiny", "api_key_env": "GATEWAY_KEY"},
                        {"name": "nokey", "base_url": gw_url, "model": "tiny"}],
            "rounds": 1})
        summaries = {}
        for p in expand(study, "cpu"):
            run = PointRun(study, p, tmp_path / p.id, "cpu")
            run.launch()
            run.warmup()
            run.run_rounds()
            summaries[p.target.name] = run.finish()
    finally:
        close()
    direct, gateway, nokey = summaries["direct"], summaries["gateway"], summaries["nokey"]
    assert direct["status"] == "ok" and direct["target"]["base_url"] == srv.url  # /v1/ normalized away
    assert gateway["status"] == "ok", gateway["reason"]
    assert nokey["status"] == "failed" and "401" in nokey["reason"]
    added = gateway["medians"]["ttft_p50_ms"] - direct["medians"]["ttft_p50_ms"]
    assert 150 < added < 400, added  # the gateway's 200 ms shows up in TTFT, and no more than noise on top
    for f in tmp_path.rglob("*"):
        if f.is_file() and f.suffix != ".gz":
            assert secret not in f.read_text(errors="replace"), f


def test_max_model_len_above_the_model_is_a_clear_start_failure(tmp_path):
    """A model folder the kit cannot check (model.path): vLLM refuses 16,384 positions on
    an 8,192-position model, and the recorded reason says so in one line."""
    built, _ = prepare_model(study_from_dict(TINY))
    study = study_from_dict({**TINY, "model": {"path": built, "served_name": "tiny"},
                             "engine_args": {**TINY["engine_args"], "max_model_len": 16384}})
    point = expand(study, "cpu")[0]
    run = PointRun(study, point, tmp_path, "cpu")
    run.launch()
    s = run.finish()
    assert s["status"] == "failed"
    assert "max_model_len above what the model supports" in s["reason"], s["reason"]


# ---------------------------------------------------------------- workloads and load models
# Each runs one round through PointRun against the module's server (as an endpoint
# target, so no new server starts) and checks what the server saw and what came out.

def _round(server, tmp_path, workload: dict):
    import gzip
    import json

    from vllm_study.workload import make_workload
    srv, _, model = server
    study = study_from_dict({"name": "wl", "model": {"card": "tiny-qwen2"}, "rounds": 1,
                             "targets": [{"name": "srv", "base_url": srv.url, "model": "tiny"}],
                             "workload": {"warmup_requests": 0, **workload}})
    run = PointRun(study, expand(study, "cpu")[0], tmp_path, "cpu")
    run.launch()
    run.run_rounds()
    s = run.finish()
    assert s["status"] == "ok", s["reason"]
    with gzip.open(tmp_path / "requests.jsonl.gz", "rt") as f:
        results = [json.loads(line) for line in f]
    from transformers import AutoTokenizer
    return run.rounds[0], results, make_workload(AutoTokenizer.from_pretrained(model), study.workload)


def test_mixed_long_documents_and_short_chats(server, tmp_path):
    row, results, w = _round(server, tmp_path, {
        "kind": "mixed", "long_fraction": 0.25, "long_prompt_tokens": {"uniform": [1200, 1600]},
        "system_prompt_tokens": 256, "question_tokens": 16, "output_tokens": 16,
        "requests_per_round": 16, "concurrency": 4})
    sent = w.requests(16)
    assert [r["prompt_tokens"] for r in results] == [q.prompt_tokens for q in sent]  # as the server counted
    n_long = sum(q.tags["class"] == "long" for q in sent)
    assert n_long > 0 and row["requests[class=long]"] == n_long and row["requests[class=short]"] == 16 - n_long
    for cls in ("long", "short"):
        assert row[f"ttft_p90_ms[class={cls}]"] > 0 and row[f"itl_p90_ms[class={cls}]"] > 0
    # a long document has to be prefilled; a short chat reuses the cached system prompt
    assert row["ttft_p50_ms[class=long]"] > row["ttft_p50_ms[class=short]"]


def test_random_lengths_from_distributions(server, tmp_path):
    row, results, w = _round(server, tmp_path, {
        "kind": "random", "api": "completions", "input_tokens": {"lognormal": {"mean": 200, "sd": 50}},
        "output_tokens": {"uniform": [4, 12]}, "requests_per_round": 12, "concurrency": 4})
    sent = w.requests(12)
    assert [r["prompt_tokens"] for r in results] == [q.prompt_tokens for q in sent]
    assert [r["output_tokens"] for r in results] == [q.max_tokens for q in sent]
    assert len({q.prompt_tokens for q in sent}) > 6


def test_multi_turn_reports_ttft_per_turn(server, tmp_path):
    row, results, w = _round(server, tmp_path, {
        "kind": "multi_turn", "turns": 3, "requests_per_round": 12, "concurrency": 2,
        "system_prompt_tokens": 300, "question_tokens": 24, "output_tokens": 12, "think_time_s": 0.05})
    assert [row[f"requests[turn={t}]"] for t in (1, 2, 3)] == [4, 4, 4]
    by_conv = {}
    for r in results:
        by_conv.setdefault(r["tags"]["conversation"], []).append(r)
    for turns in by_conv.values():  # the history grows: each turn resends the earlier ones
        tokens = [r["prompt_tokens"] for r in sorted(turns, key=lambda r: r["tags"]["turn"])]
        assert tokens[0] < tokens[1] < tokens[2] and tokens[1] - tokens[0] >= 24 + 12
    assert row["prefix_cache_hit_rate"] > 0.5  # turns 2 and 3 reuse the cached history


def test_poisson_arrivals_are_sent_on_schedule(server, tmp_path):
    from vllm_study import loads
    row, results, _ = _round(server, tmp_path, {
        "system_prompt_tokens": 128, "question_tokens": 8, "output_tokens": 8, "requests_per_round": 12,
        "load": {"kind": "poisson", "rate": 6.0}, "seed": 5})
    planned = loads.arrivals(12, 6.0, 1.0, 5)
    sent = [r["send_time"] - results[0]["send_time"] for r in results]
    assert all(abs(s - p) < 0.25 for s, p in zip(sent, planned)), (sent, planned)
    assert row["completed"] == 12


def test_rate_ladder_reports_each_step(server, tmp_path):
    row, results, _ = _round(server, tmp_path, {
        "system_prompt_tokens": 128, "question_tokens": 8, "output_tokens": 8, "requests_per_round": 16,
        "load": {"kind": "ladder", "rates": [4, 8]}})
    assert row["requests[step=4]"] == 8 and row["requests[step=8]"] == 8
    for step in (4, 8):
        assert row[f"ttft_p50_ms[step={step}]"] > 0 and row[f"ttft_p99_ms[step={step}]"] >= row[f"ttft_p50_ms[step={step}]"]


def test_prefix_reuse_expected_vs_measured_shows_eviction(tmp_path):
    """A KV cache of 4,096 tokens and 1,024-token prefixes sent one after another: with 2
    prefixes both stay cached and the measured hit rate meets the expected one; with 6,
    each is evicted before its turn comes again and the measured rate falls far below
    what a never-evicting cache would reach."""
    study = study_from_dict({**TINY, "engine_args": {**TINY["engine_args"], "kv_cache_memory_bytes": 4 * 2**20}})
    model, dummy = prepare_model(study)
    port = free_port()
    srv = VllmServer(serve_command(model, port, expand(study, "cpu")[0].engine_args.cli(), "tiny", load_dummy=dummy),
                     port, tmp_path / "server.log", startup_timeout_s=600)
    rates = {}
    with srv:
        for prefixes in (2, 6):
            s = study_from_dict({"name": "reuse", "model": {"card": "tiny-qwen2"}, "rounds": 1,
                                 "targets": [{"name": "srv", "base_url": srv.url, "model": "tiny"}],
                                 "workload": {"system_prompt_tokens": 1024, "question_tokens": 16, "output_tokens": 8,
                                              "prefixes": prefixes, "concurrency": 1, "requests_per_round": 24,
                                              "warmup_requests": 0}})
            run = PointRun(s, expand(s, "cpu")[0], tmp_path / f"p{prefixes}", "cpu")
            run.launch()
            run.run_rounds()
            summary = run.finish()
            assert summary["status"] == "ok", summary["reason"]
            from transformers import AutoTokenizer
            from vllm_study.workload import make_workload
            expected = make_workload(AutoTokenizer.from_pretrained(model), s.workload).expected_hit_rate(24, 128)
            rates[prefixes] = (expected, run.rounds[0]["prefix_cache_hit_rate"])
    (exp2, got2), (exp6, got6) = rates[2], rates[6]
    assert got2 == pytest.approx(exp2, abs=0.02)
    assert exp6 > 0.6 and got6 < exp6 / 2, rates
