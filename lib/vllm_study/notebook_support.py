"""The few calls the notebooks make, so each notebook cell stays one or two lines.

Functions that draw return None (and show the figure) so cells emit no stray
`<Figure ...>`/`<Axes ...>` text: nbval compares text outputs, and a trailing `;`
no longer hides them (nbval issue 194).
"""
from __future__ import annotations

import tempfile
import warnings
from pathlib import Path

import matplotlib.pyplot as plt
import pandas as pd
from tqdm import TqdmWarning

# transformers imports tqdm.auto, which warns (with this machine's paths) that
# ipywidgets is missing; the text progress bar is what the kit wants anyway.
warnings.filterwarnings("ignore", category=TqdmWarning)

from . import metrics, plots, report  # noqa: E402
from .grid import PointPlan, expand  # noqa: E402
from .params import StudyError, load_study  # noqa: E402
from .point import PointRun  # noqa: E402,F401  (re-exported for the point notebook)
from .results import PointFolder, PointSummary, RunFolder  # noqa: E402
from .sweep import study_engine  # noqa: E402

pd.set_option("display.width", 200)
pd.set_option("display.max_columns", 40)
pd.set_option("display.max_colwidth", None)  # a failure's reason is one line: show all of it


# -- point notebook ----------------------------------------------------------
def select_point(point_file: str, study_file: str, point_id: str, out_dir: str, start: int):
    """The sweep passes point_file (its resolved point.json). By hand: a study file and a
    point id, expanded here, into a scratch folder unless out_dir is given."""
    if point_file:
        folder = PointFolder(Path(point_file).parent)
        plan = folder.plan()
    else:
        study = load_study(study_file)
        engine = study_engine(study, None)
        by_id = {p.id: p for p in expand(study, engine)}
        if point_id and point_id not in by_id:
            raise StudyError(f"point_id {point_id!r} is not in the grid of {study_file}; "
                             f"its points are: {', '.join(by_id)}")
        point = by_id[point_id] if point_id else next(iter(by_id.values()))
        plan = PointPlan(study=study, point=point, engine=engine)
        if out_dir:
            folder = PointFolder(Path(out_dir).parent)
        else:
            scratch = Path("results") / "scratch"
            scratch.mkdir(parents=True, exist_ok=True)
            folder = PointFolder(Path(tempfile.mkdtemp(prefix=f"{point.id}-", dir=scratch)))
        folder.save_plan(plan)
    start_dir = Path(out_dir) if out_dir else folder.start_dir(start)
    return plan, start_dir


def gpu_list(gpus: str) -> list[int] | None:
    return [int(g) for g in gpus.split(",")] if gpus else None


def describe_point(plan: PointPlan, start: int) -> None:
    p = plan.point
    print(f"study {plan.study.name}, point {p.id}, server start {start} of {plan.study.replicates}, "
          f"engine {plan.engine}")
    if p.target:
        print(f"endpoint: {p.target.base_url} serving {p.target.model}")
    else:
        print("vllm args:", " ".join(p.engine_args.cli()))
        print("effective (where vLLM decides):", p.effective.model_dump(exclude_none=True))
    for w in p.warnings:
        print("warning:", w)


def show_launch(run: PointRun) -> None:
    rec = run.record
    if run.failed:
        print(f"FAILED: {rec.reason}")
        return
    launch = rec.launch
    if launch.target:
        print(f"endpoint {launch.target['base_url']} answers; /metrics: "
              f"{'yes' if launch.has_metrics else 'no'}, cache reset: {'yes' if launch.cache_reset else 'no'}")
    else:
        print(f"ready in {launch.startup_s:.1f} s at {run.url}")
    if launch.cache_config:
        print("cache config:", launch.cache_config)
    for w in rec.warnings:
        print("warning:", w)


def round_progress(total: int):
    from tqdm import tqdm
    bar = tqdm(total=total, unit="round")
    return lambda i: bar.update(1) or (bar.close() if i == total - 1 else None)


ROUND_COLUMNS = ("ttft_p50_ms", "ttft_p90_ms", "itl_p90_ms", "tpot_p50_ms", "output_throughput",
                 "prefix_cache_hit_rate", "engine_steps", "preemptions", "kv_usage_peak")


def rounds_table(run: PointRun) -> pd.DataFrame:
    if not run.rounds:
        return pd.DataFrame({"status": [run.record.status], "reason": [run.record.reason]})
    rows = [{"round": r.round, "status": r.status, "completed": r.metrics["completed"],
             "failed": r.metrics["failed"], **{m: r.metrics.get(m) for m in ROUND_COLUMNS}} for r in run.rounds]
    return pd.DataFrame(rows).set_index("round").round(3)


def summary_table(summary: PointSummary) -> pd.DataFrame:
    """The point over all its starts so far: each metric's median, interval and range."""
    print(f"point {summary.point}: {summary.status}, {summary.rounds_ok} of {summary.rounds_planned} rounds "
          f"over {summary.starts_done} of {summary.starts_planned} server start(s)")
    for r in summary.reasons:
        print("  ", r)
    return report.estimates_frame(summary)


# -- report notebook ---------------------------------------------------------
def resolve_run(run_dir: str) -> RunFolder:
    if run_dir:
        return RunFolder(run_dir)
    runs = sorted(Path("../results").glob("*/manifest.json"))
    if not runs:
        raise FileNotFoundError("no run folder under ../results; run a sweep first (make study) or set run_dir")
    return RunFolder(max(runs, key=lambda p: p.parent.name).parent)


def load_run(run: RunFolder, slo: str = "") -> report.Run:
    """The run's records; `slo` ('ttft_p90_ms=2500,itl_p90_ms=100') replaces the study's SLO
    for this report (goodput stays what the study measured under its own SLO)."""
    r = report.Run.load(run, report.parse_slo(slo))
    if slo:
        print(f"SLO for this report: {r.slo} (given at report time)")
    return r


def describe_run(r: report.Run) -> None:
    print(report.describe(r))


def headline_table(r: report.Run) -> pd.DataFrame:
    return report.headline_table(r)


def failures(r: report.Run) -> pd.DataFrame:
    return report.failures(r)


def target_comparison(r: report.Run) -> pd.DataFrame | None:
    """Endpoint studies: each target's medians and what it adds over the first target
    (e.g. the same vLLM behind a gateway vs its port directly)."""
    return report.target_comparison(r)


def group_table(r: report.Run) -> pd.DataFrame | None:
    return report.group_table(r)


def definitions(r: report.Run) -> pd.DataFrame:
    return metrics.definitions(report.reported_metrics(r))


def _show(why: str | None) -> None:
    """A drawing function's outcome: the figure, or the sentence saying why there is none."""
    if why:
        print(why)
    else:
        plt.show()


def draw_heatmaps(r: report.Run) -> None:
    _show(plots.heatmap_grid(r, out=r.folder.figures / "heatmaps.png"))


def draw_trends(r: report.Run) -> None:
    _show(plots.trend_vs_axis(r, out=r.folder.figures / "trends.png"))


def draw_round_trend(r: report.Run) -> None:
    _show(plots.round_trend(r, out=r.folder.figures / "ttft_p90_by_round.png"))


def noise_floor(r: report.Run) -> pd.DataFrame:
    return report.noise_table(r)


def binding(r: report.Run) -> pd.DataFrame:
    for note in report.binding_notes(r):
        print(note)
    return report.binding_table(r)


def versus_best(r: report.Run) -> pd.DataFrame | None:
    return report.comparison_table(r)


def versus_baseline(r: report.Run) -> pd.DataFrame | None:
    baseline = r.manifest.params.get("baseline")
    if not baseline:
        print("no baseline point in this study (set `baseline:` to a point id to compare every point with it)")
        return None
    print(f"baseline: {baseline}")
    return report.comparison_table(r, against=baseline)


def recommendation(r: report.Run) -> pd.DataFrame | None:
    """The report's answer: the point to run under the study's SLO, what it cannot be
    told apart from, what the runner-up trades; and each point against each SLO bound."""
    from . import decision
    slo = r.slo
    print(decision.recommend(r.rounds, r.intervals, slo).text())
    if not slo:
        print("\n(the study sets no `slo:`; with one, the recommendation is the highest goodput among "
              "the points that meet it)")
        return None
    return decision.slo_table(r.intervals, slo)


def pareto(r: report.Run) -> pd.DataFrame | None:
    from . import decision
    tp = r.manifest.params.get("engine_args", {}).get("tensor_parallel_size") or 1
    t = decision.pareto_table(r.intervals, tp)
    why = plots.pareto_plot(t, out=r.folder.figures / "pareto.png")
    _show(why)
    return None if why else t.round(1)


# -- explore notebook --------------------------------------------------------
def explore(r: report.Run, metric: str, x: str = "", hue: str = "", other: report.Run | None = None) -> pd.DataFrame:
    """One metric sliced by an axis (and another as hue), rounds overlaid; with a second
    run, its values beside and the change per point."""
    metrics.get(metric)  # an unknown name fails here, with the list of known ones
    _show(plots.slice_plot(r, metric, x or None, hue or None, other))
    iv = r.intervals[r.intervals["metric"] == metric]
    t = iv.set_index("point")[["value", "ci_low", "ci_high", "starts", "rounds"]]
    if other is not None:
        from . import compare
        d = compare.compare(r.folder.path, other.folder.path, [metric])
        if not d.empty:
            t = t.join(d.set_index("point")[["B", "change", "low", "high", "verdict"]].add_prefix("other "))
    return t.round(3)
