"""The capacity search on SLO functions with a known capacity, the SLO verdict of a
round, and the study checks of `capacity:`."""
from __future__ import annotations

import math

import numpy as np
import pytest

from vllm_study.capacity import bracket as capacity
from vllm_study.define.schema import StudyError
from vllm_study.define.study_file import study_from_dict
from paths import REPO


def _measure(true_capacity: float, log: list[float]):
    """A server whose SLO holds exactly up to true_capacity."""
    def measure(load: float) -> capacity.Step:
        log.append(load)
        met = load <= true_capacity
        return capacity.Step(load, met, "" if met else f"ttft_p90_ms over at {load:g}", round=len(log) - 1)
    return measure


@pytest.mark.parametrize("true_capacity", [1.03, 1.7, 2.5, 3.99, 7.2])
def test_bisection_brackets_a_known_capacity_within_its_precision(true_capacity):
    log: list[float] = []
    rec = capacity.Bracket("speed", 1.0, 8.0, precision=0.05, max_steps=12).run(_measure(true_capacity, log))
    lo, hi = rec.bracket
    assert lo <= true_capacity < hi
    assert hi / lo - 1 <= 0.05
    assert rec.load == lo and rec.censored is None
    # the round measured at the capacity is the step that ran at it
    assert log[rec.at_round] == rec.load
    # a probe at hi, bisections (log2(log(8)/log(1.05)) rounded up), and lo where none met
    planned = 2 + math.ceil(math.log2(math.log(8) / math.log(1.05)))
    assert len(log) <= capacity.planned_steps(1.0, 8.0, 0.05, 12) == planned


def test_max_steps_stops_the_search_with_the_bracket_it_reached():
    log: list[float] = []
    rec = capacity.Bracket("rate", 1.0, 64.0, precision=0.01, max_steps=4).run(_measure(5.0, log))
    assert len(log) == 4
    lo, hi = rec.bracket
    assert lo <= 5.0 < hi and hi / lo > 1.01  # not converged: the bracket says how far it got
    assert rec.load == lo


def test_capacity_below_lo_and_above_hi_are_censored_not_guessed():
    log: list[float] = []
    below = capacity.Bracket("speed", 2.0, 8.0, 0.05, 5).run(_measure(1.0, log))
    assert below.load is None and below.censored == "below" and below.bracket == (0.0, 2.0)
    assert log[0] == 8.0 and log[-1] == 2.0 and len(log) == 5  # lo is kept for the last step
    assert log[below.at_round] == 2.0  # its latencies are the report's "at capacity"
    log.clear()
    above = capacity.Bracket("speed", 2.0, 8.0, 0.05, 8).run(_measure(100.0, log))
    assert above.load == 8.0 and above.censored == "above" and above.bracket == (8.0, None)
    assert log == [8.0]  # the slow low loads are never run


def test_the_search_goes_below_lo_by_halving_and_bisects_the_bracket_it_finds():
    """lo = 2 misses; the capacity (0.7) is found by halving (1 misses, 0.5 meets) and the
    bisection of [0.5, 1] with what the halving left of its three steps."""
    log: list[float] = []
    rec = capacity.Bracket("speed", 2.0, 8.0, 0.05, 5, floor=0.25).run(_measure(0.7, log))
    assert log[0] == 8.0 and log[4] == 2.0  # the probe at hi, ..., lo last among max_steps
    assert log[5:7] == [1.0, 0.5]
    lo, hi = rec.bracket
    assert rec.censored is None and rec.load == lo and 0.5 <= lo <= 0.7 < hi <= 1.0
    assert hi / lo < 2  # the bisection narrowed the halving's bracket
    assert len(log) == 5 + 3 and min(log) >= 0.25  # max_steps and the halving's three steps
    assert log[rec.at_round] == rec.load and rec.floor == 0.25
    # every step below lo is recorded like any other, in order
    assert [s["load"] for s in rec.steps] == log
    assert [s["met"] for s in rec.steps] == [x <= 0.7 for x in log]
    assert capacity.planned_steps(2.0, 8.0, 0.05, 5, floor=0.25) == 5 + 3


def test_a_start_that_misses_at_the_floor_is_a_bound_below_the_floor_never_zero():
    log: list[float] = []
    rec = capacity.Bracket("speed", 2.0, 8.0, 0.05, 5, floor=0.3).run(_measure(0.1, log))
    assert rec.load is None and rec.censored == "below" and rec.bracket == (0.0, 0.3) and rec.floor == 0.3
    assert log[4:] == [2.0, 1.0, 0.5, 0.3]  # halved, the last step clamped to the floor
    assert log[rec.at_round] == 0.3 and all(not s["met"] for s in rec.steps)
    # over concurrency the halving stays on whole numbers
    log.clear()
    rec = capacity.Bracket("concurrency", 8, 64, 0.05, 4, floor=1).run(_measure(0, log))
    assert log[3:] == [8, 4, 2, 1] and rec.bracket == (0.0, 1) and rec.censored == "below"


def test_every_step_records_each_bounds_margin():
    values = {"requests": 10, "completed": 10, "failed": 0, "ttft_p90_ms": 900.0, "ttft_sched_p90_ms": 2500.0,
              "itl_p99_ms": 75.0}
    assert capacity.margins(values, {"ttft_p90_ms": 2000, "itl_p99_ms": 150}) == \
        {"ttft_p90_ms": 1.25, "itl_p99_ms": 0.5}  # judged from the schedule, as meets_slo() does
    assert capacity.margins({"ttft_p90_ms": 10.0}, {"tpot_p50_ms": 20}) == {}  # not measured: no margin
    log: list[float] = []
    measure = _measure(3.0, log)
    rec = capacity.Bracket("rate", 1.0, 8.0, 0.2, 6).run(
        lambda load: capacity.Step(**{**vars(measure(load)), "margins": {"ttft_p90_ms": load / 3.0}}))
    assert [s["margins"] for s in rec.steps] == [{"ttft_p90_ms": x / 3.0} for x in log]
    # a record from before margins and the floor still loads
    old = {"over": "rate", "load": None, "bracket": [0.0, 1.0], "censored": "below", "at_round": 0,
           "steps": [{"load": 1.0, "met": False, "why": "x", "round": 0}]}
    back = capacity.CapacityRecord.model_validate(old)
    assert back.floor is None and "margins" not in back.steps[0]


def test_lo_is_measured_only_when_nothing_above_it_met():
    log: list[float] = []
    rec = capacity.Bracket("speed", 1.0, 8.0, 0.3, 8).run(_measure(1.2, log))
    assert 1.0 in log and rec.load is not None and rec.bracket[0] <= 1.2 < rec.bracket[1]
    log.clear()
    rec = capacity.Bracket("speed", 1.0, 8.0, 0.3, 8).run(_measure(5.0, log))
    assert 1.0 not in log and rec.bracket[0] <= 5.0 < rec.bracket[1]


def test_concurrency_is_searched_in_whole_numbers_until_neighbours():
    log: list[float] = []
    rec = capacity.Bracket("concurrency", 1, 64, precision=0.05, max_steps=20).run(_measure(13, log))
    assert all(float(x).is_integer() for x in log)
    assert rec.bracket == (13, 14) and rec.load == 13


def test_a_failed_step_is_a_miss_and_the_search_goes_on_below_it():
    """Errors at high load (timeouts) must never read as a pass."""
    def measure(load):
        if load > 4:
            return capacity.Step(load, False, "12 of 40 requests failed")
        return capacity.Step(load, True, "")
    rec = capacity.Bracket("rate", 1.0, 16.0, 0.1, 10).run(measure)
    assert rec.load <= 4 < rec.bracket[1]
    assert any("failed" in s["why"] for s in rec.steps)


def test_meets_slo_uses_latency_from_the_schedule_where_the_round_had_one():
    values = {"requests": 10, "completed": 10, "failed": 0, "ttft_p90_ms": 900.0, "ttft_sched_p90_ms": 2500.0,
              "itl_p99_ms": 100.0}
    met, why = capacity.meets_slo(values, {"ttft_p90_ms": 2000, "itl_p99_ms": 150})
    assert not met and "ttft_sched_p90_ms 2500 > 2000" in why
    closed = {k: v for k, v in values.items() if "sched" not in k}
    assert capacity.meets_slo(closed, {"ttft_p90_ms": 2000, "itl_p99_ms": 150}) == (True, "")
    assert capacity.meets_slo({**closed, "failed": 2}, {"ttft_p90_ms": 2000})[0] is False
    assert capacity.meets_slo(closed, {"ttft_p90_ms": 2000}, "the server died") == (False, "the server died")
    met, why = capacity.meets_slo(closed, {"tpot_p50_ms": 20})
    assert not met and "not measured" in why


def _study(**over):
    base = {"name": "c", "grid": {"max_num_batched_tokens": [512]}, "slo": {"ttft_p90_ms": 2000},
            "workload": {"load": {"kind": "poisson", "rate": 2}},
            "capacity": {"over": "rate", "lo": 1, "hi": 8}}
    for k, v in over.items():
        base[k] = v
    return base


def test_capacity_takes_the_study_slo_when_it_names_none():
    s = study_from_dict(_study())
    assert s.capacity.slo == {"ttft_p90_ms": 2000}
    # max_steps, and the halving from lo = 1 down to the default floor lo / 8: three more
    assert s.capacity.floor == 0.125 and s.steps_per_start == 8 + 3


@pytest.mark.parametrize("change, message", [
    ({"slo": {}}, "capacity needs an SLO"),
    ({"capacity": {"over": "rate", "lo": 8, "hi": 2}}, "lo (8) must be below hi (2)"),
    ({"capacity": {"over": "speed", "lo": 1, "hi": 2}}, "needs workload.kind trace"),
    ({"capacity": {"over": "concurrency", "lo": 1, "hi": 2}}, "closed-loop"),
    ({"workload": {}, "capacity": {"over": "concurrency", "lo": 1.5, "hi": 8}}, "whole numbers"),
    ({"capacity": {"over": "rate", "lo": 1, "hi": 8, "slo": {"ttft_p91_ms": 5}}}, "ttft_p91_ms"),
    ({"capacity": {"over": "rate", "lo": 1, "hi": 8, "floor": 2}}, "floor (2) must be above 0 and at most lo (1)"),
    ({"capacity": {"over": "rate", "lo": 1, "hi": 8, "floor": 0}}, "floor (0) must be above 0"),
    ({"workload": {"load": {"kind": "closed", "concurrency": 4}},
      "capacity": {"over": "concurrency", "lo": 4, "hi": 8, "floor": 1.5}}, "floor (1.5) is requests in flight"),
])
def test_bad_capacity_settings_are_refused_with_the_fix(change, message):
    with pytest.raises(StudyError, match=message.replace("(", r"\(").replace(")", r"\)")):
        study_from_dict(_study(**change))


H200_RUN = REPO / "results" / "20261201T153023Z-h200-mooncake-capacity-158c29e"


def test_a_baseline_that_missed_at_the_lowest_load_is_a_bound_not_a_capacity_of_zero():
    """The committed H200 run: vLLM's default (8192, caching on) missed ITL P99 at speed 0.5
    in both starts, so its capacity is below 0.5 x 3.73 req/s and the gain a lower bound."""
    from vllm_study.report import report
    from vllm_study.report import capacity_section
    r = report.Run.load(H200_RUN)
    answer = capacity_section.capacity_answer(r)
    assert "The baseline mbt=8192__pc=on met the SLO at no load tried" in answer
    assert "itl_p99_ms 202 > 150" in answer and "Its capacity is < 1.87 req/s" in answer
    # the gain is a ratio bounded below: the best's interval low (5.28 req/s: its starts' bracket reaches
    # down to that step, where the straight line between two steps cannot say more) over the lowest load's rate
    assert "sustains at least 2.83 x the baseline's capacity (a lower bound" in answer and "0.00 [" not in answer
    assert "a resolved gain" in answer
    table = capacity_section.capacity_table(r)
    assert table.loc["mbt=8192__pc=on", "capacity (req/s)"] == "< 1.87"
    assert table.loc["mbt=8192__pc=on", "capacity (speed)"] == "< 0.5"
    # the margins' fit over each start's steps, not the highest step that met (5.28, the interval's low end)
    assert table.loc["mbt=2048__pc=on", "capacity (req/s)"] == "6.50 [5.28, 7.22]"
    assert answer.splitlines()[-1] == (
        "Capacity: isotonic fit of each step's SLO margins, intervals by bootstrap over requests; starts combined "
        "by an interval-censored likelihood, the start-to-start spread pooled over the run's points (4 degrees of "
        "freedom).")


def test_a_study_whose_every_step_missed_reads_below_lo_never_zero(tmp_path, capsys):
    """lo was too high: every point missed at every load. The answer is a bound, with no
    latencies "at capacity" (they are the missed lowest load's), nothing to freeze, and
    export refuses it (exit 3) with evidence that says so."""
    import sys
    from synthetic_run import make_capacity_run

    from vllm_study import cli
    from vllm_study.report import export
    from vllm_study.report import answer, capacity_section, report
    run = make_capacity_run(tmp_path / "r", {"mbt=256": 1.0, "mbt=512": 1.5}, lo=2.0, hi=8.0)
    r = report.Run.load(run.path)
    said = capacity_section.capacity_answer(r)
    assert said.startswith("Capacity below 2.00 req/s at every point: the SLO (TTFT P90 <= 400 ms) was missed "
                           "at every load measured; lower capacity.lo.")
    md = answer.answer_markdown(r)
    assert "0.00" not in md and "At its capacity" not in md and "export" not in md
    assert answer.best_point(r) is None
    table = capacity_section.capacity_table(r)
    assert set(table["capacity (req/s)"]) == {"< 2.00"} and set(table["capacity (rate)"]) == {"< 2"}
    assert set(table["TTFT P90 from schedule (ms) at capacity"]) == {"-"}
    # benchmarks/capacity_table.py prints the same answer and table
    sys.path.insert(0, str(REPO / "benchmarks"))
    import capacity_table
    sys.argv = ["capacity_table.py", str(run.path)]
    assert capacity_table.main() == 0
    out = capsys.readouterr().out
    assert "Capacity below 2.00 req/s" in out and "sustains 0.00" not in out
    assert cli.main(["export", str(run.path), "--best", "--out", str(tmp_path / "o")]) == 2
    assert "no point to export: Capacity below 2.00 req/s" in capsys.readouterr().err
    e = export.export_point(run.path, "mbt=512", tmp_path / "o")
    note = e.notes.read_text()
    assert "| capacity (req/s) | < 2.00 |" in note and "0.00" not in note and "status: ok" not in note
    assert "status: missed the SLO at every load measured" in note
    assert e.shortfall.startswith("the SLO was missed at every load measured (capacity < 2.00 req/s)")
    assert cli.main(["export", str(run.path), "--point", "mbt=512", "--out", str(tmp_path / "o")]) == 3


def test_the_best_capacity_exports_with_exit_0_though_its_latency_at_capacity_straddles_the_bound(tmp_path,
                                                                                                   capsys):
    """A capacity study's SLO verdict is its capacity: at the capacity load each latency
    sits at its bound by construction, so its interval there straddles the bound (here
    TTFT P90 379 [358, 401] against 400) and says nothing about meeting it. --best
    exports with exit 0 and the study's capacity.slo; an SLO given with --slo is judged
    on those latencies as before; a capacity not resolved is exit 3."""
    from synthetic_run import make_capacity_run

    from vllm_study import cli
    from vllm_study.report import export, report
    run = make_capacity_run(tmp_path / "r", {"mbt=256": 3.0, "mbt=512": (5.0, 6.0)}, lo=2.0, hi=8.0)
    iv = report.Run.load(run.path).interval("mbt=512", "ttft_p90_ms")
    assert iv["ci_low"] < 400 < iv["ci_high"]   # straddles: a plain study's export would say not resolved
    assert cli.main(["export", str(run.path), "--best", "--out", str(tmp_path / "o")]) == 0
    e = export.export_point(run.path, None, tmp_path / "o")
    assert e.point == "mbt=512" and e.shortfall is None and e.by_capacity and e.slo == {"ttft_p90_ms": 400}
    assert "- SLO: ttft_p90_ms <= 400" in e.notes.read_text()
    capsys.readouterr()
    assert cli.main(["export", str(run.path), "--best", "--slo", "ttft_p90_ms=390", "--out",
                     str(tmp_path / "o")]) == 3
    assert "does not surely meet the SLO given with --slo" in capsys.readouterr().err
    split = make_capacity_run(tmp_path / "u", {"mbt=256": (1.0, 100.0), "mbt=512": 3.0}, lo=2.0, hi=8.0)
    assert report.Run.load(split.path).capacity("mbt=256").config.kind == "unresolved"
    assert cli.main(["export", str(split.path), "--point", "mbt=256", "--out", str(tmp_path / "o")]) == 3
    assert ("does not surely meet the study's capacity.slo (judged by its capacity): its capacity is "
            "unresolved") in capsys.readouterr().err


def test_a_study_below_its_floor_reads_below_the_floor_and_one_above_it_gets_a_number(tmp_path):
    """Halving from lo = 2 to floor 0.25: mbt=256 (capacity 0.1) is "below 0.25", never 0;
    mbt=512 (capacity 0.7) has a capacity found below lo."""
    from synthetic_run import make_capacity_run

    from vllm_study.report import capacity_section, report
    run = make_capacity_run(tmp_path / "r", {"mbt=256": 0.1, "mbt=512": 0.7}, lo=2.0, hi=8.0, floor=0.25)
    r = report.Run.load(run.path)
    table = capacity_section.capacity_table(r)
    assert table.loc["mbt=256", "capacity (req/s)"] == "< 0.25"
    assert table.loc["mbt=256", "capacity (rate)"] == "< 0.25"
    cell = table.loc["mbt=512", "capacity (req/s)"]
    assert not cell.startswith("<") and 0.5 <= float(cell.split()[0]) <= 0.7
    answer = capacity_section.capacity_answer(r)
    assert answer.startswith("mbt=512 sustains 0.") and "0.00 [" not in answer
    assert capacity_section.below_lowest_load(r, "mbt=256") == "< 0.25"
    all_below = make_capacity_run(tmp_path / "b", {"mbt=256": 0.1, "mbt=512": 0.2}, lo=2.0, hi=8.0, floor=0.25)
    said = capacity_section.capacity_answer(report.Run.load(all_below.path))
    assert said.startswith("Capacity below 0.25 req/s at every point") and "lower capacity.floor.\n" in said


def test_a_start_that_met_the_slo_at_hi_is_at_least_hi(tmp_path):
    from synthetic_run import make_capacity_run

    from vllm_study.report import export
    from vllm_study.report import capacity_section, report
    run = make_capacity_run(tmp_path / "r", {"mbt=256": 3.0, "mbt=512": 100.0}, lo=2.0, hi=8.0)
    r = report.Run.load(run.path)
    answer = capacity_section.capacity_answer(r)
    assert answer.startswith("mbt=512 sustains at least 8.00 req/s within the SLO")
    assert "raise capacity.hi" in answer and "At its capacity" not in answer and "8.00 [" not in answer
    table = capacity_section.capacity_table(r)
    assert table.loc["mbt=512", "capacity (req/s)"] == "≥ 8.00"
    assert table.loc["mbt=512", "capacity (rate)"] == "≥ 8"
    # the fit of the steps' margins crosses 1 at the true capacity, 3: the highest step that met was 2.83
    assert table.loc["mbt=256", "capacity (req/s)"].startswith("3.00 [")
    note = export.export_point(run.path, None, tmp_path / "o").notes.read_text()
    assert "| capacity (req/s) | ≥ 8.00 |" in note


def test_the_console_table_of_a_capacity_study_leads_with_capacity_and_bracket(tmp_path, capsys):
    from synthetic_run import make_capacity_run

    from vllm_study import cli
    from vllm_study.report import report
    run = make_capacity_run(tmp_path / "r", {"mbt=256": 3.0, "mbt=512": 5.0}, lo=2.0, hi=8.0)
    assert cli._conclude(run) == 0
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if "status" in line).split()
    assert header[:5] == ["status", "capacity", "(req/s)", "rate", "bracket"], header
    row = next(line for line in out.splitlines() if line.startswith("mbt=256 "))
    assert "3.00 [" in row and "s1: [2.83, 3.08]" in row
    # the committed H200 search, as its sweep and report end
    t = report.short_table(report.Run.load(H200_RUN))
    assert list(t.columns[:3]) == ["status", "capacity (req/s)", "speed bracket per start"]
    assert t.loc["mbt=2048__pc=on", "capacity (req/s)"].startswith("6.50 [")
    assert t.loc["mbt=8192__pc=on", "capacity (req/s)"] == "< 1.87"


def test_a_capacity_study_draws_no_pareto_fronts_across_loads_and_says_why(tmp_path, capsys):
    """Each point's figures come from its own capacity step: the committed H200 search's
    fronts were vLLM's defaults, measured at the lowest load, where they missed the SLO."""
    import matplotlib
    matplotlib.use("Agg")
    from synthetic_run import make_capacity_run

    from vllm_study import notebook_support as ns
    from vllm_study.report import report
    for r in (report.Run.load(H200_RUN), report.Run.load(make_capacity_run(tmp_path / "r", {"mbt=256": 3.0,
                                                                                            "mbt=512": 5.0}).path)):
        figures = r.folder.path / "figures" / "pareto.png"
        before = figures.stat().st_mtime if figures.exists() else None
        ns.pareto_figure(r)
        assert "No Pareto fronts in a capacity study" in capsys.readouterr().out
        assert ns.pareto(r) is None and ns.pareto_points(r) is None
        assert "different loads" in capsys.readouterr().out
        assert (figures.stat().st_mtime if figures.exists() else None) == before  # nothing drawn


def test_confirm_until_resolved_is_shown_by_the_dry_run(tmp_path, capsys):
    import json

    from vllm_study.sweep import dry_run
    study = _study(grid={"max_num_batched_tokens": [512, 1024]}, baseline="mbt=512", replicates=2,
                   confirm={"until": "resolved", "max_starts": 6})
    s = study_from_dict(study)
    assert s.confirm.max_starts == 6 and s.replicates == 2
    f = tmp_path / "s.yaml"
    f.write_text(json.dumps(study))  # JSON is YAML
    dry_run([str(f)], "cpu")
    out = capsys.readouterr().out
    assert ("confirm until resolved: then the best, the runner-up and mbt=512 again, one fresh start each per "
            "shuffled block, until the best's gain over mbt=512 and over the runner-up are resolved (95% "
            "interval excludes 1) or each has 6 starts: at most 12 more starts (not in the estimate)") in out
    assert "Planned only" not in out   # a grid study runs it (tests/analysis/test_unit_confirm.py)


@pytest.mark.parametrize("change, message", [
    ({"capacity": None, "confirm": {"max_starts": 4}}, "confirm: resolves the best config's capacity"),
    ({"confirm": {"max_starts": 4}}, "name one with `baseline:`"),
    ({"baseline": "mbt=512", "replicates": 2, "confirm": {"max_starts": 2}},
     "confirm.max_starts (2) must exceed the starts each point has already (replicates: 2)"),
    ({"baseline": "mbt=512", "confirm": {"until": "forever", "max_starts": 4}}, "until"),
])
def test_bad_confirm_settings_are_refused_with_the_fix(change, message):
    with pytest.raises((StudyError, ValueError), match=message.replace("(", r"\(").replace(")", r"\)")):
        study_from_dict(_study(**change))


def test_probing_lo_first_ends_a_start_that_misses_everywhere_in_one_step_and_finds_the_same_bracket():
    log: list[float] = []
    below = capacity.Bracket("speed", 1.0, 3.0, 0.15, 4, probe="lo").run(_measure(0.5, log))
    assert log == [1.0] and below.censored == "below" and below.load is None and below.bracket == (0.0, 1.0)
    log.clear()
    lower = capacity.Bracket("speed", 1.0, 3.0, 0.15, 4, floor=0.25, probe="lo").run(_measure(0.6, log))
    assert log[:2] == [1.0, 0.5] and lower.censored is None and len(log) <= 4 + 2
    assert lower.bracket[0] <= 0.6 < lower.bracket[1] <= 1.0   # halved below lo, then bisected
    log.clear()
    inside = capacity.Bracket("speed", 1.0, 3.0, 0.15, 4, probe="lo").run(_measure(1.7, log))
    assert log[:2] == [1.0, 3.0] and len(log) == 4   # lo met, hi missed, then the bisection
    hi_first = capacity.Bracket("speed", 1.0, 3.0, 0.15, 4).run(_measure(1.7, []))
    assert inside.bracket[0] <= 1.7 < inside.bracket[1] and hi_first.bracket[0] <= 1.7 < hi_first.bracket[1]
    log.clear()
    above = capacity.Bracket("speed", 1.0, 3.0, 0.15, 4, probe="lo").run(_measure(9.0, log))
    assert log == [1.0, 3.0] and above.censored == "above"


def test_a_capacity_from_one_start_says_its_interval_is_within_that_start(tmp_path):
    """With one start a point and nothing pooled, no restart has measured how far a
    capacity moves: the statistic's sentence names the points whose interval is the start's."""
    from synthetic_run import make_capacity_run

    from vllm_study.report import capacity_section, report
    one = make_capacity_run(tmp_path / "one", {"mbt=256": 3.0, "mbt=512": 5.0}, lo=2.0, hi=8.0,
                            study_over={"replicates": 1})
    sentence = capacity_section.statistic_sentence(report.Run.load(one))
    assert sentence.endswith(" mbt=256, mbt=512: one start, so their intervals are within that start "
                             "(no start-to-start spread measured)."), sentence
    two = make_capacity_run(tmp_path / "two", {"mbt=256": (3.0, 3.2), "mbt=512": (5.0, 5.5)}, lo=2.0, hi=8.0)
    assert "one start" not in capacity_section.statistic_sentence(report.Run.load(two))


def test_capacitys_noise_floor_is_its_fitted_starts_spread_raw_beside_corrected():
    """Three starts read 2.59, 3.18 and 2.95: their spread is 10.4%, never '0.0%'. Less each
    start's bootstrap noise (16% here) nothing is left, which the table says in words; with
    tighter starts (3%) the corrected spread is stated beside the raw one."""
    from vllm_study.capacity.fit import StartCapacity
    from vllm_study.capacity.estimate import start_spread

    def starts(se):
        return [StartCapacity(kind="value", value=v, lowest=1, highest=16, log_se=se) for v in (2.59, 3.18, 2.95)]
    loose = start_spread([starts(0.16)])
    assert loose.df == 2 and loose.raw == pytest.approx(np.std(np.log([2.59, 3.18, 2.95]), ddof=1))
    assert loose.corrected is None
    tight = start_spread([starts(0.03)])
    assert tight.corrected == pytest.approx(math.sqrt(tight.raw ** 2 - 0.03 ** 2))


def test_the_committed_steady_runs_noise_floor_gives_capacitys_spread_not_zero():
    """The H200 steady run: its starts' highest loads that met were equal (the old row read
    start-to-start 0.0%); the fitted capacities differ by 0.8%, within their bootstrap's noise."""
    from vllm_study.report import report
    r = report.Run.load(REPO / "results" /
                        "20261204T042255Z-h200-mooncake-steady-capacity-e55d74e")
    row = report.noise_table(r).loc["capacity (req/s)", "summary"]
    assert row.startswith("start-to-start 0.8% (df 4) between the fitted capacities")
    assert "within each start's bootstrap noise (4.1%)" in row and "0.0%" not in row
