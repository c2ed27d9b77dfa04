"""End to end against a real vLLM (the CPU build) on loopback: a server starts, answers,
is measured, and is stopped with nothing left running; endpoints measured as targets
(directly, behind a gateway, through proxy settings), and failures recorded with the
right reason."""
from __future__ import annotations

import asyncio
import gzip
import json
import threading

import pytest

from e2e_support import UNI, measure, plan_of, serve_on_a_free_port, tiny
from procs import group_gone
from vllm_study.measure import client, counters
from vllm_study.define import models
from vllm_study.define.grid import PointPlan, expand
from vllm_study.define.study_file import study_from_dict
from vllm_study.records.results import REQUESTS, TIME_DECIMALS
from vllm_study.launch.server import _health, free_port, serve_command

pytestmark = pytest.mark.e2e

DEAD_PROXY = "http://127.0.0.1:9"   # nothing listens there: a proxy variable left behind


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    plan = plan_of(tiny())
    model, dummy = models.resolve(plan.study.model)
    srv = serve_on_a_free_port(
        lambda port: serve_command(model, port, plan.point.engine_args.cli(), "tiny", load_dummy=dummy, extra=UNI),
        tmp_path_factory.mktemp("srv") / "server.log", startup_timeout_s=600)
    yield srv, model
    pgid = srv.proc.pid
    srv.stop()
    assert group_gone(pgid), "the server's process group outlived stop()"


def _target_study(url: str, workload: dict | None = None, **over) -> dict:
    return {"name": "t", "model": {"card": "tiny-qwen2"}, "rounds": 1,
            "targets": [{"name": "srv", "base_url": url, "model": "tiny"}],
            "workload": {"warmup_requests": 0, "system_prompt_tokens": 128, "question_tokens": 8,
                         "output_tokens": 8, "requests_per_round": 8, "concurrency": 4, **(workload or {})}, **over}


def _requests(start_dir) -> list[dict]:
    with gzip.open(start_dir / REQUESTS, "rt") as f:
        return [json.loads(line) for line in f]


def test_server_answers_and_counts_prefix_hits(server):
    srv, model = server
    from transformers import AutoTokenizer

    from vllm_study.workload.workload import SharedPrefixWorkload
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
        # one gap a content chunk: 15 where each chunk carries one token. vLLM's API server
        # merges the tokens a request's stream has not sent yet into one chunk when it falls
        # behind (a loaded machine), so fewer, never more
        assert 1 <= len(r.itl_s) <= 15 and r.ttft_s > 0 and r.tpot_s > 0
    d = counters.round_deltas(before, after)
    assert d["prefix_cache_queries"] == sum(q.prompt_tokens for q in reqs)
    # 4 later requests reuse the 512-token prefix: at least 3 full 128-token blocks each
    assert d["prefix_cache_hits"] >= 4 * 384
    assert d["output_steps"] > 0 and d["tokens_per_output_step"] > 0
    assert counters.cache_config(after)["block_size"] == "128"


def test_output_steps_miss_steps_that_only_advance_a_prefill(server):
    """Why the kit says 'steps with output', not 'engine steps': vLLM observes
    vllm:iteration_tokens_total only for a step that emitted output. One request alone,
    its 1,200-token prompt split by the 256-token chunk over 5 steps, one output token:
    the count moves by 1, the sum by every computed token."""
    srv, model = server
    from transformers import AutoTokenizer

    from vllm_study.workload.workload import RandomWorkload
    w = RandomWorkload(AutoTokenizer.from_pretrained(model), api="completions", input_tokens=1200,
                       output_tokens=1, seed=7)
    counters.reset_prefix_cache(srv.url)
    before = counters.scrape(srv.url)
    res = client.run_sync(client.run_closed_loop(srv.url, "tiny", "completions", w.requests(1), 1))
    after = counters.scrape(srv.url)
    assert res[0].ok and res[0].output_tokens == 1, res[0].error_detail
    d = counters.round_deltas(before, after)
    assert d["prefix_cache_hits"] == 0                      # every prompt token was computed
    assert res[0].prompt_tokens > 4 * 256                   # so its prefill took 5 steps
    assert d["output_steps"] == 1
    assert d["computed_tokens"] == res[0].prompt_tokens + 1


def test_unknown_model_lists_served_models(server):
    srv, _ = server
    with pytest.raises(client.EndpointError, match="it serves: tiny"):
        client.check_endpoint(srv.url, "no-such-model")
    res = client.run_sync(client.run_closed_loop(
        srv.url, "no-such-model", "completions", [client.Request(0, None, "hello", 1, 4)], 1))
    assert res[0].error == "unknown_model"


@pytest.mark.parametrize("load", [{"kind": "closed"}, {"kind": "poisson", "rate": 8.0}])
def test_round_clock_is_first_send_to_last_finish(server, tmp_path, load):
    """The round's clock starts after its requests are built and tokenized: the recorded
    duration is the span from the first send to the last finish, read from the requests'
    own timestamps; throughput divides by that span."""
    srv, _ = server
    plan = plan_of(_target_study(srv.url, {"requests_per_round": 12, "system_prompt_tokens": 1500,
                                           "load": load}))
    run, summary = measure(plan, tmp_path / "s1")
    assert summary.status == "ok", summary.reasons
    res = _requests(tmp_path / "s1")
    span = max(r["end_time"] for r in res) - min(r["send_time"] for r in res)
    duration = run.rounds[0].metrics["duration_s"]
    # building and tokenizing the 1,500-token prompts (tens of ms here) is not in it, nor is
    # starting the sender's event loop
    # the file keeps times to the microsecond (results.TIME_DECIMALS): two roundings apart
    assert duration == pytest.approx(span, abs=2 * 10 ** -TIME_DECIMALS), (duration, span)
    assert run.rounds[0].metrics["output_throughput"] == pytest.approx(
        sum(r["output_tokens"] for r in res) / span, rel=0.01)


def _gateway(upstream: str, key: str | None = None, delay_s: float = 0.0, refuse: tuple = ()):
    """A small reverse proxy on loopback, as an API gateway: checks a bearer key (if
    given), waits delay_s, streams the upstream vLLM answer through; paths in `refuse`
    get an HTML 404 page, as a gateway that exposes only the public API does."""
    from aiohttp import ClientSession, web

    async def forward(request: web.Request):
        if request.path in refuse:
            return web.Response(status=404, content_type="text/html",
                                text="<html><head><title>404 Not Found</title></head>\n<body><h1>Not Found</h1>"
                                     "<p>The requested URL was not found on this server.</p></body></html>")
        if key and request.headers.get("Authorization") != f"Bearer {key}":
            return web.json_response({"error": "bad key"}, status=401)
        await asyncio.sleep(delay_s)
        async with ClientSession(trust_env=False) as s:
            headers = {"Content-Type": request.headers.get("Content-Type", "application/json")}
            async with s.request(request.method, upstream + request.path_qs, data=await request.read(),
                                 headers=headers) as up:
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
    """The vLLM port directly and the same server behind a gateway that adds 1 s and
    wants a key: both measured, the gateway's TTFT higher by about its delay; the key is
    read from the variable the params name and never written; a third target without
    the key fails with a 401 reason. The direct port is measured again after the gateway:
    on 2 cores another test's vLLM start-up has delayed a whole direct round's responses
    by ~1.9 s (vLLM's own TTFT 53 ms), and the quieter of the two rounds is the control."""
    srv, _ = server
    secret = "s3cret-key-for-test"
    monkeypatch.setenv("GATEWAY_KEY", secret)
    gw_url, close = _gateway(srv.url, secret, delay_s=1.0)
    try:
        study = study_from_dict({
            **{k: v for k, v in tiny().items() if k not in ("grid", "engine_args")},
            "targets": [{"name": "direct", "base_url": srv.url + "/v1/", "model": "tiny"},
                        {"name": "gateway", "base_url": gw_url, "model": "tiny", "api_key_env": "GATEWAY_KEY"},
                        {"name": "nokey", "base_url": gw_url, "model": "tiny"},
                        {"name": "direct-again", "base_url": srv.url, "model": "tiny"}],
            "rounds": 1})
        summaries = {}
        for p in expand(study, "cpu"):
            _, summaries[p.target.name] = measure(PointPlan(study=study, point=p, engine="cpu"),
                                                  tmp_path / p.id / "s1")
    finally:
        close()
    direct, gateway, nokey = summaries["direct"], summaries["gateway"], summaries["nokey"]
    again = summaries["direct-again"]
    assert direct.status == again.status == "ok" and direct.launch.target["base_url"] == srv.url  # /v1/ normalized away
    assert gateway.status == "ok", gateway.reasons
    assert nokey.status == "failed" and "401" in nokey.reasons[0]
    # The gateway's 1 s shows in what the path adds on top of vLLM's own TTFT (client
    # mean minus vLLM's mean, over the same requests): robust to the server being slower
    # in one target's round. Every gateway request waited the 1 s before vLLM saw it.
    def path_ms(s):
        return s.estimates["ttft_mean_ms"].median - s.estimates["server_ttft_mean_ms"].median
    assert path_ms(gateway) > 950, path_ms(gateway)
    # Against the direct port, the delay is large against the noise: on 2 cores, another
    # test's vLLM and the in-process gateway sharing the client's interpreter have moved
    # it by ~400 ms
    added = path_ms(gateway) - min(path_ms(direct), path_ms(again))
    assert 500 < added < 1600, (added, path_ms(direct), path_ms(again))
    for f in tmp_path.rglob("*"):
        if f.is_file() and f.suffix != ".gz":
            assert secret not in f.read_text(errors="replace"), f


def test_proxy_variables_never_capture_the_kit(server, tmp_path, monkeypatch):
    """A stale proxy in the environment: readiness, /metrics, the cache reset and the
    load all still reach the loopback server directly."""
    srv, _ = server
    for var in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy", "ALL_PROXY"):
        monkeypatch.setenv(var, DEAD_PROXY)
    for var in ("NO_PROXY", "no_proxy"):
        monkeypatch.delenv(var, raising=False)
    assert _health(srv.url)
    run, summary = measure(plan_of(_target_study(srv.url)), tmp_path / "s1")
    assert summary.status == "ok", summary.reasons
    assert run.record.launch.has_metrics and run.record.launch.cache_reset
    assert run.rounds[0].metrics["prefix_cache_queries"] > 0


def test_a_target_that_needs_the_proxy_names_it(tmp_path, monkeypatch):
    """A target the kit cannot reach while a proxy variable would have captured it: the
    reason names the variable and how to use a proxy on purpose; a target whose own
    `proxy` is dead names that proxy."""
    monkeypatch.setenv("HTTP_PROXY", DEAD_PROXY)
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    closed = f"http://127.0.0.1:{free_port()}"
    _, summary = measure(plan_of(_target_study(closed)), tmp_path / "a" / "s1")
    assert summary.status == "failed"
    assert f"HTTP_PROXY={DEAD_PROXY} is set and would capture" in summary.reasons[0]
    assert "target's `proxy`" in summary.reasons[0]
    study = _target_study(closed)
    study["targets"][0]["proxy"] = DEAD_PROXY
    _, summary = measure(plan_of(study), tmp_path / "b" / "s1")
    assert f"through the proxy {DEAD_PROXY}" in summary.reasons[0]


def test_a_gateway_without_the_cache_reset_is_still_measured(server, tmp_path):
    """/metrics answers but /reset_prefix_cache is refused (no dev mode behind a gateway):
    the counters are collected, and the record says plainly that rounds start warm."""
    srv, _ = server
    gw_url, close = _gateway(srv.url, refuse=("/reset_prefix_cache",))
    try:
        run, summary = measure(plan_of(_target_study(gw_url, rounds=2)), tmp_path / "s1")
    finally:
        close()
    assert summary.status == "ok", summary.reasons
    assert run.record.launch.has_metrics and not run.record.launch.cache_reset
    assert any("NOT reset between rounds" in w for w in summary.warnings)
    assert not any("/metrics does not answer" in w for w in summary.warnings)
    assert all(r.metrics["prefix_cache_queries"] > 0 for r in run.rounds)


def test_a_wrong_path_is_named_in_one_line(server, tmp_path):
    """A base URL with a wrong prefix: the reason names the path that answered 404 and
    keeps the body to one line (here an HTML page from a gateway)."""
    srv, _ = server
    gw_url, close = _gateway(srv.url, refuse=("/api/v1/models",))
    try:
        _, summary = measure(plan_of(_target_study(gw_url + "/api")), tmp_path / "s1")
    finally:
        close()
    reason = summary.reasons[0]
    assert f"HTTP 404 from {gw_url}/api/v1/models: 404 Not Found Not Found The requested URL" in reason
    assert "<" not in reason and "\n" not in reason


# ---------------------------------------------------------------- workloads and load models
# Each runs one round against the module's server as an endpoint target, so no new
# server starts, and checks what the server saw and what came out.

def _round(server, tmp_path, workload: dict):
    from transformers import AutoTokenizer

    from vllm_study.workload.build_workload import make_workload
    srv, model = server
    plan = plan_of(_target_study(srv.url, workload))
    run, summary = measure(plan, tmp_path / "s1")
    assert summary.status == "ok", summary.reasons
    groups = {f"{g.key}={g.value}": g.metrics for g in run.rounds[0].groups}
    return run.rounds[0], groups, _requests(tmp_path / "s1"), make_workload(AutoTokenizer.from_pretrained(model),
                                                                            plan.study.workload)


def test_mixed_long_documents_and_short_chats(server, tmp_path):
    system_tokens = 256
    row, groups, results, w = _round(server, tmp_path, {
        "kind": "mixed", "long_fraction": 0.25, "long_prompt_tokens": {"uniform": [1200, 1600]},
        "system_prompt_tokens": system_tokens, "question_tokens": 16, "output_tokens": 16,
        "requests_per_round": 16, "concurrency": 4})
    sent = w.requests(16)
    assert [r["prompt_tokens"] for r in results] == [q.prompt_tokens for q in sent]  # as the server counted
    n_long = sum(q.tags["class"] == "long" for q in sent)
    assert n_long > 0 and groups["class=long"]["requests"] == n_long
    assert groups["class=short"]["requests"] == 16 - n_long
    for cls in ("long", "short"):
        assert groups[f"class={cls}"]["ttft_p90_ms"] > 0 and groups[f"class={cls}"]["itl_p90_ms"] > 0
    # A short chat reuses the cached system prompt, a long document nothing. Not checked
    # through TTFT: on this tiny CPU model the two classes' medians can land within a
    # millisecond of each other at concurrency 4 (159.2 vs 158.8 ms in one run). A short
    # prompt's first system_tokens (template head, system prompt) are the blocks it can hit;
    # the cache is reset before the round, and the first four requests, sent together,
    # may all miss.
    block = int(counters.cache_config(counters.scrape(server[0].url))["block_size"])
    shared = system_tokens // block * block
    n_short = 16 - n_long
    assert shared * (n_short - 4) <= row.metrics["prefix_cache_hits"] <= shared * (n_short - 1)


def test_random_lengths_from_distributions(server, tmp_path):
    row, _, results, w = _round(server, tmp_path, {
        "kind": "random", "api": "completions", "input_tokens": {"lognormal": {"mean": 200, "sd": 50}},
        "output_tokens": {"uniform": [4, 12]}, "requests_per_round": 12, "concurrency": 4})
    sent = w.requests(12)
    assert [r["prompt_tokens"] for r in results] == [q.prompt_tokens for q in sent]
    assert [r["output_tokens"] for r in results] == [q.max_tokens for q in sent]
    assert len({q.prompt_tokens for q in sent}) > 6


def test_multi_turn_reports_ttft_per_turn(server, tmp_path):
    row, groups, results, _ = _round(server, tmp_path, {
        "kind": "multi_turn", "turns": 3, "requests_per_round": 12, "concurrency": 2,
        "system_prompt_tokens": 300, "question_tokens": 24, "output_tokens": 12, "think_time_s": 0.05})
    assert [groups[f"turn={t}"]["requests"] for t in (1, 2, 3)] == [4, 4, 4]
    by_conv = {}
    for r in results:
        by_conv.setdefault(r["tags"]["conversation"], []).append(r)
    for turns in by_conv.values():  # the history grows: each turn resends the earlier ones
        tokens = [r["prompt_tokens"] for r in sorted(turns, key=lambda r: r["tags"]["turn"])]
        assert tokens[0] < tokens[1] < tokens[2] and tokens[1] - tokens[0] >= 24 + 12
    assert row.metrics["prefix_cache_hit_rate"] > 0.5  # turns 2 and 3 reuse the cached history


def test_poisson_arrivals_are_sent_on_schedule(server, tmp_path):
    from vllm_study.workload import loads
    row, _, results, _ = _round(server, tmp_path, {
        "requests_per_round": 12, "load": {"kind": "poisson", "rate": 6.0}, "seed": 5})
    planned = loads.arrivals(12, 6.0, 1.0, 5)
    due = [r["due_time"] - results[0]["due_time"] for r in results]
    # each request is due on the schedule (to the microsecond the file keeps: two roundings)
    assert due == pytest.approx(planned, abs=2 * 10 ** -TIME_DECIMALS)
    # Lateness from each request's own due time (not from the first send, which a stall
    # can delay too). Never early (asyncio may wake a timer up to its clock resolution
    # early), and on time but for a stall: on 2 cores another test's vLLM start-up can hold
    # this process off the CPU for a few hundred ms, delaying the sends due then (the
    # deadlines are absolute, so later sends are back on time).
    late = sorted(r["send_time"] - r["due_time"] for r in results)
    assert late[0] > -0.002 and late[len(late) // 2] < 0.05, late
    assert sum(x < 0.25 for x in late) >= 9, late
    assert row.metrics["completed"] == 12


def test_rate_ladder_reports_each_step(server, tmp_path):
    row, groups, _, _ = _round(server, tmp_path,
                               {"requests_per_round": 16, "load": {"kind": "ladder", "rates": [4, 8]}})
    assert groups["step=4"]["requests"] == 8 and groups["step=8"]["requests"] == 8
    for step in (4, 8):
        assert groups[f"step={step}"]["ttft_p50_ms"] > 0
        assert groups[f"step={step}"]["ttft_p99_ms"] >= groups[f"step={step}"]["ttft_p50_ms"]
