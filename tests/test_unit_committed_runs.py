"""Every committed run still opens as the report notebook opens it: its manifest's study
validates as today's Study (runs made on other machines and by older kits), and the
report's axes are the points' axes."""
from __future__ import annotations

from pathlib import Path

import pytest

from vllm_study import axes, report
from vllm_study import notebook_support as ns
from vllm_study.params import Study

RESULTS = Path(__file__).resolve().parents[1] / "results"
RUNS = sorted(p.parent for p in RESULTS.glob("*/manifest.json"))
BUDGET_RUN = "20261201T101456Z-h200-prefix-budget-chunk256-512-81074f8"


def test_the_committed_runs_are_found():
    assert len(RUNS) >= 20 and BUDGET_RUN in {p.name for p in RUNS}


@pytest.mark.parametrize("folder", RUNS, ids=[p.name for p in RUNS])
def test_a_committed_run_loads_with_its_typed_study(folder):
    r = ns.load_run(ns.resolve_run(str(folder)), quiet=True)  # as notebooks/report.ipynb does
    assert isinstance(r.study, Study) and r.study.name == r.manifest.study
    grid = list(r.study.grid or (r.study.search.space if r.study.search else {}))
    assert r.axes in (grid, grid + [axes.SCHEDULER_AXIS])
    assert report.describe(r)
    if folder.name == BUDGET_RUN:  # its min_reuse_ratio values make the scheduler an axis: heatmaps chunk x ratio
        assert r.axes == ["max_num_batched_tokens", "min_reuse_ratio"]
        assert report.scheduler_axis(r) == "min_reuse_ratio"
