"""A capacity study's figures come from each point's own capacity: the report and the
console compare no latency across loads, say the load each figure was measured at and
the SLO bound that decided each capacity, lead with the SLO's own metrics, show a
capacity below the floor as that bound, and give each window's hit rate where a step
replayed several windows."""
from __future__ import annotations


import matplotlib
import matplotlib.pyplot as plt
import pytest
from matplotlib.patches import Rectangle

from synthetic_run import make_run
from vllm_study.report import capacity_section, plots, report
from paths import REPO

matplotlib.use("Agg")
STEADY = REPO / "results" / "20261204T042255Z-h200-mooncake-steady-capacity-e55d74e"
DEFAULTS, BEST = "mbt=8192__mns=1024__pc=on", "mbt=2048__mns=1024__pc=on"


@pytest.fixture(scope="module")
def steady():
    return report.Run.load(STEADY)


def _panels(fig) -> dict[str, object]:
    return {ax.get_title(): ax for ax in fig.axes if ax.get_title()}


def test_latency_heatmaps_box_no_best_and_say_each_cells_load(steady, tmp_path):
    assert plots.heatmap_grid(steady, out=tmp_path / "h.png") is None
    fig = plt.gcf()
    panels = _panels(fig)
    titles = list(panels)
    # capacity first, then the SLO's own metrics (ITL P99, not only HEATMAPS' ITL P90)
    assert titles[:3] == ["capacity (req/s)", "TTFT P90 from schedule (ms)", "ITL P99 (ms)"], titles
    for title, ax in panels.items():
        boxes = [p for p in ax.patches if isinstance(p, Rectangle) and not p.get_fill()]
        texts = [t.get_text() for t in ax.texts]
        if title == "capacity (req/s)":
            assert len(boxes) == 1   # the best capacity (nothing is tied with it here)
            # the baseline below the floor: its bound, not a grey "n/a"
            assert texts.count("< 2.95") == 2   # it and 4096/off: no grey "n/a" for a measured point
        else:
            assert not boxes, title   # the defaults measured at 0.8x are not "best" on a latency
            # every measured point's cell says its load ("n/a" alone: no point of the grid there)
            assert all(t == "n/a" or "\n@" in t for t in texts) and any("\n@0.8x" in t for t in texts), title
    assert any(t.get_text() == "4566\n@1.26x" for t in panels["TTFT P90 from schedule (ms)"].texts)
    note = " ".join(t.get_text() for t in fig.texts)
    assert "grey '< x' = missed the SLO at the lowest load x" in note and "grey = failed" not in note
    plt.close(fig)


def test_the_capacity_table_says_what_decided_each_capacity_and_where_it_was_measured(steady):
    t = capacity_section.capacity_table(steady)
    assert t.loc[DEFAULTS, "binding SLO bound"] == "ITL P99"     # 258 ms > 150 at the floor
    assert t.loc[BEST, "binding SLO bound"] == "TTFT P90"
    assert t.loc[DEFAULTS, "measured at"] == "0.8x" and t.loc[BEST, "measured at"] == "1.26x"
    cols = list(t.columns)
    at = [c for c in cols if c.endswith("at capacity") or "at capacity," in c]
    assert at[:2] == ["TTFT P90 from schedule (ms) at capacity", "ITL P99 (ms) at capacity"], at


def test_each_windows_hit_rate_at_capacity_is_shown_and_named(steady):
    """Window 1's round alone was 'at capacity' (0.12); window 2, primed with a longer
    history, read 0.24 at the same step."""
    t = report.short_table(steady)
    one, two = "prefix-cache hit rate at capacity, window 1", "prefix-cache hit rate at capacity, window 2"
    assert one in t.columns and two in t.columns
    assert t.loc[BEST, one].startswith("0.128") and t.loc[BEST, two].startswith("0.236")
    # the console leads with the SLO's metrics and the bound that decided
    cols = list(t.columns)
    assert cols.index("binding SLO bound") < cols.index("ITL P99 (ms) at capacity")
    assert not any("ITL P90" in c for c in cols)


def test_the_console_shows_the_slos_metrics_first(tmp_path):
    values = {p: {"ttft_p90_ms": 300.0, "itl_p90_ms": 20.0, "itl_p99_ms": 80.0, "output_throughput": 100.0}
              for p in ("mbt=256__kv=16MiB", "mbt=512__kv=16MiB")}
    run = make_run(tmp_path / "r", values, study_over={"slo": {"itl_p99_ms": 100.0, "ttft_p90_ms": 900.0}})
    cols = list(report.short_table(report.Run.load(run.path)).columns)
    assert cols[:3] == ["status", "ITL P99 (ms)", "TTFT P90 (ms)"], cols


def test_one_axis_trend_lines_say_the_load_each_capacity_studys_latency_was_measured_at(tmp_path):
    from synthetic_run import make_capacity_run
    run = make_capacity_run(tmp_path / "r", {"mbt=256": 3.0, "mbt=512": 5.0}, lo=2.0, hi=8.0)
    r = report.Run.load(run.path)
    assert plots.trend_vs_axis(r, out=tmp_path / "t.png") is None
    fig = plt.gcf()
    panels = _panels(fig)
    assert list(panels)[:2] == ["capacity (req/s)", "TTFT P90 (ms)"]
    said = [t.get_text() for t in panels["TTFT P90 (ms)"].texts]
    want = {"@" + capacity_section.measured_at_words(r, p) for p in ("mbt=256", "mbt=512")}
    assert want <= set(said) and not panels["capacity (req/s)"].texts, said
    assert "@ = the load a point's figures were measured at" in " ".join(t.get_text() for t in fig.texts)
    plt.close(fig)
