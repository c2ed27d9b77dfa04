"""The report's axes are the points' axes: a study that sweeps the Prefix Reuse Budget's
min_reuse_ratio (an axis grid.expand adds) gets its heatmaps (the committed H200 run)."""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")

from vllm_study.report import plots, report  # noqa: E402

RUN = Path(__file__).resolve().parents[1] / "results" / "20261201T101456Z-h200-prefix-budget-chunk256-512-81074f8"


def test_the_scheduler_axis_is_an_axis_of_the_report_and_gets_a_heatmap():
    r = report.Run.load(RUN)
    assert r.axes == ["max_num_batched_tokens", "min_reuse_ratio"]
    assert plots.heatmap_grid(r) is None  # drawn, not "no second grid axis"
    assert plots.trend_vs_axis(r) is None
