"""Trace replay and the capacity search against a real vLLM (the CPU build): the shipped
Azure window replayed at a searched speed, and a trace with prefix blocks whose hit
rate vLLM must reproduce."""
from __future__ import annotations

import json

import pandas as pd
import pytest
from e2e_support import UNI, kv_bytes, measure, plan_of, sweep, tiny, write
from procs import group_gone

from vllm_study.capacity import bracket as capacity
from vllm_study.records import point_capacity
from vllm_study.records.results import RunFolder

SLO = {"ttft_p90_ms": 500, "itl_p99_ms": 1000}

TRACE_STUDY = tiny(
    name="e2e-trace-capacity",
    engine_args={"max_model_len": 4096, "enable_prefix_caching": True, "enforce_eager": True,
                 "kv_cache_memory_bytes": kv_bytes(65536)},
    grid={"max_num_batched_tokens": [512]},
    # Azure's code trace: 2k-token prompts and short answers. At 64 x real time its 40
    # requests arrive within 0.3 s, ~70k prompt tokens that keep TTFT P90 above 0.5 s even
    # on a fast CPU; at 0.5 x they come one at a time, ~0.1 s each on two slow cores.
    workload={"kind": "trace", "trace": {"file": "azure_code", "requests": 40}, "warmup_requests": 2},
    slo=SLO,
    capacity={"over": "speed", "lo": 0.5, "hi": 64, "precision": 0.25, "max_steps": 5},
    replicates=1, server={"extra_cli_args": UNI})


@pytest.mark.e2e
def test_a_capacity_search_on_the_shipped_azure_window(tmp_path):
    results = tmp_path / "results"
    r = sweep(write(tmp_path, TRACE_STUDY), "--results", results)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "a capacity search over speed 0.5..64" in r.stdout
    (path,) = results.iterdir()
    run = RunFolder(path)
    (summary,) = run.summaries()
    assert summary.status == "ok", summary.reasons
    (start,) = run.point(summary.point).starts()
    cap, trace = start.capacity, start.trace
    rounds = run.point(summary.point).rounds()

    # the window: 40 requests of the shipped trace, those over max_model_len left out and counted
    assert trace["format"] == "azure" and trace["requests"] + trace["dropped_over_max_model_len"] == 40
    assert trace["dropped_over_max_model_len"] > 0 and trace["rate"] > 0

    # every step is a round on disk with its load and verdict, and the verdict follows the SLO
    assert [s["load"] for s in cap.steps] == [r.load for r in rounds]
    # max_steps 5, and where lo (0.5) misses on a loaded machine, up to 3 halvings to the floor (lo / 8)
    below_lo = any(r.load < 0.5 for r in rounds)
    assert 2 <= len(rounds) <= 5 + (3 if below_lo else 0) and rounds[0].load == 64 and not rounds[0].slo_met
    for rec in rounds:
        met, _ = capacity.judge(rec.metrics, SLO)
        assert rec.slo_met == met, (rec.load, rec.slo_why)
        m = rec.metrics
        # exact prompts: what vLLM counted is what the trace says, request by request
        assert m["prompt_tokens_vs_trace"] == 0.0
        assert m["prompt_tokens"] == m["trace_prompt_tokens"]
        # latency from the schedule is the latency from the send plus the send's lateness (a
        # request is not sent before it is due: asyncio may wake a clock tick early, hence
        # the 1 ms), so it is at least the latter and at most the worst lateness above it
        assert -1 <= m["send_lateness_p50_ms"] <= m["send_lateness_p99_ms"] <= m["send_lateness_max_ms"]
        assert m["ttft_p90_ms"] - 1 <= m["ttft_sched_p90_ms"] <= m["ttft_p90_ms"] + m["send_lateness_max_ms"] + 1
        # the offered rate is the trace's real rate times the step's speed
        assert m["offered_rate"] == pytest.approx(trace["rate"] * rec.load, rel=1e-6)
    # the capacity is the highest load that met, below the lowest that missed
    met = [r.load for r in rounds if r.slo_met]
    missed = [r.load for r in rounds if not r.slo_met]
    assert cap.load == (max(met) if met else None)
    if met and missed:
        assert cap.bracket == (max(met), min(missed)) and max(met) < min(missed)
        assert cap.requests_per_s == pytest.approx(cap.load * trace["rate"])
        # the point's estimate is the start's capacity as the report states it (the margins' fit)
        fitted = point_capacity.start_figures(start, run.point(summary.point).start_dir(1), SLO, 0.5)
        assert max(met) <= fitted["capacity_load"] <= min(missed)
        assert summary.estimates["capacity_rps"].median == pytest.approx(fitted["capacity_rps"])
    # the report answers with the capacity
    nb = json.loads((path / "report.ipynb").read_text())
    text = "".join("".join(o.get("text", "")) for c in nb["cells"] for o in c.get("outputs", []))
    assert f"{summary.point} sustains" in text and "within the SLO" in text
    df = pd.read_csv(run.summary_csv)
    assert df["at_capacity"].sum() == 1 + df[df["at_capacity"] & (df["group"] != "all")].shape[0]
    assert group_gone(start.launch.server_pgid)


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
def test_a_plain_trace_run_says_what_it_could_not_replay_exactly(tmp_path):
    """A trace study without `capacity:`: a prompt under the chat template's floor and a
    request over max_model_len are said on the console and in the report's fidelity
    section, and trace.max_output_tokens caps what vLLM generates."""
    import gzip
    rows = [{"t_s": 0.0, "input_tokens": 5, "output_tokens": 30},       # under the chat template's floor
            {"t_s": 0.5, "input_tokens": 300, "output_tokens": 40},
            {"t_s": 1.0, "input_tokens": 2100, "output_tokens": 4},     # over max_model_len 2048
            {"t_s": 1.5, "input_tokens": 200, "output_tokens": 3}]
    f = tmp_path / "trace.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    study = tiny(name="e2e-trace-plain", workload={"kind": "trace", "warmup_requests": 1, "trace": {
        "file": str(f), "format": "jsonl", "max_output_tokens": 8}}, rounds=1, replicates=1)
    results = tmp_path / "results"
    r = sweep(write(tmp_path, study), "--results", results)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "chat template: 1 of 4 trace prompts are shorter than the chat template's floor of " in r.stdout
    assert "1 of 4 trace requests are longer than max_model_len=2048" in r.stdout
    (path,) = results.iterdir()
    run = RunFolder(path)
    (summary,) = run.summaries()
    assert summary.status == "ok", summary.reasons
    (start,) = run.point(summary.point).starts()
    floor = start.trace["prompt_floor"]
    assert start.trace["inexact"] == 1 and start.trace["requests"] == 3 and floor > 5
    with gzip.open(run.point(summary.point).start_dir(1) / "requests.jsonl.gz", "rt") as g:
        sent = sorted((json.loads(line) for line in g), key=lambda q: q["index"])
    assert [(q["prompt_tokens"], q["output_tokens"]) for q in sent] == [(floor, 8), (300, 8), (200, 3)]
    nb = json.loads((path / "report.ipynb").read_text())
    text = "".join("".join(o.get("text", "")) for c in nb["cells"] for o in c.get("outputs", []))
    assert "3 requests kept, 1 longer than max_model_len=2048 left out" in text
    # out of the trace's 4 rows, as the sweep said before it started (not of the 3 kept)
    assert f"warning: 1 of 4 trace prompts are shorter than the chat template's floor of {floor} tokens" in text


# The same window searched from far too high a lo: 32 x real time misses (its 40 requests
# arrive within 0.6 s, seconds of prefill on a CPU), so the search halves below lo towards
# the floor; the capacity the shipped study finds on a CPU lies below 32.
BELOW_LO_STUDY = {**TRACE_STUDY, "name": "e2e-capacity-below-lo",
                  "capacity": {"over": "speed", "lo": 32, "hi": 64, "floor": 0.5, "precision": 0.5, "max_steps": 2}}


@pytest.mark.e2e
def test_a_capacity_below_lo_is_found_by_halving_or_stated_as_a_bound(tmp_path):
    results = tmp_path / "results"
    r = sweep(write(tmp_path, BELOW_LO_STUDY), "--results", results)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "a capacity search over speed 32..64, halving down to 0.5 where 32 misses (up to 8 rounds)" in r.stdout
    (path,) = results.iterdir()
    run = RunFolder(path)
    (summary,) = run.summaries()
    assert summary.status == "ok", summary.reasons
    (start,) = run.point(summary.point).starts()
    cap = start.capacity
    rounds = run.point(summary.point).rounds()
    loads = [s["load"] for s in cap.steps]
    assert loads == [r.load for r in rounds] and loads[:2] == [64, 32] and cap.floor == 0.5
    assert not rounds[1].slo_met, "the premise: lo = 32 misses on this machine"
    # below lo: halving (16, 8, ...) until a step meets the SLO or the floor misses
    met = [x for x, rec in zip(loads, rounds) if rec.slo_met]
    j = loads.index(met[0]) + 1 if met else len(loads)  # the halving: up to the first pass
    assert loads[2:j] == [32 / 2 ** k for k in range(1, j - 1)]
    assert len(loads) <= 2 + 6  # max_steps and the halving's log2(32 / 0.5) steps
    # every step records each bound's margin, as its round measured it against the limit
    for s, rec in zip(cap.steps, rounds):
        assert set(s["margins"]) == set(SLO)
        for bound, limit in SLO.items():
            assert s["margins"][bound] == pytest.approx(rec.metrics[capacity.bound_key(bound, rec.metrics)] / limit)
        assert s["met"] == (max(s["margins"].values()) <= 1 and rec.metrics["failed"] == 0)
    nb = json.loads((path / "report.ipynb").read_text())
    text = "".join("".join(o.get("text", "")) for c in nb["cells"] for o in c.get("outputs", []))
    if met:  # found below lo: a capacity with its bracket, between a pass and the miss above it
        assert cap.censored is None and cap.load == max(met) < 32
        assert cap.bracket[0] == cap.load < cap.bracket[1] <= 32
        assert not any(rec.slo_met for rec in rounds if rec.load >= cap.bracket[1])
        assert f"{summary.point} sustains" in text and "sustains 0.00" not in text
    else:  # missed at the floor: a bound, never 0
        assert cap.censored == "below" and cap.load is None and loads[-1] == 0.5
        assert "Capacity below" in text and "0.5 x the trace's real rate" in text
    # judged by the fit of the steps' margins, its interval from the requests kept
    assert ("Capacity: isotonic fit of each step's SLO margins, intervals by bootstrap over requests; starts "
            "combined by an interval-censored likelihood") in text


@pytest.mark.e2e
def test_a_primed_mooncake_window_hits_what_the_cache_model_predicts(tmp_path):
    """trace.prime: history on the shipped Mooncake window, on a KV cache of 16k tokens
    (two of its longer prompts): each round is first primed with the traffic before the
    window that fits the cache, and vLLM's measured hit rate is the cache model's."""
    study = tiny(workload={"kind": "trace", "warmup_requests": 1, "concurrency": 1,
                           "trace": {"file": "mooncake_conversation", "start_s": 60, "requests": 20,
                                     "max_output_tokens": 4, "prime": "history"}},
                 engine_args={**tiny()["engine_args"], "max_model_len": 8192, "kv_cache_memory_bytes": kv_bytes(16384)},
                 grid={"max_num_batched_tokens": [2048]}, rounds=2)
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
        assert abs(m["prefix_cache_hit_rate"] - m["model_prefix_hit_rate"]) <= 0.05, m
        assert m["model_prefix_hit_rate"] > m["expected_prefix_hit_rate"]  # the history's blocks are hit
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
