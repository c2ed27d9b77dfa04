"""The recommendation never picks a point that did not complete, and never ranks by a
figure the arrival rate fixes (synthetic runs through the kit's own records)."""
from __future__ import annotations

from synthetic_run import make_run
from vllm_study.analysis import decision
from vllm_study.report import report

A, B, C, D = "mbt=256__kv=16MiB", "mbt=256__kv=128MiB", "mbt=512__kv=16MiB", "mbt=512__kv=128MiB"


def _vals(tput: dict[str, float], **extra) -> dict:
    return {p: {"output_throughput": v, "ttft_p90_ms": 300.0, "tpot_p50_ms": 20.0, **extra} for p, v in tput.items()}


def test_a_point_whose_server_died_mid_run_is_left_out_and_named(tmp_path):
    # D would win by far, but its first start's server died in round 2 of 3
    run = make_run(tmp_path, _vals({A: 100.0, B: 200.0, C: 110.0, D: 400.0}), died={D: (1, 1)})
    r = report.Run.load(run.path)
    rec = decision.recommend(r.rounds, r.intervals, {})
    assert rec.point == B
    assert rec.left_out == [f"{D} (partial)"]
    assert "Left out" in rec.text() and D in rec.text()


def test_no_complete_point_is_no_recommendation(tmp_path):
    run = make_run(tmp_path, _vals({A: 100.0, B: 200.0, C: 110.0, D: 400.0}),
                   died={A: (1, 0), B: (2, 2), C: (1, 1), D: (2, 0)})
    r = report.Run.load(run.path)
    rec = decision.recommend(r.rounds, r.intervals, {})
    assert rec.point is None and "sweep --resume" in rec.reason and len(rec.left_out) == 4


def test_open_loop_output_throughput_ranks_nothing(tmp_path):
    # every point served what arrived at 2 req/s: the same tokens/s, set by the rate
    run = make_run(tmp_path, _vals({A: 96.0, B: 96.5, C: 95.8, D: 96.2}, offered_rate=2.0))
    r = report.Run.load(run.path)
    rec = decision.recommend(r.rounds, r.intervals, {})
    assert rec.point is None
    assert "open-loop" in rec.reason and "capacity:" in rec.reason and "slo:" in rec.reason


def test_open_loop_with_an_slo_ranks_by_goodput(tmp_path):
    vals = {p: v | {"goodput": g} for (p, v), g in
            zip(_vals({A: 96.0, B: 96.0, C: 96.0, D: 96.0}, offered_rate=2.0).items(), (1.2, 1.9, 1.0, 0.5))}
    run = make_run(tmp_path, vals, {"slo": {"ttft_p90_ms": 500}})
    r = report.Run.load(run.path)
    rec = decision.recommend(r.rounds, r.intervals, {"ttft_p90_ms": 500})
    assert rec.point == B and rec.metric == "goodput"
