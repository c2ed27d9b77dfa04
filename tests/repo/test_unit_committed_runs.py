"""Every committed run still opens as the report notebook opens it: its manifest's study
validates as today's Study (runs made on other machines and by older kits), and the
report's axes are the points' axes."""
from __future__ import annotations

import json

import pytest

from vllm_study.vocab import axes
from vllm_study.report import report
from vllm_study.report import binding, capacity_section
from vllm_study import notebook_support as ns
from vllm_study.define.params import Study
from vllm_study.define import grid_spec
from vllm_study.records.results import RunFolder
from paths import REPO

RESULTS = REPO / "results"
RUNS = sorted(p.parent for p in RESULTS.glob("*/manifest.json"))
BUDGET_RUN = "20261201T101456Z-h200-prefix-budget-chunk256-512-81074f8"


def test_the_committed_runs_are_found():
    assert len(RUNS) >= 20 and BUDGET_RUN in {p.name for p in RUNS}


@pytest.mark.parametrize("folder", RUNS, ids=[p.name for p in RUNS])
def test_a_committed_run_loads_with_its_typed_study(folder):
    r = ns.load_run(ns.resolve_run(str(folder)), quiet=True)  # as notebooks/report.ipynb does
    assert isinstance(r.study, Study) and r.study.name == r.manifest.study
    grid = list(grid_spec.axes(r.study.grid) or (r.study.search.space if r.study.search else {}))
    assert r.axes in (grid, grid + [axes.SCHEDULER_AXIS])
    assert report.describe(r)
    if folder.name == BUDGET_RUN:  # its min_reuse_ratio values make the scheduler an axis: heatmaps chunk x ratio
        assert r.axes == ["max_num_batched_tokens", "min_reuse_ratio"]
        assert binding.scheduler_axis(r) == "min_reuse_ratio"


def test_every_kit_scheduler_a_committed_run_launched_is_known_by_the_path_it_recorded():
    """Runs made before the plugin's package was renamed record its old class paths
    (vllm_study.prefix_budget.X); a reader of a recorded launch (export) knows each one
    through KIT_SCHEDULER_PATHS."""
    from vllm_study.launch.flags import Flags
    from vllm_study.measure.launcher import KIT_SCHEDULER_PATHS
    recorded = set()
    for f in RESULTS.rglob("start.json"):
        command = (json.loads(f.read_text()).get("launch") or {}).get("command") or []
        recorded.add(Flags.parse(command).get("scheduler-cls"))
    kit = {c for c in recorded if c and c.startswith("vllm_study.")}
    assert {"vllm_study.prefix_budget.PrefixBudgetScheduler", "vllm_study.prefix_budget.StepRecordsScheduler"} <= kit
    assert kit <= {path for paths in KIT_SCHEDULER_PATHS for path in paths}


@pytest.mark.parametrize("run, point, scheduler", [
    ("20261207T095858Z-h100-mooncake-chunk-attention-ec68ca4", "mbt=2048__mns=64__pc=on__lpt=0", None),
    (BUDGET_RUN, "mbt=256__mrr=0.50", "vllm_study.scheduler_plugin.PrefixBudgetScheduler")])
def test_a_committed_run_that_recorded_the_plugins_old_path_exports_todays_command(run, point, scheduler):
    """The step-records scheduler (measurement) is left out of the exported command; the
    Prefix Reuse Budget's (the point's admission rule) stays, under the path that loads."""
    from vllm_study.report import export
    r = report.Run.load(RunFolder(RESULTS / run), None)
    recorded = next(s for s in r.summaries if s.point == point).launch.command
    assert any(t.startswith("vllm_study.prefix_budget.") for t in recorded)
    argv, _, source = export.launch(r, point, export.serve_config(r, point))
    assert not any("vllm_study.prefix_budget" in t for t in argv)
    assert (argv[argv.index("--scheduler-cls") + 1] if "--scheduler-cls" in argv else None) == scheduler
    said = "--scheduler-cls vllm_study.prefix_budget.PrefixBudgetScheduler is where the kit's plugin lived"
    assert (said in source) == bool(scheduler)


SEARCH_RUN = "20261202T122846Z-h200-mooncake-search-6581d2b"


def test_a_capacity_below_the_bracket_reads_as_a_bound_in_every_table():
    """vLLM's defaults and trial 4 missed the SLO at the search's lowest load (1 x the
    trace's 3.08 req/s): their capacity is unmeasured below it, not 0."""
    from vllm_study.search import search_report
    r = ns.load_run(ns.resolve_run(str(RESULTS / SEARCH_RUN)), quiet=True)
    capacity = next(c for c in report.headline_table(r).columns if c.startswith("capacity"))
    assert report.headline_table(r).loc["vllm-defaults", capacity] == "< 3.08"
    assert capacity_section.capacity_table(r).loc["vllm-defaults", "capacity (req/s)"] == "< 3.08"
    trials = ns.search_trials(r)
    assert trials.loc[4, "capacity_rps"] == "< 3.08"
    # a trial's capacity is point_capacity's fit over its own start (its highest step that met was 6.13)
    from vllm_study.records.point_capacity import point_capacity
    trial_start = next(u.start for u in r.manifest.order if u.point == trials.loc[6, "point"] and u.block == 1)
    pc = point_capacity(r.folder.point(trials.loc[6, "point"]), r.study.capacity.slo, r.study.capacity.lo,
                        {trial_start})
    # (its interval reaches its bracket's high end, 7.03: fit.within_bracket)
    assert pc.statistics == ["fit"] and trials.loc[6, "capacity_rps"] == pc.cell() == "6.24 [< 5.34, 7.03]"
    assert "fewer than 20" in search_report.importance_caveat(r) and "8 measured trials" in \
        search_report.importance_caveat(r)


def test_the_search_history_draws_a_trial_below_the_bracket_at_the_lowest_load_not_at_0():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from vllm_study.search import search_report
    r = ns.load_run(ns.resolve_run(str(RESULTS / SEARCH_RUN)), quiet=True)
    assert search_report.history_figure(r, below_at=capacity_section.lowest_load_rps(r)) is None
    ax = plt.gcf().axes[0]
    missed = [c for c in ax.collections if c.get_label().startswith("SLO missed at the lowest load")]
    at_trial_4 = next(t.get_position()[0] for t in ax.get_xticklabels() if t.get_text() == "4")
    lowest = capacity_section.lowest_load_rps(r)
    assert len(missed) == 1 and [tuple(p) for p in missed[0].get_offsets()] == [(at_trial_4, lowest)]
    assert abs(capacity_section.lowest_load_rps(r) - 3.08) < 0.005
    plt.close("all")
