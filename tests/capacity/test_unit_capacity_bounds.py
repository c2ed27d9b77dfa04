"""A start that missed the SLO even at its lowest load has a capacity below that load: a
bound in every table, answer, figure, comparison, export and search objective, never 0;
a point's capacity is records.point_capacity's fit over its starts."""
from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np
import pytest

from synthetic_run import make_capacity_run
from paths import REPO


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """Halving from lo = 2 down to floor 0.25: mbt=256 misses at the floor in start 1
    (capacity 0.1) and sustains 0.7 in start 2; mbt=512 sustains 3 in both."""
    return make_capacity_run(tmp_path_factory.mktemp("r"), {"mbt=256": (0.1, 0.7), "mbt=512": 3.0},
                             lo=2.0, hi=8.0, floor=0.25)


def test_the_rounds_and_summaries_hold_no_zero_for_a_censored_start(run):
    df = run.rounds_table()
    at = df[(df["group"] == "all") & (df["at_capacity"] == True)]  # noqa: E712
    censored = at[(at["point"] == "mbt=256") & (at["start"] == 1)]
    assert len(censored) == 1 and censored["capacity_rps"].isna().all() and censored["capacity_load"].isna().all()
    assert (at["capacity_rps"].dropna() > 0).all()
    s = run.point("mbt=256").summary()
    est = s.estimates["capacity_rps"]
    assert est.starts == 1 and 0.5 <= est.median <= 0.7        # the resolved start only (its highest met)
    assert s.capacity_below == [{"start": 1, "capacity_load": 0.25, "capacity_rps": 0.25}]


def test_a_run_saved_with_zeros_reads_them_as_no_value(run, tmp_path):
    """summary.csv of runs written before: 0 for a start below its lowest load."""
    import shutil

    from vllm_study.report import report
    copy = Path(shutil.copytree(run.path, tmp_path / run.path.name))
    df = report.Run.load(copy).rounds
    text = (copy / "summary.csv").read_text().replace(",,", ",0.0,")  # crude: a 0 where the CSV had none
    assert "0.0" in text
    old = df.copy()
    old.loc[old["capacity_rps"].isna() & (old["at_capacity"] == True), ["capacity_rps", "capacity_load"]] = 0.0  # noqa: E712
    old.to_csv(copy / "summary.csv", index=False)
    again = report.Run.load(copy)
    row = again.rounds[(again.rounds["point"] == "mbt=256") & (again.rounds["start"] == 1)
                       & (again.rounds["at_capacity"] == True)]  # noqa: E712
    assert row["capacity_rps"].isna().all()


def test_every_table_answer_and_export_states_a_bound_or_the_fit_never_zero(run, tmp_path, capsys):
    from vllm_study.capacity import estimate
    from vllm_study.report import answer, capacity_section, export, report
    r = report.Run.load(run.path)
    pc = r.capacity("mbt=256")
    assert [s.kind for s in pc.starts] == ["below", "value"] and pc.starts[0].value == 0.25
    assert pc.config.kind == "value" and pc.config.censored == 1 and pc.config.value > 0.25
    # the margins' fit finds start 2's capacity itself (0.7), not the highest load that met
    assert pc.starts[1].value == pytest.approx(0.7, rel=1e-6)
    assert pc.statistics == ["margins", "margins"]
    table = capacity_section.capacity_table(r)
    short = report.short_table(r)
    for t in (table, short, report.point_table(r) if hasattr(report, "point_table") else table):
        for cell in t.astype(str).to_numpy().ravel():
            assert not cell.startswith("0.00") and "[0.00" not in cell, t
    assert table.loc["mbt=512", "capacity (req/s)"].startswith("3.00 [")
    # each start's bracket: a start below the floor is a bound there too, not a bracket from 0
    brackets = table.loc["mbt=256", "rate bracket per start"]
    assert brackets.startswith("s1: < 0.25 in ") and "s2: [0.5, 0.707] in 9 steps" in brackets and "[0," not in brackets
    # the capacity rows of the intervals (what the heatmaps and trend lines draw) hold no 0
    iv = r.intervals[r.intervals["metric"].isin(["capacity_rps", "capacity_load"])]
    assert len(iv) == 4 and (iv["value"] > 0).all() and set(iv["method"]) == {"capacity fit"}
    md = answer.answer_markdown(r)
    assert "0.00" not in md and "Capacity: isotonic fit of each step's SLO margins as its round recorded" in md
    note = export.export_point(run.path, "mbt=256", tmp_path / "o").notes.read_text()
    assert "| capacity (req/s) | " + capacity_section.capacity_cell(r, "mbt=256") + " |" in note
    assert "| capacity (req/s) | 0.00" not in note and "[0.00" not in note.split("capacity (req/s)")[1].split("\n")[0]
    sys.path.insert(0, str(REPO / "benchmarks"))
    import capacity_table
    sys.argv = ["capacity_table.py", str(run.path)]
    assert capacity_table.main() == 0
    out = capsys.readouterr().out
    assert " 0.00 " not in out and "[0.00" not in out
    assert estimate.STATISTICS["margins"] in out


def test_a_point_below_its_floor_everywhere_is_a_bound_in_tables_compare_export_and_the_objective(tmp_path):
    from vllm_study.report import capacity_section, compare, export, report
    from vllm_study.search.config_search import outcome_of
    run = make_capacity_run(tmp_path / "r", {"mbt=256": 0.1, "mbt=512": 3.0}, lo=2.0, hi=8.0, floor=0.25)
    r = report.Run.load(run.path)
    assert capacity_section.capacity_cell(r, "mbt=256") == "< 0.25"
    assert capacity_section.capacity_cell(r, "mbt=256", "load") == "< 0.25"
    assert r.interval("mbt=256", "capacity_rps") is None      # a bound is no value to draw
    # the search's objective: the bound, infeasible (it was 0)
    from types import SimpleNamespace
    search = SimpleNamespace(search=SimpleNamespace(objective="capacity_rps"), capacity=r.study.capacity, slo={})
    o = outcome_of(run.point("mbt=256").summary(), search)
    assert o.value == 0.25 and o.constraints == {"slo_at_lowest_load": 1.0} and o.failed is None
    # compare: B over A per point; a bound on either side is never a 0
    df = compare._compare(r, r)
    cap = df[df["metric"] == "capacity_rps"].set_index("point")
    assert cap.loc["mbt=512", "verdict"] == "not resolved" and cap.loc["mbt=512", "change"] == pytest.approx(0)
    assert math.isnan(cap.loc["mbt=256", "A"]) and cap.loc["mbt=256", "verdict"] == "not resolved"
    cells = compare.table(df).astype(str).to_numpy().ravel()
    assert any("< 0.25 -> < 0.25" in c for c in cells)
    e = export.export_point(run.path, "mbt=256", tmp_path / "o")
    assert "| capacity (req/s) | < 0.25 |" in e.notes.read_text()


def test_the_gain_over_a_baseline_below_its_floor_is_a_lower_bound(tmp_path):
    from vllm_study.capacity.estimate import gain
    from vllm_study.report import capacity_section, report
    run = make_capacity_run(tmp_path / "r", {"mbt=256": 0.1, "mbt=512": 3.0}, lo=2.0, hi=8.0, floor=0.25)
    r = report.Run.load(run.path)
    g = gain(r.capacity("mbt=512"), r.capacity("mbt=256"))
    assert g.kind == "at_least" and g.resolved
    assert g.value == pytest.approx(r.capacity("mbt=512").config.low / 0.25)
    text = capacity_section._baseline_words(r, "mbt=512", "mbt=256")
    assert f"sustains at least {g.value:.2f} x the baseline's capacity (a lower bound" in text
    assert "a resolved gain" in text and np.isfinite(g.value)


def test_a_gain_bounded_by_the_best_meeting_the_slo_at_hi_says_so(tmp_path):
    """The best met the SLO at the highest load, the baseline has a capacity: the gain is a
    lower bound because of the best, and the answer does not blame the baseline."""
    from vllm_study.capacity.estimate import gain
    from vllm_study.report import capacity_section, report
    run = make_capacity_run(tmp_path / "r", {"mbt=256": 3.0, "mbt=512": 20.0}, lo=2.0, hi=8.0)
    r = report.Run.load(run.path)
    assert r.capacity("mbt=512").config.kind == "at_least" and r.capacity("mbt=256").config.kind == "value"
    g = gain(r.capacity("mbt=512"), r.capacity("mbt=256"))
    assert g.kind == "at_least" and g.resolved
    text = capacity_section._baseline_words(r, "mbt=512", "mbt=256")
    assert f"sustains at least {g.value:.2f} x the baseline's capacity (a lower bound: the best met the SLO at " \
           "the highest load), a resolved gain" in text
    assert "below the lowest load" not in text


def test_a_best_and_baseline_that_both_met_the_slo_at_hi_are_said_so(tmp_path):
    from vllm_study.report import capacity_section, report
    run = make_capacity_run(tmp_path / "r", {"mbt=256": 12.0, "mbt=512": 20.0}, lo=2.0, hi=8.0)
    r = report.Run.load(run.path)
    text = capacity_section._baseline_words(r, "mbt=512", "mbt=256")
    assert "the gain is not resolved (both met the SLO at the highest load measured: raise capacity.hi" in text
    assert "reaches below every load measured" not in text


def test_the_trend_line_draws_a_capacity_below_the_floor_at_its_bound_not_at_0(tmp_path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from vllm_study.report import plots, report
    run = make_capacity_run(tmp_path / "r", {"mbt=256": 0.1, "mbt=512": 3.0}, lo=2.0, hi=8.0, floor=0.25)
    r = report.Run.load(run.path)
    assert plots.trend_vs_axis(r, ["capacity_rps"]) is None
    ax = plt.gcf().axes[0]
    below = [c for c in ax.collections if c.get_label() == "< lowest load"]
    assert len(below) == 1 and [tuple(p) for p in below[0].get_offsets()] == [(256, 0.25)]
    line = ax.get_lines()[0]
    assert list(line.get_ydata()) == [pytest.approx(3.0, rel=0.01)] and 0 not in list(line.get_ydata())
    plt.close("all")


def test_the_answer_and_export_name_the_highest_fitted_capacity_not_the_highest_step_that_met(tmp_path):
    """2.95 and 3.05 req/s: both searches' highest passing step is 2.83 (a tie the bracket
    cannot break); the margins' fit finds each capacity, and the answer names 3.05's point."""
    from vllm_study.report import answer, capacity_section, report
    run = make_capacity_run(tmp_path / "r", {"mbt=256": 2.95, "mbt=512": 3.05}, lo=2.0, hi=8.0)
    r = report.Run.load(run.path)
    assert {st.capacity.load for p in ("mbt=256", "mbt=512") for st in run.point(p).starts()} == {2.0 ** 1.5}
    assert answer.best_point(r) == capacity_section.best_capacity(r) == "mbt=512"
    assert capacity_section.capacity_answer(r).startswith("mbt=512 sustains 3.05 [")


def test_the_search_objective_is_the_fitted_capacity_every_table_states(tmp_path):
    """A trial's value for the sampler is the margins' fit over its start (what its
    trials-table cell and the answer show), not the highest load that met the SLO; below
    the lowest load it is that bound, infeasible."""
    from types import SimpleNamespace
    from vllm_study.records.point_capacity import point_capacities
    from vllm_study.report import report
    from vllm_study.search.config_search import outcome_of
    run = make_capacity_run(tmp_path / "r", {"mbt=256": 0.1, "mbt=512": 3.3}, lo=2.0, hi=8.0, floor=0.25)
    cap = report.Run.load(run.path).study.capacity
    study = SimpleNamespace(search=SimpleNamespace(objective="capacity_rps"), capacity=cap, slo={})
    folder = run.point("mbt=512")
    fitted = point_capacities({"mbt=512": (folder, {1})}, study.capacity.slo, study.capacity.lo)["mbt=512"]
    o = outcome_of(folder.summary(), study, folder)
    highest_met = folder.start(1).capacity.requests_per_s
    assert o.value == pytest.approx(fitted.rps(fitted.config.value)) and o.constraints == {"slo_at_lowest_load": -1.0}
    assert o.value != pytest.approx(highest_met) and highest_met < o.value   # the bracket's bottom, not the crossing
    below = outcome_of(run.point("mbt=256").summary(), study, run.point("mbt=256"))
    assert below.value == 0.25 and below.constraints == {"slo_at_lowest_load": 1.0}


def test_a_capacity_over_concurrency_is_never_labelled_in_req_s(tmp_path):
    """A closed-loop search fixes no request rate: its capacity is requests in flight, in
    every table and export, and its bound reads '< concurrency 2', never '... req/s'."""
    from vllm_study.report import capacity_section, export, report
    closed = {"workload": {"system_prompt_tokens": 256, "question_tokens": 16, "output_tokens": 16,
                           "load": {"kind": "closed", "max_concurrency": 2}},
              "capacity": {"over": "concurrency", "lo": 2, "hi": 16, "precision": 0.1, "max_steps": 6, "floor": 2}}
    run = make_capacity_run(tmp_path / "r", {"mbt=256": 5.0, "mbt=512": 0.5}, study_over=closed)
    r = report.Run.load(run.path)
    assert capacity_section.capacity_column(r) == "capacity (concurrency)"
    for t in (capacity_section.capacity_table(r), report.short_table(r), report.headline_table(r)):
        assert "capacity (req/s)" not in t.columns
        col = t["capacity (concurrency)"]
        assert col["mbt=512"] == "< 2" and col["mbt=256"].startswith("5 [")
    e = export.export_point(run.path, "mbt=512", tmp_path / "o")
    note = e.notes.read_text()
    assert "req/s" not in note.split("- status:")[1].splitlines()[0] and "capacity < concurrency 2" in note
    assert "| capacity (concurrency) | < 2 |" in note
    assert e.shortfall.startswith("the SLO was missed at every load measured (capacity < concurrency 2)")


def test_a_gain_on_one_start_each_is_not_called_resolved(tmp_path):
    """One start of the best measures no start-to-start spread: the answer says the gain is
    not resolved yet, as confirmation judges it, though the start's interval parts them
    (the H200 steady-state run after its first block: 4.85 [4.44, 5.12] over below 2.95)."""
    from vllm_study.capacity import fit
    from vllm_study.capacity.estimate import PointCapacity, gain
    from vllm_study.report import capacity_section, report
    run = make_capacity_run(tmp_path / "r", {"mbt=256": 0.1, "mbt=512": 3.0}, lo=2.0, hi=8.0, floor=0.25)
    r = report.Run.load(run.path)
    one = [fit.StartCapacity(kind="value", value=4.85, low=4.44, high=5.12, lowest=2.95, highest=7.4, log_se=0.046)]
    below = [fit.StartCapacity(kind="below", value=2.95, lowest=2.95, highest=2.95)] * 2
    r.capacities["mbt=512"] = PointCapacity("mbt=512", fit.combine(one), one, ["fit"], 1.0, None)
    r.capacities["mbt=256"] = PointCapacity("mbt=256", fit.combine(below), below, ["fit"] * 2, 1.0, None)
    assert gain(r.capacity("mbt=512"), r.capacity("mbt=256")).resolved  # the interval alone would part them
    text = capacity_section._baseline_words(r, "mbt=512", "mbt=256")
    assert "at least 1.51 x" in text and "not resolved yet (mbt=512 has one start, so no start-to-start spread)" in text
    assert "a resolved gain" not in text


def test_summary_csv_holds_each_starts_fitted_capacity_and_a_bound_as_a_bound(run):
    """The sweep's summary.csv (point_capacity.write_summary_csv): on the round at each
    start's capacity, the statistic the report states for that start, not the highest load
    that met; a start below the floor holds its bound, marked below, never 0 or nothing."""
    import pandas as pd

    from vllm_study.records import point_capacity
    from vllm_study.report import report
    point_capacity.write_summary_csv(run)
    df = pd.read_csv(run.summary_csv)
    at = df[(df["group"] == "all") & (df["at_capacity"] == True)].set_index(["point", "start"])  # noqa: E712
    r = report.Run.load(run.path)
    for (pid, k), row in at.iterrows():
        c = r.capacity(pid).starts[k - 1]
        assert row["capacity_load"] == pytest.approx(c.value) and row["capacity_rps"] == pytest.approx(c.value)
        highest_met = run.point(pid).start(k).capacity.load
        if c.kind == "value":
            assert pd.isna(row["capacity_censored"]) and row["capacity_rps"] != pytest.approx(highest_met)
    below = at.loc[("mbt=256", 1)]
    assert below["capacity_censored"] == "below" and below["capacity_rps"] == pytest.approx(0.25)
    # the report reads the bound as no value, and states it as a bound
    rows = r.rounds[(r.rounds["point"] == "mbt=256") & (r.rounds["at_capacity"] == True)]  # noqa: E712
    assert rows.set_index("start").loc[1, "capacity_rps"] != rows.set_index("start").loc[1, "capacity_rps"]  # NaN
    assert r.capacity("mbt=512").cell().startswith(f"{r.capacity('mbt=512').config.value:.2f} [")


def test_the_capacity_metric_is_defined_as_the_statistic_the_kit_states():
    from vllm_study.vocab import metrics
    d = metrics.get("capacity_rps").definition
    assert "0 when" not in d and "highest load" not in d
    assert "margins" in d and "capacity_censored" in d
