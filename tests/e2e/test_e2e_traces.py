"""Trace replay against a real vLLM (the CPU build), where only vLLM's cache can answer:
a trace with prefix blocks whose hit rate vLLM must reproduce to the token, and windows
of the shipped Mooncake trace primed with their history, whose hit rate is the cache
model's. A primed window's control flow (its history sent first, outside the round's
counters) runs on the fake engine. (The capacity search on a trace window, and what a
plain trace run says it could not replay: test_e2e_trace_capacity.py, on the fake.)"""
from __future__ import annotations

import json

import pytest
from e2e_support import fake_engine_study, kv_bytes, measure, plan_of, tiny
from procs import group_gone


@pytest.mark.e2e
def test_a_trace_with_prefix_blocks_gets_the_hit_rate_it_allows(tmp_path):
    """Requests that share their first k block ids share exactly k blocks of tokens as vLLM
    sees them: sent one after another (nothing evicted, each answered before the next),
    vLLM's measured hit rate is the one the block ids allow, to the token."""
    block = 128  # vLLM's CPU block size: the trace's blocks are whole vLLM blocks
    rows = [  # each request ends in a block of its own, so none is a full copy of an earlier one
        {"t_s": 0.0, "input_tokens": 3 * block + 40, "output_tokens": 4, "prefix": [0, 1, 2, 3]},
        {"t_s": 1.5, "input_tokens": 2 * block + 10, "output_tokens": 4, "prefix": [0, 1, 7]},
        {"t_s": 3.0, "input_tokens": 4 * block + 90, "output_tokens": 4, "prefix": [0, 1, 2, 8, 9]},
        {"t_s": 4.5, "input_tokens": 1 * block + 50, "output_tokens": 4, "prefix": [10, 11]},
        {"t_s": 6.0, "input_tokens": 2 * block + 60, "output_tokens": 4, "prefix": [10, 12, 13]},
    ]
    f = tmp_path / "trace.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    study = tiny(workload={"kind": "trace", "warmup_requests": 1,
                           "trace": {"file": str(f), "format": "jsonl", "block_tokens": block}},
                 engine_args={**tiny()["engine_args"], "block_size": block}, rounds=1)
    run, summary = measure(plan_of(study), tmp_path / "s1")
    assert summary.status == "ok", summary.reasons
    (rec,) = run.rounds
    # hits: request 2 reuses ids 0-1, request 3 ids 0-2, request 5 id 10
    expected = (2 * block + 3 * block + 1 * block) / sum(r["input_tokens"] for r in rows)
    assert rec.metrics["expected_prefix_hit_rate"] == pytest.approx(expected)
    assert rec.metrics["prefix_cache_hit_rate"] == pytest.approx(expected)
    assert rec.metrics["prompt_tokens_vs_trace"] == 0.0
    assert group_gone(run.record.launch.server_pgid)


@pytest.mark.e2e
@pytest.mark.fake_engine
def test_a_primed_mooncake_window_is_primed_with_its_history_outside_the_rounds_counters(tmp_path):
    """trace.prime: history on one window of the shipped Mooncake trace (from 60 s), on a
    KV cache of 16k tokens (two of its longer prompts), on the fake engine: each round is
    first primed with the traffic before the window that fits the cache, sent to the
    round's server and kept out of its counters, and its blocks are hit in the round.
    (vLLM's hit rate against the cache model's, primed: the windows test below.)"""
    study = fake_engine_study(tiny(
        workload={"kind": "trace", "warmup_requests": 1, "concurrency": 1,
                  "trace": {"file": "mooncake_conversation", "start_s": 60, "requests": 20,
                            "max_output_tokens": 4, "prime": "history"}},
        engine_args={**tiny()["engine_args"], "max_model_len": 8192, "kv_cache_memory_bytes": kv_bytes(16384)},
        grid={"max_num_batched_tokens": [2048]}, rounds=2))
    run, summary = measure(plan_of(study), tmp_path / "s1")
    assert summary.status == "ok", summary.reasons
    assert len(run.rounds) == 2
    for rec in run.rounds:
        m = rec.metrics
        assert m["prime_requests"] > 0 and m["prime_errors"] == 0 and m["prime_s"] > 0
        assert m["prime_prompt_tokens"] > 16384  # the history fills the cache: more than it holds
        assert m["prompt_tokens_vs_trace"] == 0.0 and m["prompt_tokens"] == m["trace_prompt_tokens"]
        # priming is outside the round's counters: the queries are the window's prompts alone
        assert m["prefix_cache_queries"] == m["trace_prompt_tokens"]
        # the history's blocks are hit: in the cache model, and in the server the round primed
        assert m["model_prefix_hit_rate"] > m["expected_prefix_hit_rate"]
        assert m["prefix_cache_hit_rate"] > m["expected_prefix_hit_rate"], m
    assert not run.record.warnings or not any("runs off" in w for w in run.record.warnings)
    assert group_gone(run.record.launch.server_pgid)


@pytest.mark.e2e
def test_windows_from_across_the_mooncake_hour_each_primed_with_its_own_history(tmp_path):
    """trace.windows: 2 on the whole Mooncake conversation trace, primed, on a KV cache of
    16k tokens: round r replays window r % 2, primed with that window's history, and
    vLLM's measured hit rate is the cache model's for that window."""
    study = tiny(workload={"kind": "trace", "warmup_requests": 1, "concurrency": 1,
                           "trace": {"file": "mooncake_conversation", "windows": 2, "requests": 12,
                                     "max_output_tokens": 4, "prime": "history"}},
                 engine_args={**tiny()["engine_args"], "max_model_len": 8192, "kv_cache_memory_bytes": kv_bytes(16384)},
                 grid={"max_num_batched_tokens": [2048]}, rounds=2)
    run, summary = measure(plan_of(study), tmp_path / "s1")
    assert summary.status == "ok", summary.reasons
    windows = run.record.trace["windows"]
    assert [w["window"] for w in windows] == [1, 2] and windows[0]["last"] < windows[1]["first"]
    assert [rec.window for rec in run.rounds] == [1, 2]
    for rec, w in zip(run.rounds, windows):
        m = rec.metrics
        assert (rec.window_first, rec.window_last) == (w["first"], w["last"])
        assert m["trace_prompt_tokens"] > 0 and m["prompt_tokens_vs_trace"] == 0.0
        assert m["prime_requests"] > 0 and m["prime_errors"] == 0 and m["prime_prompt_tokens"] > 16384
        assert m["prefix_cache_queries"] == m["trace_prompt_tokens"]  # the window's prompts alone
        assert abs(m["prefix_cache_hit_rate"] - m["model_prefix_hit_rate"]) <= 0.05, (rec.window, m)
    # the two windows are different traffic: their prompts differ
    assert run.rounds[0].metrics["trace_prompt_tokens"] != run.rounds[1].metrics["trace_prompt_tokens"]
    assert group_gone(run.record.launch.server_pgid)
