"""The recommendation never picks a point that did not complete, never ranks by a
figure the arrival rate fixes, and in a capacity study ranks records.point_capacity's
estimates, as the capacity table and export do (synthetic runs through the kit's own records)."""
from __future__ import annotations

import pytest
from synthetic_run import make_run
from vllm_study.analysis import decision
from vllm_study.report import export, report

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


# -- a capacity study: ranked by records.point_capacity's estimates -----------------
def _capacity(tmp_path, caps: dict, floor: float | None = None):
    from synthetic_run import make_capacity_run
    run = make_capacity_run(tmp_path / "r", caps, lo=2.0, hi=8.0, floor=floor)
    r = report.Run.load(run.path)
    return run, r, decision.recommend(r.rounds, r.intervals, {}, r.capacities)


def test_a_capacity_study_names_the_highest_fitted_capacity_not_the_highest_step_that_met(tmp_path):
    """2.95 and 3.05 req/s: every start's highest passing step is 2.83, so the rounds'
    per-start figures tie (and named 2.95's point); the margins' fit names 3.05's. Both
    bracket [2.83, 3.08], and monotonicity alone puts either capacity anywhere in it, so
    the study does not tell them apart (capacity.fit.within_bracket)."""
    from vllm_study.report import answer, capacity_section
    run, r, rec = _capacity(tmp_path, {"mbt=256": 2.95, "mbt=512": 3.05})
    assert set(r.rounds.loc[r.rounds["at_capacity"] == True, "capacity_rps"].round(2)) == {2.83}  # noqa: E712
    assert rec.point == "mbt=512" and rec.runner_up == "mbt=256" and rec.tied == ["mbt=256"]
    best = r.capacity("mbt=512")
    assert rec.metric == "capacity_rps" and rec.value == pytest.approx(best.config.value)
    assert (rec.low, rec.high) == (pytest.approx(best.config.low), pytest.approx(best.config.high))
    assert best.cell() == "3.05 [2.83, 3.08]"
    assert rec.text().startswith(f"Run mbt=512: capacity {best.cell()} req/s (the highest capacity within the SLO).")
    assert "Not told apart from it by this study: mbt=256." in rec.text()
    assert answer.best_point(r) == capacity_section.best_capacity(r) == rec.point
    e = export.export_point(run.path, None, tmp_path / "o")
    assert e.point == "mbt=512"


def test_a_censored_start_weighs_as_a_bound_not_as_a_missing_start(tmp_path):
    """mbt=256's first start missed even at the floor (0.25), its second sustained 5: the
    rounds' per-start figures kept only the 5 (and named it); as a bound below 0.25 the
    combined capacity falls below mbt=512's steady 3, with too wide an interval to tell apart."""
    _, r, rec = _capacity(tmp_path, {"mbt=256": (0.1, 5.0), "mbt=512": 3.0}, floor=0.25)
    assert r.capacity("mbt=256").config.censored == 1
    assert r.capacity("mbt=256").config.value < r.capacity("mbt=512").config.value
    assert rec.point == "mbt=512" and rec.tied == ["mbt=256"] and rec.runner_up == "mbt=256"
    assert "Not told apart from it by this study: mbt=256." in rec.text()


def test_a_capacity_below_the_lowest_load_ranks_below_every_estimate_and_is_never_a_tie(tmp_path):
    _, r, rec = _capacity(tmp_path, {"mbt=256": 0.1, "mbt=512": 3.0}, floor=0.25)
    assert r.capacity("mbt=256").cell() == "< 0.25"
    assert rec.point == "mbt=512" and rec.tied == [] and rec.runner_up == "mbt=256"
    assert rec.trade.startswith("capacity at most ") and "(worse)" in rec.trade.split(";")[0]


def test_no_recommendation_where_every_capacity_is_below_its_lowest_load(tmp_path):
    from vllm_study.report import answer, capacity_section
    _, r, rec = _capacity(tmp_path, {"mbt=256": 0.1, "mbt=512": 0.2}, floor=0.25)
    assert rec.point is None and "below its lowest load" in rec.reason and "capacity.lo" in rec.reason
    assert answer.best_point(r) is None and capacity_section.best_capacity(r) is None
    assert answer.answer_text(r).startswith("Capacity below")


def test_a_capacity_study_without_its_capacities_is_refused_with_the_fix(tmp_path):
    _, r, _ = _capacity(tmp_path, {"mbt=256": 2.0, "mbt=512": 3.0})
    with pytest.raises(ValueError, match="capacities=run.capacities"):
        decision.recommend(r.rounds, r.intervals, {})


# -- what an SLO verdict rests on ---------------------------------------------------
def _with_goodput(tput: dict[str, float], goodput: tuple[float, ...], **extra) -> dict:
    return {p: v | {"goodput": g} for (p, v), g in zip(_vals(tput, **extra).items(), goodput)}


def test_a_point_with_failed_requests_never_surely_meets_the_slo(tmp_path):
    """D's completed requests meet the SLO and it has the most goodput, but 4 of every
    round's 16 requests failed: its latencies leave them out, so it is not said to meet."""
    vals = _with_goodput({A: 100.0, B: 200.0, C: 110.0, D: 400.0}, (1.0, 2.0, 1.1, 4.0))
    run = make_run(tmp_path, vals, {"slo": {"ttft_p90_ms": 500}}, counts={D: {"failed": [4.0]}})
    r = report.Run.load(run.path)
    assert decision.failed_requests(r.rounds) == {D: 4 * 3 * 2}  # 3 rounds x 2 starts
    verdicts = r.slo_verdicts()
    assert verdicts.at[D, "SLO"] == "not resolved" and verdicts.at[B, "SLO"] == "meets"
    assert r.recommendation().point == B
    assert "24 of its requests failed" in export.slo_shortfall(r, D, r.slo)
    assert export.slo_shortfall(r, B, r.slo) is None


def test_a_value_without_an_interval_misses_but_never_surely_meets(tmp_path):
    """One start of one round: nothing measured a spread. Over the bound is a miss; under
    it is not resolved, as one measurement cannot show the point meets it."""
    vals = _vals({A: 100.0, B: 200.0, C: 110.0, D: 400.0})
    vals[D]["ttft_p90_ms"] = 900.0
    run = make_run(tmp_path, vals, {"slo": {"ttft_p90_ms": 500}, "rounds": 1, "replicates": 1})
    r = report.Run.load(run.path)
    assert r.intervals.query("metric == 'ttft_p90_ms'")["ci_low"].isna().all()
    verdicts = r.slo_verdicts()
    assert verdicts.at[D, "SLO"] == "misses" and (verdicts.drop(D)["SLO"] == "not resolved").all()
    rec = r.recommendation()
    assert rec.point == B and "none meets it with certainty" in rec.reason
    assert "ttft_p90_ms <= 500: not resolved" in export.slo_shortfall(r, B, r.slo)


def test_an_slo_given_at_report_time_does_not_rank_by_goodput_counted_under_the_studys(tmp_path):
    """Goodput was counted against the study's 500 ms at measurement time; under 2000 ms
    every point meets, and D, whose requests mostly missed 500 ms, serves the most."""
    vals = _with_goodput({A: 100.0, B: 200.0, C: 110.0, D: 400.0}, (1.0, 3.0, 1.1, 0.5))
    run = make_run(tmp_path, vals, {"slo": {"ttft_p90_ms": 500}})
    assert report.Run.load(run.path).recommendation().point == B   # the study's own SLO: its goodput
    rec = report.Run.load(run.path, {"ttft_p90_ms": 2000}).recommendation()
    assert rec.point == D and rec.metric == "output_throughput"
    assert "goodput was counted under the study's own SLO" in rec.reason
