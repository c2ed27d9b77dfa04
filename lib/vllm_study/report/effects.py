"""An axis's effect on each request group, and each point against a reference: the
differences and their intervals, as table rows and as sentences."""
from __future__ import annotations

import numpy as np
import pandas as pd

from ..analysis import intervals
from ..define import grid_spec
from ..vocab import axes, metrics
from ..vocab.axes import SCHEDULER_AXIS
from .binding import same_value, scheduler_binding
from .report import group_order, within_run_note
from .run import Run, interval_row


EFFECT_METRICS = ("ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms")       # per request group and for all
WHOLE_ROUND_EFFECTS = ("output_throughput", "prefix_cache_hit_rate")  # the whole round's only


def axis_values(r: Run, axis: str) -> list:
    """An axis's values in the order the study lists them."""
    study = r.study
    grid = grid_spec.axes(study.grid)
    if axis in grid:
        return list(grid[axis])
    if axis == SCHEDULER_AXIS:
        return study.scheduler.ratios
    return list(dict.fromkeys(s.values[axis] for s in r.summaries if axis in s.values))


def reference_value(r: Run, axis: str):
    """What an axis's other values are set against: vLLM's own scheduler (off) for the
    budget; else the baseline point's value; else the axis's first value."""
    values = axis_values(r, axis)
    if axis == SCHEDULER_AXIS and any(same_value(v, "off") for v in values):
        return "off"
    base = next((s for s in r.summaries if s.point == r.baseline), None)
    if base is not None and axis in base.values:
        return base.values[axis]
    return values[0] if values else None


def axis_pairs(r: Run, axis: str, reference=None) -> list[tuple[str, str]]:
    """(point, the point it is set against): each point at another value of `axis` with
    the point at the reference value whose other axes' values are the same."""
    ref = reference_value(r, axis) if reference is None else reference
    values = {s.point: s.values for s in r.summaries if axis in s.values}
    at_ref = [q for q, v in values.items() if same_value(v[axis], ref)]
    pairs = []
    for p, v in values.items():
        if same_value(v[axis], ref):
            continue
        twin = next((q for q in at_ref
                     if all(same_value(values[q].get(k), x) for k, x in v.items() if k != axis)), None)
        if twin:
            pairs.append((p, twin))
    return pairs


def request_groups(rounds: pd.DataFrame) -> list[tuple[str, tuple[str, str] | None]]:
    """('all', None), then each request class, turn, rate step or prefix of the rounds
    (label 'class=shared', group ('class', 'shared')), in the group table's order."""
    if rounds.empty or "group" not in rounds.columns:
        return [("all", None)]
    groups = rounds.loc[rounds["group"] != "all", ["group", "group_value"]].drop_duplicates()
    labels = sorted((f"{g}={v}" for g, v in groups.itertuples(index=False)), key=group_order)
    return [("all", None)] + [(lab, tuple(lab.split("=", 1))) for lab in labels]


def _change_text(d: intervals.Difference) -> str:
    if not np.isfinite(d.low):  # a point's spread was not measured (intervals.MetricData.spread): no interval
        return f"{d.estimate:+.1%} (no spread measured)" if d.relative else f"{d.estimate:+.3g} (no spread measured)"
    if d.low == d.high and metrics.get(d.metric).exact:  # both points exact by construction
        return f"{d.estimate:+.1%} (exact)" if d.relative else f"{d.estimate:+.3g} (exact)"
    if d.relative:
        return f"{d.estimate:+.1%} [{d.low:+.1%}, {d.high:+.1%}]"
    return f"{d.estimate:+.3g} [{d.low:+.3g}, {d.high:+.3g}]"


EFFECT_COLUMNS = ["point", "against", "group", "metric", "value", "reference value", "change", "verdict",
                  "estimate", "low", "high", "relative", "resolved"]


def axis_effect_frame(r: Run, axis: str, reference=None, names=EFFECT_METRICS,
                      whole=WHOLE_ROUND_EFFECTS) -> pd.DataFrame:
    """One row per (point, group, metric): each point at a non-reference value of `axis`
    against its twin at the reference value (axis_pairs), for all requests and each
    request group the rounds have (the budget's shared and cold classes, turns, rate
    steps): both values [95% interval], the difference with its 95% interval (analysis.
    difference: the start-to-start spread pooled over the run's points), its verdict, and
    the point's axis values. `whole` metrics are the whole round's only."""
    pairs = axis_pairs(r, axis, reference)
    values = {s.point: s.values for s in r.summaries}
    cols = list(dict.fromkeys(k for p, _ in pairs for k in values[p])) + EFFECT_COLUMNS
    groups = request_groups(r.rounds)
    found = {}
    for label, group in groups:
        for m in tuple(names) + (tuple(whole) if group is None else ()):
            data = intervals.MetricData.from_rounds(r.rounds, m, group)
            if data is not None:
                found[label, m] = (data, data.noise(), intervals.point_intervals(r.rounds, [m], group))
    rows = []
    for p, ref in pairs:
        for (label, m), (data, noise, iv) in found.items():
            if p not in data.starts or ref not in data.starts:
                continue
            d = intervals.difference(data, p, ref, noise)
            mm = metrics.get(m)
            rows.append({**values[p], "point": p, "against": ref, "group": label, "metric": m,
                         "value": metrics.with_interval(interval_row(iv, p, m), mm),
                         "reference value": metrics.with_interval(interval_row(iv, ref, m), mm),
                         "change": _change_text(d), "verdict": d.verdict(), "estimate": d.estimate, "low": d.low,
                         "high": d.high, "relative": d.relative, "resolved": d.resolved})
    return pd.DataFrame(rows, columns=cols)


def axis_effect_table(r: Run, axis: str, reference=None) -> pd.DataFrame | None:
    """Per point at a non-reference value of `axis` and request group: the point it is set
    against, and per metric the change [95% interval] with its verdict (better or worse
    only where the interval excludes 0: an effect; else not resolved)."""
    f = axis_effect_frame(r, axis, reference)
    if f.empty:
        return None
    f = f.assign(cell=[f"{c} {v}" for c, v in zip(f["change"], f["verdict"])])
    order = [m for m in EFFECT_METRICS + WHOLE_ROUND_EFFECTS if m in set(f["metric"])]
    t = f.pivot_table(index=["point", "group"], columns="metric", values="cell", aggfunc="first", sort=False)
    t = t.reindex(columns=order).fillna("")
    t.columns = [f"{metrics.get(m).label} change" for m in order]
    against = f.drop_duplicates(["point", "group"]).set_index(["point", "group"])["against"]
    t.insert(0, "against", against.reindex(t.index))
    return t


def axis_effect_notes(r: Run, axis: str, reference=None) -> list[str]:
    """What the effects table shows, in words: what each point is set against, every
    resolved effect (and only those called effects), and for the scheduler where the
    budget bound."""
    ref = reference_value(r, axis) if reference is None else reference
    notes = [f"{axis}: each point against the point at {axis}={axes.get(axis).fmt(ref)} with the same other values, "
             "for all requests and per request group: the change [95% interval], called an effect only where "
             "the interval excludes 0"]
    if axis == SCHEDULER_AXIS:
        notes.append(scheduler_binding(r) or f"{axis}: no point with the budget was measured")
    f = axis_effect_frame(r, axis, reference)
    if f.empty:
        notes.append(f"{axis}: no measured point has a measured twin at {axis}={axes.get(axis).fmt(ref)} "
                     "to be set against")
        return notes
    if note := within_run_note(r):
        notes.append(note)
    effects = f[f["resolved"]]
    if effects.empty:
        notes.append(f"no effect of {axis} this study resolves, in any request group: every interval includes 0")
    for row in effects.itertuples():
        notes.append(f"effect at {row.point} against {row.against}, {row.group}: {metrics.get(row.metric).label} "
                     f"{row.change} ({row.verdict})")
    return notes


# -- comparisons ----------------------------------------------------------------------
def comparison_table(r: Run, against: str | None = None) -> pd.DataFrame | None:
    """Each point against the best point of each headline metric (or against a named
    baseline point): the relative difference with its 95% interval, and a verdict."""
    names = [n for n in ("ttft_p90_ms", "itl_p90_ms", "tpot_p50_ms", "output_throughput")
             if n in set(r.intervals.get("metric", []))]
    if not names:
        print("nothing measured to compare")
        return None
    rows = {}
    for n in names:
        data = intervals.MetricData.from_rounds(r.rounds, n)
        ref = against if against in (data.starts if data else {}) else intervals.best_point(data)
        noise = data.noise()
        for p in data.starts:
            cell = "reference" if p == ref else _diff_cell(intervals.difference(data, p, ref, noise))
            rows.setdefault(p, {})[f"{metrics.get(n).label} vs {'baseline' if against else 'best'}"] = cell
    if note := within_run_note(r):
        print(note)
    return pd.DataFrame.from_dict(rows, orient="index").rename_axis("point")


def _diff_cell(d: intervals.Difference) -> str:
    fmt = (lambda v: f"{v:+.1%}") if d.relative else (lambda v: f"{v:+.3g}")
    if not np.isfinite(d.low):  # a point's spread was not measured: never resolved
        return f"{fmt(d.estimate)} (no spread measured) not resolved"
    if d.low == d.high and metrics.get(d.metric).exact:  # both points exact by construction
        return f"{fmt(d.estimate)} (exact) {d.verdict()}"
    return f"{fmt(d.estimate)} [{fmt(d.low)}, {fmt(d.high)}] {d.verdict()}"
