"""The report's axes are the points' axes: a study that sweeps the Prefix Reuse Budget's
min_reuse_ratio (an axis grid.expand adds) gets its heatmaps (the committed H200 run)."""
from __future__ import annotations


import matplotlib

matplotlib.use("Agg")

from vllm_study.report import plots, report  # noqa: E402
from paths import REPO

RUN = REPO / "results" / "20261201T101456Z-h200-prefix-budget-chunk256-512-81074f8"


def test_the_scheduler_axis_is_an_axis_of_the_report_and_gets_a_heatmap():
    r = report.Run.load(RUN)
    assert r.axes == ["max_num_batched_tokens", "min_reuse_ratio"]
    assert plots.heatmap_grid(r) is None  # drawn, not "no second grid axis"
    assert plots.trend_vs_axis(r) is None


STEADY = REPO / "results" / "20261204T042255Z-h200-mooncake-steady-capacity-e55d74e"


def test_a_third_axis_gets_its_own_rows_and_lines_instead_of_sharing_a_cell():
    """2048 / 1024 with caching on and off are two points in one (chunk, max_num_seqs)
    cell: each gets a row of the heatmap and a line of the trends, neither hides the other."""
    import matplotlib.pyplot as plt
    r = report.Run.load(STEADY)
    assert r.axes == ["max_num_batched_tokens", "max_num_seqs", "enable_prefix_caching"]
    assert plots.heatmap_grid(r, names=["capacity_rps"]) is None
    ax = plt.gcf().axes[0]
    rows = [t.get_text() for t in ax.get_yticklabels()]
    assert sorted(rows) == ["mns=1024, pc=off", "mns=1024, pc=on", "mns=64, pc=off", "mns=64, pc=on"]
    cells = {t.get_text() for t in ax.texts}
    assert {"4.85", "3.60", "3.33"} <= cells   # both 2048 / 1024 capacities, and 4096 / 64 / on's
    plt.close("all")
    assert plots.trend_vs_axis(r, ["capacity_rps"]) is None
    labels = plt.gcf().axes[0].get_legend_handles_labels()[1]
    assert {"mns=1024, pc=on", "mns=1024, pc=off", "mns=64, pc=on"} <= set(labels)
    plt.close("all")


def test_a_line_keeps_its_colour_in_a_panel_that_lacks_another_line():
    """Capacity has no line for 4096 / 64 / caching off (below the floor); TTFT P90 has: each
    combination is drawn in the same colour in both panels."""
    import matplotlib.pyplot as plt
    r = report.Run.load(STEADY)
    assert plots.trend_vs_axis(r, ["capacity_rps", "ttft_p90_ms"]) is None
    colours = [{line.get_label(): line.get_color() for line in ax.get_lines()} for ax in plt.gcf().axes[:2]]
    assert "mns=64, pc=off" not in colours[0] and "mns=64, pc=off" in colours[1]
    assert all(colours[1][k] == c for k, c in colours[0].items())
    plt.close("all")


def test_figures_are_saved_as_palette_pngs(tmp_path):
    """A committed run's figures are palette PNGs (vocab.figure_file): a third of matplotlib's
    RGBA file for the heatmap grid."""
    import matplotlib.pyplot as plt
    from PIL import Image
    r = report.Run.load(STEADY)
    out = tmp_path / "heatmaps.png"
    assert plots.heatmap_grid(r, out=out) is None
    plt.gcf().savefig(tmp_path / "rgba.png", dpi=110)
    plt.close("all")
    with Image.open(out) as im:
        assert im.mode == "P"
    assert out.stat().st_size < 0.5 * (tmp_path / "rgba.png").stat().st_size
