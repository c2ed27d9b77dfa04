"""The capacity search on a trace window, and what a plain trace run says it could not
replay, through `python -m vllm_study sweep` on the fake engine (tests/fake_engine.py):
the search's steps, its halving below lo and its bracket, the replay's speed and
schedule, and the report's words are the kit's control flow, whatever serves. The fake's
step loop has a token budget, so a load has a knee; its per-token cost is set so that
the SLO is met at 2 x the window's real rate and missed at 32 x and above.
(Hit rates vLLM's cache must reproduce: test_e2e_traces.py, on vLLM; a capacity search
on vLLM: test_e2e_predict_confirm.py.)"""
from __future__ import annotations

import json

import pandas as pd
import pytest
from e2e_support import fake_engine_study, kv_bytes, sweep, tiny, write
from procs import group_gone

from vllm_study.capacity import bracket as capacity
from vllm_study.records import point_capacity
from vllm_study.records.results import RunFolder
from vllm_study.report import capacity_section, report

pytestmark = [pytest.mark.e2e, pytest.mark.fake_engine]

SLO = {"ttft_p90_ms": 1000, "itl_p99_ms": 1000}
# 50 us a scheduled token: a 512-token step takes ~30 ms (the fake sleeps it), ~17k
# prompt tokens/s. The window's ~30 kept requests (~55k prompt tokens over 34 s of real
# time) give a TTFT P90 of ~0.4-0.5 s at 2 x and ~0.8-0.95 s at 4 x; at 8 x and above
# they arrive faster than that and queue (P90 1.3-1.5 s; ~1.7 s at 32 x and 64 x), as
# measured on two loaded cores.
FAKE_SPEED = {"FAKE_ENGINE_TOKEN_S": "0.00005"}

TRACE_STUDY = fake_engine_study(tiny(
    name="e2e-trace-capacity",
    engine_args={"max_model_len": 4096, "enable_prefix_caching": True, "enforce_eager": True,
                 "kv_cache_memory_bytes": kv_bytes(65536)},
    grid={"max_num_batched_tokens": [512]},
    # Azure's code trace: 2k-token prompts and short answers. At 64 x real time its 40
    # requests arrive within 0.6 s and queue for seconds; at 2 x they come ~0.4 s apart.
    workload={"kind": "trace", "trace": {"file": "azure_code", "requests": 40}, "warmup_requests": 2},
    slo=SLO,
    capacity={"over": "speed", "lo": 2, "hi": 64, "precision": 0.25, "max_steps": 5},
    replicates=1), **FAKE_SPEED)


def test_a_capacity_search_on_the_shipped_azure_window(tmp_path):
    results = tmp_path / "results"
    r = sweep(write(tmp_path, TRACE_STUDY), "--results", results)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "a capacity search over speed 2..64" in r.stdout
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
    # max_steps 5, and where lo (2) misses on a loaded machine, up to 3 halvings to the floor (lo / 8)
    below_lo = any(r.load < 2 for r in rounds)
    assert 2 <= len(rounds) <= 5 + (3 if below_lo else 0) and rounds[0].load == 64 and not rounds[0].slo_met
    for rec in rounds:
        met, _ = capacity.meets_slo(rec.metrics, SLO)
        assert rec.slo_met == met, (rec.load, rec.slo_why)
        m = rec.metrics
        # exact prompts: what the server counted (the fake, with the model folder's tokenizer and
        # chat template; vLLM's own count: test_e2e_traces.py) is what the trace says, request by request
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
    assert met and missed, [(r.load, r.slo_met) for r in rounds]
    assert cap.bracket == (max(met), min(missed)) and max(met) < min(missed)
    assert cap.requests_per_s == pytest.approx(cap.load * trace["rate"])
    # the point's estimate is the start's capacity as the report states it (the margins' fit):
    # between the lowest pass and the highest miss. Not always below the lowest miss: two
    # misses near the knee whose margins a loaded machine leaves out of order pool to one
    # knot between them (tests/capacity/test_unit_capacity_fit.py)
    fitted = point_capacity.start_figures(start, run.point(summary.point).start_dir(1), SLO, cap.floor)
    assert min(met) <= fitted["capacity_load"] <= max(missed)
    assert summary.estimates["capacity_rps"].median == pytest.approx(fitted["capacity_rps"])
    # the report answers with the capacity
    nb = json.loads((path / "report.ipynb").read_text())
    text = "".join("".join(o.get("text", "")) for c in nb["cells"] for o in c.get("outputs", []))
    assert f"{summary.point} sustains" in text and "within the SLO" in text
    df = pd.read_csv(run.summary_csv)
    assert df["at_capacity"].sum() == 1 + df[df["at_capacity"] & (df["group"] != "all")].shape[0]
    assert group_gone(start.launch.server_pgid)


def test_a_plain_trace_run_says_what_it_could_not_replay_exactly(tmp_path):
    """A trace study without `capacity:`: a prompt under the chat template's floor and a
    request over max_model_len are said on the console and in the report's fidelity
    section, and trace.max_output_tokens caps the tokens each request asks for (the fake
    generates exactly max_tokens, as vLLM does under the kit's ignore_eos)."""
    import gzip
    rows = [{"t_s": 0.0, "input_tokens": 5, "output_tokens": 30},       # under the chat template's floor
            {"t_s": 0.5, "input_tokens": 300, "output_tokens": 40},
            {"t_s": 1.0, "input_tokens": 2100, "output_tokens": 4},     # over max_model_len 2048
            {"t_s": 1.5, "input_tokens": 200, "output_tokens": 3}]
    f = tmp_path / "trace.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    study = fake_engine_study(tiny(name="e2e-trace-plain", workload={"kind": "trace", "warmup_requests": 1, "trace": {
        "file": str(f), "format": "jsonl", "max_output_tokens": 8}}, rounds=1, replicates=1))
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
# arrive within 1.1 s, ~3 s of prefill on the fake), so the search halves below lo towards
# the floor, 2, where the fake meets the SLO: a halving step meets, and the bracket above
# it is bisected. (A search that misses down to its floor, a bound never 0, in the report
# and export: tests/capacity/test_unit_capacity.py, on committed runs.)
BELOW_LO_STUDY = {**TRACE_STUDY, "name": "e2e-capacity-below-lo",
                  "capacity": {"over": "speed", "lo": 32, "hi": 64, "floor": 2, "precision": 0.5, "max_steps": 2}}


def test_a_capacity_below_lo_is_found_by_halving(tmp_path):
    results = tmp_path / "results"
    # the report notebook of a capacity study: the test above; here its answer, in this process
    r = sweep(write(tmp_path, BELOW_LO_STUDY), "--results", results, "--no-report")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "a capacity search over speed 32..64, halving down to 2 where 32 misses (up to 6 rounds)" in r.stdout
    (path,) = results.iterdir()
    run = RunFolder(path)
    (summary,) = run.summaries()
    assert summary.status == "ok", summary.reasons
    (start,) = run.point(summary.point).starts()
    cap = start.capacity
    rounds = run.point(summary.point).rounds()
    loads = [s["load"] for s in cap.steps]
    assert loads == [r.load for r in rounds] and loads[:2] == [64, 32] and cap.floor == 2
    assert not rounds[1].slo_met, "the premise: lo = 32 misses"
    # below lo: halving (16, 8, ...) until a step meets the SLO, at the floor at the latest
    met = [x for x, rec in zip(loads, rounds) if rec.slo_met]
    assert met, [(r.load, r.slo_met, r.slo_why) for r in rounds]
    j = loads.index(met[0]) + 1  # the halving: up to the first pass
    assert loads[2:j] == [32 / 2 ** k for k in range(1, j - 1)]
    assert len(loads) <= 2 + 4  # max_steps and the halving's log2(32 / 2) steps
    # every step records each bound's margin, as its round measured it against the limit
    for s, rec in zip(cap.steps, rounds):
        assert set(s["margins"]) == set(SLO)
        for bound, limit in SLO.items():
            assert s["margins"][bound] == pytest.approx(rec.metrics[capacity.bound_key(bound, rec.metrics)] / limit)
        assert s["met"] == (max(s["margins"].values()) <= 1 and rec.metrics["failed"] == 0)
    text = capacity_section.capacity_answer(report.Run.load(run))
    # found below lo: a capacity with its bracket, between a pass and the miss above it
    assert cap.censored is None and cap.load == max(met) < 32
    assert cap.bracket[0] == cap.load < cap.bracket[1] <= 32
    assert not any(rec.slo_met for rec in rounds if rec.load >= cap.bracket[1])
    assert f"{summary.point} sustains" in text and "sustains 0.00" not in text
    # judged by the fit of the steps' margins, its interval from the requests kept
    assert ("Capacity: isotonic fit of each step's SLO margins, intervals by bootstrap over requests; starts "
            "combined by an interval-censored likelihood") in text
