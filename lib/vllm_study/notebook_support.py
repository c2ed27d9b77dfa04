"""The few calls the report and explore notebooks make, so each notebook cell stays one
or two lines (the point notebook's are in point_notebook).

Functions that draw return None (and show the figure) so cells emit no stray
`<Figure ...>`/`<Axes ...>` text: nbval compares text outputs, and a trailing `;`
no longer hides them (nbval issue 194).
"""
from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import pandas as pd

from .vocab import axes, metrics
from .report import plots, report
from .report import answer as report_answer, binding as report_binding, capacity_section, effects, run as report_run
from .point_notebook import display_options
from .records.results import RunFolder
from .analysis import decision
from .report import compare, trace_section

display_options()


# -- report notebook ---------------------------------------------------------
def resolve_run(run_dir: str) -> RunFolder:
    if run_dir:
        return RunFolder(run_dir)
    runs = sorted(Path("../results").glob("*/manifest.json"))
    if not runs:
        raise FileNotFoundError("no run folder under ../results; run a sweep first (make study) or set run_dir")
    return RunFolder(max(runs, key=lambda p: p.parent.name).parent)


def load_run(run: RunFolder, slo: str = "", quiet: bool = False) -> report.Run:
    """The run's records; `slo` ('ttft_p90_ms=2500,itl_p90_ms=100') replaces the study's SLO
    for this report (goodput stays what the study measured under its own SLO). `quiet`:
    say nothing of it here (the report's answer names the SLO it was judged under)."""
    r = report.Run.load(run, report_run.parse_slo(slo))
    if slo and not quiet:
        print(f"SLO for this report: {r.slo} (given at report time)")
    return r


def describe_run(r: report.Run) -> None:
    print(report.describe(r))
    for line in target_warnings(r):
        print(line)


def target_warnings(r: report.Run) -> list[str]:
    """Endpoint studies: what each target's start records warn of (rounds that start warm
    because /reset_prefix_cache is refused, no /metrics), beside the target, so the report
    says it and not only start.json. Grid points' are left out: the committed reports'
    first cell, which nbval re-checks, stays as it was."""
    lines = []
    for t in r.study.targets:
        starts = r.folder.point(f"target={t.name}").starts()
        for w in dict.fromkeys(w for s in starts for w in s.warnings):  # each once, in the order seen
            lines.append(f"target {t.name} ({t.base_url}): {w}")
    return lines


def headline_table(r: report.Run) -> pd.DataFrame:
    return report.headline_table(r)


def failures(r: report.Run, quiet: bool = False) -> pd.DataFrame | None:
    """`quiet`: nothing where every point completed every round (the page leaves the
    section out; the answer says so)."""
    if quiet and all(s.status == "ok" for s in r.summaries):
        return None
    return report.failures(r)


def target_comparison(r: report.Run, quiet: bool = False) -> pd.DataFrame | None:
    """Endpoint studies: each target's medians and what it adds over the first target
    (e.g. the same vLLM behind a gateway vs its port directly). `quiet`: a grid study gets
    nothing, not the line saying it is not an endpoint study."""
    if quiet and not r.study.targets:
        return None
    return report.target_comparison(r)


def group_table(r: report.Run, quiet: bool = False) -> pd.DataFrame | None:
    """`quiet`: nothing where the workload has no classes, turns or rate steps."""
    if quiet and not report.has_groups(r):
        return None
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


def draw_round_trend(r: report.Run, quiet: bool = False) -> None:
    """`quiet`: no sentence where there is nothing to draw."""
    why = plots.round_trend(r, out=r.folder.figures / "ttft_p90_by_round.png")
    if not (why and quiet):
        _show(why)


def trend_details(r: report.Run) -> None:
    """The trend lines where the answer's figure is the heatmaps; nothing where it is the
    trend lines themselves (one axis), there is no axis (an endpoint study) or the points
    are a search's few confirmed ones."""
    if len(r.axes) >= 2 and not r.search:
        draw_trends(r)


def _markdown(text: str, plain: str | None = None) -> None:
    """Show Markdown (prose on the page; `plain` is what a console shows)."""
    from IPython.display import display
    display({"text/markdown": text, "text/plain": plain if plain is not None else text}, raw=True)


def answer(r: report.Run) -> None:
    """The report's answer in plain words, for the top of the page: the text that
    `recommendation` prints, as prose (the recommended point in bold), with the SLO it was
    judged under, the study's size and its failures; the tables are `recommendation`'s."""
    _markdown(report_answer.answer_markdown(r), report_answer.answer_text(r))


def answer_figure(r: report.Run) -> None:
    """The one figure under the answer: the heatmaps over the first two axes; with one
    axis, the trend lines (a capacity study's capacity among them); an endpoint study has
    none (nothing is shown: its answer is the target comparison)."""
    if r.search:  # its confirmed points are too few for heatmaps: the search's own history instead
        from .search import search_report  # optuna (0.6 s to import) only where a run searched
        below_at = capacity_section.lowest_load_rps(r)
        why = search_report.history_figure(r, out=r.folder.figures / "search.png", below_at=below_at)
        if why:
            _markdown(report_answer.md_escape(why), why)
            return
        plt.show()
        missed = ("a triangle: it missed the SLO at the lowest load, so its capacity is below it"
                  if below_at is not None else "a ring: it missed the SLO")
        caption = ("Left: each trial's objective from its one server start, in the order they started (a cross: "
                   f"the start failed; {missed}); the line is the best so far. Right: how much each knob moved the "
                   f"objective (Optuna's PED-ANOVA importances), {search_report.importance_caveat(r)}.")
        _markdown(caption)
        return
    if not r.axes:
        return
    if capacity_section.is_capacity_study(r):   # what decides it first: each config's margin against load
        why = plots.margin_vs_load(r, out=r.folder.figures / "margin_vs_load.png")
        if why:
            _markdown(report_answer.md_escape(why), why)
        else:
            plt.show()
            _markdown(MARGIN_CAPTION)
    two = len(r.axes) >= 2
    why = (plots.heatmap_grid(r, out=r.folder.figures / "heatmaps.png") if two else
           plots.trend_vs_axis(r, out=r.folder.figures / "trends.png"))
    if why:  # nothing measured: say so (the failure table its sentence points to is below, on this page)
        why = why.replace("the failure table above", "the failure table below")
        _markdown(report_answer.md_escape(why), why)
        return
    plt.show()
    x = f"`{r.axes[0]}`"
    if two and capacity_section.is_capacity_study(r):
        y = ", ".join(f"`{a}`" for a in r.axes[1:]) + (" (a row per combination)" if len(r.axes) > 2 else "")
        caption = (f"x: {x}; y: {y}. Capacity first, then the metrics the SLO bounds. Each cell's figures come "
                   "from the round at that point's own capacity (`@`: the load it was measured at; at the lowest "
                   "load where it missed even there), so a latency is not compared across cells and only the "
                   "capacity panel boxes its best (with the points not told apart from it). Grey `< x`: the SLO "
                   "was missed at the lowest load x, so the capacity is below it; `*`: not every planned round "
                   "was measured; grey *failed*: no round was measured.")
    elif two:
        y = ", ".join(f"`{a}`" for a in r.axes[1:]) + (" (a row per combination)" if len(r.axes) > 2 else "")
        caption = (f"x: {x}; y: {y}. In every panel yellow is the better end (low latency, high "
                   "throughput or hit rate); counts and shares that are neither better nor worse use the same "
                   "map. A red box: not told apart from the best point; `*`: not every planned round was "
                   "measured; grey *failed*: no round was measured.")
    else:
        caption = (f"Each metric against {x}, with its 95% interval as a band; `*`: not every planned round "
                   "was measured.")
    _markdown(caption, caption.replace("`", "").replace("*failed*", "failed"))


MARGIN_CAPTION = ("What decides each capacity: the binding SLO margin (the largest of the bounds' measured / limit; "
                  "at most 1 meets the SLO) at every load the search measured, a dot per server start and a line "
                  "through their medians; on the dashed SLO line, each config's capacity with its 95% interval "
                  "(a triangle: a bound, below the lowest load or at least the highest). The legend names the bound "
                  "that binds.")


def search_trials(r: report.Run, quiet: bool = False) -> pd.DataFrame | None:
    """A search's trials, one row per server start (`quiet`: nothing outside a search)."""
    if not r.search:
        if not quiet:
            print("not a search")
        return None
    return capacity_section.search_trials(r)


def predicted_vs_measured(r: report.Run, quiet: bool = False) -> pd.DataFrame | None:
    """A `predict:` study: every measured config's predicted capacity beside its measured
    one, both intervals, the flag on a prediction outside its measured interval, the rank
    agreement and the model's error so far (`quiet`: nothing for a run that predicted nothing)."""
    from .report import predict_section
    sec = predict_section.predicted_vs_measured(r.folder.path, r.capacities) if r.study.capacity else None
    if sec is None:
        if not quiet:
            print("this run predicted nothing (no predict: in its study)")
        return None
    for line in sec.lines:
        print(line)
    for point, why in sec.not_predicted.items():
        print(f"  {point}: {why}")
    return sec.table


def noise_floor(r: report.Run) -> pd.DataFrame:
    return report.noise_table(r)


def binding(r: report.Run) -> pd.DataFrame:
    for note in report_binding.binding_notes(r):
        print(note)
    return report_binding.binding_table(r)


def axis_effects(r: report.Run, axis: str = "", quiet: bool = False) -> pd.DataFrame | None:
    """Beside the binding: an axis's effect per request group (by default the Prefix Reuse
    Budget's min_reuse_ratio against off, for all requests and its shared and cold
    classes), each change with its 95% interval and called an effect only where resolved;
    for the budget, where it bound and its deferrals per point (median per round, range).
    A study without the scheduler axis prints one line (or name another axis); `quiet`:
    nothing."""
    axis = axis or report_binding.scheduler_axis(r) or ""
    if not axis and quiet:
        return None
    if not axis:
        print("no scheduler axis in this study (scheduler.min_reuse_ratio lists one value or none): "
              "no per-class effect of the budget to show")
        return None
    for note in effects.axis_effect_notes(r, axis):
        print(note)
    deferrals = report_binding.deferral_table(r) if axis == axes.SCHEDULER_AXIS else None
    if deferrals is not None:
        from IPython.display import display
        print("\nrequests the budget deferred per round at each of its points: median over measured rounds "
              "(min to max)")
        display(deferrals)
    return effects.axis_effect_table(r, axis)


def versus_best(r: report.Run) -> pd.DataFrame | None:
    return effects.comparison_table(r)


def versus_baseline(r: report.Run, quiet: bool = False) -> pd.DataFrame | None:
    """`quiet`: nothing where the study names no baseline."""
    baseline = r.baseline
    if not baseline and quiet:
        return None
    if not baseline:
        print("no baseline point in this study (set `baseline:` to a point id to compare every point with it)")
        return None
    print(f"baseline: {baseline}")
    return effects.comparison_table(r, against=baseline)


def recommendation(r: report.Run) -> pd.DataFrame | None:
    """The report's answer: the point to run under the study's SLO, what it cannot be
    told apart from, what the runner-up trades; and each point against each SLO bound."""
    answer = capacity_section.capacity_answer(r)
    if answer:  # a capacity study: answered by the load each config sustains within the SLO
        print(answer)
        from IPython.display import display
        fidelity = report_answer.fidelity_table(r)
        if fidelity is not None:
            display(fidelity)
        return capacity_section.capacity_table(r)
    slo = r.slo
    print(r.recommendation().text())
    if not slo:
        print("\n(the study sets no `slo:`; with one, the recommendation is the highest goodput among "
              "the points that meet it)")
        return None
    return r.slo_verdicts()


def freeze_line(r: report.Run) -> None:
    """Under the point-by-point answer: the export command for its best point, or why this
    run has nothing to freeze."""
    text = report_answer.freeze_words(r)
    _markdown(report_answer.md_prose(text, [s.point for s in r.summaries]), text.replace("`", ""))


def fidelity(r: report.Run) -> pd.DataFrame | None:
    """A trace run's replay against its trace (report.fidelity_table); nothing for other
    workloads, nor for a capacity study, whose answer (`recommendation`) shows it."""
    return None if capacity_section.is_capacity_study(r) else report_answer.fidelity_table(r)


def trace_windows(r: report.Run) -> pd.DataFrame | None:
    """A windowed or primed trace run's windows against the whole trace
    (trace_section.window_table); nothing for other runs."""
    return trace_section.window_table(r)


def draw_cache_curve(r: report.Run) -> None:
    """The cache model's hit rate over the whole trace against cache size, this server's
    KV size marked (trace_section.hit_rate_curve); nothing for other runs."""
    got = trace_section.hit_rate_curve(r)
    if got is not None:
        curve, kv, unbounded, block = got
        _show(plots.cache_size_curve(curve, kv, unbounded, r.study.workload.trace.file.split("/")[-1], block,
                                     out=r.folder.figures / "hit_rate_by_cache_size.png"))


def _pareto_table(r: report.Run) -> pd.DataFrame:
    tp = r.study.engine_args.tensor_parallel_size or 1
    return decision.pareto_table(r.intervals, tp)


# A capacity study's figures per point are those of the round at its own capacity: fronts
# over them would set loads against each other, not configurations.
NO_FRONTS_AT_CAPACITY = (
    "No Pareto fronts in a capacity study: each point's throughput and latencies come from the round at its own "
    "capacity, so the points were measured at different loads, and a front would favour the point measured at the "
    "lowest load (one that missed the SLO even there among them). Each point's capacity, and its latencies at it, "
    "are in the capacity table.")


def pareto(r: report.Run) -> pd.DataFrame | None:
    if report.is_capacity_study(r):
        print(NO_FRONTS_AT_CAPACITY)
        return None
    t = _pareto_table(r)
    why = plots.pareto_plot(t, out=r.folder.figures / "pareto.png")
    _show(why)
    return None if why else t.round(1)


def pareto_figure(r: report.Run) -> None:
    """The Pareto fronts alone (their points' values: `pareto_points`); nothing where no
    point has throughput, TPOT and TTFT; a capacity study's: why there are none."""
    if report.is_capacity_study(r):
        print(NO_FRONTS_AT_CAPACITY)
        return
    why = plots.pareto_plot(_pareto_table(r), out=r.folder.figures / "pareto.png")
    if not why:
        plt.show()


def pareto_points(r: report.Run) -> pd.DataFrame | None:
    """Every point's values on the Pareto fronts' axes, and whether it is on each front
    (none in a capacity study: pareto_figure says why)."""
    t = pd.DataFrame() if report.is_capacity_study(r) else _pareto_table(r)
    return None if t.empty else t.round(1)


# -- explore notebook --------------------------------------------------------
def explore(r: report.Run, metric: str, x: str = "", hue: str = "", other: report.Run | None = None) -> pd.DataFrame:
    """One metric sliced by an axis (and another as hue), rounds overlaid; with a second
    run, its values beside and the change per point."""
    metrics.get(metric)  # an unknown name fails here, with the list of known ones
    _show(plots.slice_plot(r, metric, x or None, hue or None, other))
    iv = r.intervals[r.intervals["metric"] == metric]
    t = iv.set_index("point")[["value", "ci_low", "ci_high", "starts", "rounds"]]
    if other is not None:
        d = compare.compare(r.folder.path, other.folder.path, [metric])
        if note := compare.one_start_line(r, other):
            print(note)
        if not d.empty:
            t = t.join(d.set_index("point")[["B", "change", "low", "high", "verdict"]].add_prefix("other "))
    return t.round(3)
