"""Windows across a whole trace: stratified by time and seeded, each bad request refused
with the key and the fix before anything runs, the short-history statement, the summary
against the whole trace, and the whole public traces shipped beside their heads."""
from __future__ import annotations

import gzip

import numpy as np
import pytest

from vllm_study.workload import prefix_cache_model as pcm
from vllm_study.workload import windows
from vllm_study.define.params import TraceSpec
from vllm_study.define.traces import DATA, SHIPPED, Trace, TraceError, TraceRequest, read_trace
from paths import REPO

FULL_TRACES = REPO.parent / "shared" / "traces"


def uniform(n=1000, gap=1.0, ids=True) -> Trace:
    """n requests, one every `gap` s, 8 tokens each; request i shares id 0, then has its own."""
    reqs = [TraceRequest(i * gap, 8, 2, (0, 1000 + i) if ids else None, None, i + 1) for i in range(n)]
    return Trace(reqs, 4 if ids else None, "hand-made")


@pytest.fixture(scope="module")
def conversation():
    return windows.whole_trace("mooncake_conversation")


# ---------------------------------------------------------------- shipped whole traces

def test_whole_traces_ship_beside_their_heads(conversation):
    assert len(conversation.requests) == 12031 and conversation.duration_s == pytest.approx(3537.0, abs=0.5)
    head = read_trace(TraceSpec(file="mooncake_conversation"))  # today's window still reads
    assert [(r.input_tokens, r.prefix) for r in head.requests] == \
        [(r.input_tokens, r.prefix) for r in conversation.requests[:600]]
    readme = (DATA / "README.md").read_text()
    for name, s in SHIPPED.items():
        whole = windows.whole_trace(name)
        assert len(whole.requests) > s.requests and (DATA / s.original).stat().st_size < 1_000_000
        assert f"`{s.original}`" in readme and (DATA / s.licence_file).is_file()
    with pytest.raises(TraceError, match="'nope' is not a shipped trace; the whole traces are mooncake_conv"):
        windows.whole_trace("nope")


@pytest.mark.skipif(not FULL_TRACES.is_dir(), reason="the full traces are not beside the repository")
def test_whole_traces_are_the_originals_byte_for_byte():
    for s in SHIPPED.values():
        assert (DATA / s.original).read_bytes() == (FULL_TRACES / s.original).read_bytes()
        gzip.decompress((DATA / s.original).read_bytes())  # a whole gzip stream


# ---------------------------------------------------------------- selection

def test_one_window_per_time_stratum_inside_it():
    whole = uniform(1000)  # 0..999 s
    plan = windows.plan_windows(whole, 5, seed=3, requests=50)
    assert len(plan.windows) == 5 and plan.notes == []
    for k, w in enumerate(plan.windows):
        lo, hi = w.stratum_s
        assert (lo, hi) == pytest.approx((k * 999 / 5, (k + 1) * 999 / 5))
        ts = [r.t_s for r in whole.requests[w.start:w.stop]]
        assert len(ts) == 50 and lo <= ts[0] and (ts[-1] < hi or k == 4)
        assert w.history_start == w.start  # prime: none
    assert all(a.stop <= b.start for a, b in zip(plan.windows, plan.windows[1:]))


def test_windows_are_seeded():
    whole = uniform(1000)
    starts = lambda seed: [w.start for w in windows.plan_windows(whole, 5, seed=seed, requests=50).windows]  # noqa: E731
    assert starts(1) == starts(1)
    assert starts(1) != starts(2)
    # positions spread over each stratum (not always its first request): 200 seeds, window 1
    # can start at request 0..150
    firsts = [starts(s)[0] for s in range(200)]
    assert min(firsts) < 20 and max(firsts) > 130 and len(set(firsts)) > 80


def test_windows_by_duration():
    whole = uniform(1000)
    plan = windows.plan_windows(whole, 4, seed=0, duration_s=30)
    for w in plan.windows:
        ts = [r.t_s for r in whole.requests[w.start:w.stop]]
        assert 29 <= len(ts) <= 30 and ts[-1] - ts[0] < 30
        assert w.stratum_s[0] <= ts[0] and ts[-1] < w.stratum_s[1]


def test_a_window_as_the_kit_replays_it(conversation):
    w = windows.plan_windows(conversation, 3, seed=0, requests=200).windows[2]
    t = w.trace(conversation)
    assert len(t.requests) == 200 and t.requests[0].t_s == 0.0 and t.block_tokens == 512
    assert t.requests[5].t_s == pytest.approx(conversation.requests[w.start + 5].t_s
                                              - conversation.requests[w.start].t_s)
    assert "window 3" in t.source and t.requests[0].t_s == 0.0


# ---------------------------------------------------------------- bad input

def test_more_windows_than_the_trace_holds():
    whole = uniform(100)  # 100 requests over 99 s
    with pytest.raises(TraceError, match=r"trace.windows 4 cuts the trace into 4 strata of 24.8 s, and stratum 1 "
                                         r"holds 25 requests, fewer than a window's 30; the trace holds at most "
                                         r"3 such windows: lower trace.windows"):
        windows.plan_windows(whole, 4, seed=0, requests=30)
    with pytest.raises(TraceError, match=r"holds 9.9 s, fewer than a window's 20; the trace holds at most 4"):
        windows.plan_windows(whole, 10, seed=0, duration_s=20)


def test_a_window_longer_than_the_trace():
    whole = uniform(100)
    with pytest.raises(TraceError, match=r"a window of trace.requests 101 is longer than the trace \(100 requests\); "
                                         r"lower trace.requests"):
        windows.plan_windows(whole, 1, seed=0, requests=101)
    with pytest.raises(TraceError, match=r"trace.duration_s 120 s is longer than the trace \(99.0 s\)"):
        windows.plan_windows(whole, 1, seed=0, duration_s=120)


def test_priming_a_trace_without_prefix_ids():
    with pytest.raises(TraceError, match=r"prime: history needs prefix ids .* set trace.prime: none"):
        windows.plan_windows(uniform(100, ids=False), 2, seed=0, requests=10, prime="history")
    azure = windows.whole_trace("azure_code")
    with pytest.raises(TraceError, match=r"AzureLLMInferenceTrace_code.csv.gz.*prime: history needs prefix ids"):
        windows.plan_windows(azure, 3, seed=0, requests=200, prime="history")
    assert len(windows.plan_windows(azure, 3, seed=0, requests=200).windows) == 3  # cold replay is fine


def test_other_bad_keys():
    whole = uniform(100)
    with pytest.raises(TraceError, match="as trace.requests or trace.duration_s, one of them"):
        windows.plan_windows(whole, 2, seed=0)
    with pytest.raises(TraceError, match="as trace.requests or trace.duration_s, one of them"):
        windows.plan_windows(whole, 2, seed=0, requests=5, duration_s=5)
    with pytest.raises(TraceError, match="trace.windows is 0; give at least 1"):
        windows.plan_windows(whole, 0, seed=0, requests=5)
    with pytest.raises(TraceError, match="trace.prime is 'warm'; it is history or none"):
        windows.plan_windows(whole, 2, seed=0, requests=5, prime="warm")


def test_history_that_runs_off_the_start_is_stated():
    # 2-token blocks: each request has 2 blocks of id 0 (shared by all) and 2 of its own: a
    # cache of 202 blocks holds the last 100 requests before a window, and no more
    whole = uniform(1000)
    kv = (202 + 1) * 2
    plan = windows.plan_windows(whole, 10, seed=0, requests=50, prime="history", kv_tokens=kv, block_size=2)
    short = [w for w in plan.windows if w.start < 100]
    assert short and len(short) < len(plan.windows)  # the seed puts window 1 early: both cases are seen
    for w in plan.windows:
        assert w.history_start == max(0, w.start - 100)
    assert plan.notes == [f"window {w.index + 1} (from {w.start:.1f} s): its history runs off the trace's start: "
                          f"{w.start:.1f} s, {w.start} requests, {8 * w.start:,} prompt tokens of history, less "
                          f"than the {kv:,}-token cache would hold; its cache starts part cold" for w in short]
    # a cache that never evicts wants all the history: every window's runs off
    assert len(windows.plan_windows(whole, 5, seed=3, requests=50, prime="history").notes) == 5


# ---------------------------------------------------------------- the summary

def test_summary_against_the_whole_trace(conversation):
    plan = windows.plan_windows(conversation, 4, seed=0, requests=100)
    table = windows.summary(conversation, plan)
    assert list(table.index) == ["whole trace", "window 1", "window 2", "window 3", "window 4"]
    whole = table.loc["whole trace"]
    assert whole["rate_rps"] == pytest.approx(conversation.rate)
    assert whole["input_p50"] == np.quantile([r.input_tokens for r in conversation.requests], 0.5)
    assert whole["reuse_alone"] == pytest.approx(conversation.expected_hit_rate(), abs=1e-12)
    for w in plan.windows:
        row, t = table.loc[f"window {w.index + 1}"], w.trace(conversation)
        assert row["requests"] == 100 and row["rate_rps"] == pytest.approx(t.rate)
        assert row["output_p99"] == np.quantile([r.output_tokens for r in t.requests], 0.99)
        assert row["reuse_alone"] == pytest.approx(t.expected_hit_rate(), abs=1e-12)
        assert row["reuse_with_history"] > row["reuse_alone"]
    # no prefix ids: no reuse columns
    assert "reuse_alone" not in windows.summary(uniform(100, ids=False),
                                                windows.plan_windows(uniform(100, ids=False), 2, seed=0,
                                                                     requests=10)).columns


def test_priming_history_fills_the_servers_cache(conversation):
    # the history plan_windows picks is what the model then primes with: the window sees
    # at least the hits it would see with all earlier traffic in a cache of that size
    kv = 2_064_624
    w = windows.plan_windows(conversation, 3, seed=0, requests=60, prime="history", kv_tokens=kv).windows[1]
    reqs = conversation.requests
    some = pcm.simulate(reqs[w.start:w.stop], block_tokens=512, kv_tokens=kv, history=reqs[w.history_start:w.start])
    cold = pcm.simulate(reqs[w.start:w.stop], block_tokens=512, kv_tokens=kv)
    assert 0 < w.history_start < w.start and some.hit_rate > cold.hit_rate
