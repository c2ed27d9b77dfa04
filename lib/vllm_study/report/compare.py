"""Two runs side by side: another vLLM version, GPU, model, a changed fixed argument, or
a gateway against a direct port. Per point that both runs measured, the change of each
headline metric from run A to run B with its 95% interval, and a verdict (better, worse,
not resolved). What differs between the two studies is listed first, and the points
measured in one run only; a change is called better or worse only when both runs ran
the same workload (WORKLOAD_KEYS), else it is higher or lower, across different workloads.

Each run's point values and standard errors come from its own noise model (intervals.py);
the difference's interval uses the smaller of the two runs' degrees of freedom, which
errs on the wide side. Where either run measured every point from one server start, its
intervals hold round-to-round noise only: two starts of one config differ by more than
that (a restart moved TTFT P90 by 25-55% on the H200), so no difference is called
resolved and the first line says why.

    python -m vllm_study compare results/<run A> results/<run B> --out compare/
"""
from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from ..analysis import intervals
from ..vocab import metrics
from . import report
from ..analysis.intervals import Difference
from ..define.params import Study
from ..vocab.figure_file import save_figure

METRICS = ("capacity_rps", "ttft_p90_ms", "itl_p90_ms", "stall_p90_ms", "tpot_p50_ms", "output_throughput",
           "prefix_cache_hit_rate")
# What the requests were (and, for capacity, the search over their load, with its SLO):
# where these differ, every metric moves by itself (the hit rate with the request count),
# so B - A is no effect. Another seed or timeout draws or waits on the same workload.
WORKLOAD_KEYS = ("workload", "capacity")
SAME_WORKLOAD_KEYS = ("workload.seed", "workload.request_timeout_s")
# Names, not settings.
IGNORED_KEYS = ("name", "description")


def _flat(d: dict, prefix: str = "") -> dict:
    """{'a': {'b': 1}} -> {'a.b': 1}; lists stay whole."""
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out |= _flat(v, f"{prefix}{k}.")
        else:
            out[f"{prefix}{k}"] = v
    return out


def _params(m) -> dict:
    """The study as today's kit reads it: a field added since one of the runs gets its
    default on both sides, not a difference; a study it no longer reads stays as written."""
    try:
        return Study.model_validate(m.params).model_dump(mode="json")
    except ValueError:
        return m.params


def study_differences(ra: report.Run, rb: report.Run) -> list[tuple[str, object, object]]:
    """(key, A's value, B's value) for each study parameter that differs (dotted, as
    manifest.json's params nest them), then the engine, executor, vLLM version and GPUs.
    Unset, empty and absent are the same."""
    def keys(r: report.Run) -> dict:
        m = r.manifest
        flat = {k: v for k, v in _flat(_params(m)).items() if k.split(".")[0] not in IGNORED_KEYS}
        flat |= {"(run) engine": m.engine, "(run) executor": m.executor, "(run) vllm": m.versions.vllm,
                 "(run) gpus": [g.name for g in m.machine.gpus]}
        return {k: v for k, v in flat.items() if v not in (None, {}, [])}
    a, b = keys(ra), keys(rb)
    return [(k, a.get(k), b.get(k)) for k in sorted(a.keys() | b.keys(), key=lambda k: (k.startswith("("), k))
            if a.get(k) != b.get(k)]


def _workload_key(key: str) -> bool:
    return key.split(".")[0] in WORKLOAD_KEYS and key not in SAME_WORKLOAD_KEYS


def same_workload(diffs: list[tuple[str, object, object]]) -> bool:
    return not any(_workload_key(k) for k, _, _ in diffs)


def difference(a: intervals.MetricData, b: intervals.MetricData, point: str) -> Difference:
    """B minus A at one point: a relative change when both runs use the log scale;
    otherwise in the metric's unit (with an interval only when both are linear)."""
    se_a, df_a, _ = a.se(point, a.noise())
    se_b, df_b, _ = b.se(point, b.noise())
    half = intervals.t_quantile(min(df_a, df_b)) * float(np.hypot(se_a, se_b))
    if a.log and b.log:
        d = b.center(point) - a.center(point)
        return Difference(a.metric, point, point, True, float(np.expm1(d)), float(np.expm1(d - half)),
                          float(np.expm1(d + half)))
    d = float(b.back(b.center(point)) - a.back(a.center(point)))
    if a.log or b.log:  # one scale each: no common interval
        half = float("nan")
    return Difference(a.metric, point, point, False, d, d - half, d + half)


def compare(run_a, run_b, names=METRICS) -> pd.DataFrame:
    """One row per point both runs measured x metric; `workload` says whether the two
    runs ran the same one (else the verdict is only higher/lower)."""
    return _compare(report.Run.load(run_a), report.Run.load(run_b), names)


def one_start_runs(ra: report.Run, rb: report.Run) -> list[str]:
    """'A' and/or 'B': the runs in which no point was measured from two or more server
    starts, so nothing in them measured start-to-start spread."""
    return [who for who, r in (("A", ra), ("B", rb)) if intervals.single_start(r.rounds)]


def one_start_line(ra: report.Run, rb: report.Run) -> str | None:
    """The header's first line where either run measured every point from one start
    (intervals.one_start_note); None where both had 2 or more at some point."""
    one = " and ".join(one_start_runs(ra, rb))
    return intervals.one_start_note(*(intervals.starts_per_point(r.rounds) for r in (ra, rb)),
                                    why=f"{one} measured each point from one server start, so no difference below "
                                        "is called resolved; replicates: 2 or more in both studies measure it")


ONE_START = "not resolved (one start)"


def _compare(ra: report.Run, rb: report.Run, names=METRICS) -> pd.DataFrame:
    same = same_workload(study_differences(ra, rb))
    one_start = bool(one_start_runs(ra, rb))
    rows = []
    for name in names:
        if name == "capacity_rps" and ra.study.capacity and rb.study.capacity:
            rows += _capacity_rows(ra, rb, same)
            continue
        a = intervals.MetricData.from_rounds(ra.rounds, name)
        b = intervals.MetricData.from_rounds(rb.rounds, name)
        if a is None or b is None:
            continue
        for point in [p for p in a.starts if p in b.starts]:
            d = difference(a, b, point)
            m = metrics.get(name)
            verdict = d.verdict() if np.isfinite(d.low) else "not resolved"
            if not same and verdict in ("better", "worse"):  # a number apart, not an effect
                verdict = "higher" if d.estimate > 0 else "lower"
            if one_start and verdict != "not resolved" and not (m.exact and d.low == d.high):
                # round-to-round noise only: a restart alone moves the value by more
                verdict = ONE_START
            rows.append({"point": point, "metric": name, "A": float(a.back(a.center(point))),
                         "B": float(b.back(b.center(point))), "change": d.estimate, "low": d.low, "high": d.high,
                         "relative": d.relative, "verdict": verdict, "label": m.label,
                         "workload": "same" if same else "different"})
    return pd.DataFrame(rows)


def _capacity_rows(ra: report.Run, rb: report.Run, same: bool) -> list[dict]:
    """Capacity, B over A, per point both measured: capacity.estimate's gain (a ratio
    with its interval; a bound where either side's capacity is one), never a 0 for a
    capacity below the lowest load; resolved as told_apart says (both spreads measured)."""
    from ..capacity.estimate import told_apart
    m, rows = metrics.get("capacity_rps"), []
    for point in [s.point for s in ra.measured if s.point in {x.point for x in rb.measured}]:
        pa, pb = ra.capacity(point), rb.capacity(point)
        if pa is None or pb is None:
            continue
        t = told_apart(pb, pa)
        g = t.gain
        less1 = lambda v: v - 1 if v is not None else np.nan  # noqa: E731
        if not t.resolved:   # an unresolved gain, or one start: no restart spread
            verdict = "not resolved"
        else:
            up = g.kind == "at_least" or (g.kind == "value" and g.value > 1)
            verdict = ("better" if up else "worse") if same else ("higher" if up else "lower")
        value = lambda pc: pc.rps(pc.config.value) if pc.config.kind == "value" else np.nan  # noqa: E731
        rows.append({"point": point, "metric": "capacity_rps", "A": value(pa), "B": value(pb),
                     "change": less1(g.value), "low": less1(g.low), "high": less1(g.high), "relative": True,
                     "verdict": verdict, "label": m.label, "workload": "same" if same else "different",
                     "bound": {"at_least": ">=", "at_most": "<="}.get(g.kind, ""),
                     "A_cell": pa.cell(), "B_cell": pb.cell()})
    return rows


def _bound(row) -> str:
    """'>= ' where a capacity row's change is a lower bound, '<= ' an upper one, else ''."""
    b = getattr(row, "bound", "")
    return f"{b} " if isinstance(b, str) and b else ""


def table(df: pd.DataFrame) -> pd.DataFrame:
    """One row per point, one column per metric: 'B vs A: +12% [+3%, +21%] worse'."""
    if df.empty:
        return df
    def cell(r):
        f = (lambda v: f"{v:+.1%}") if r.relative else (lambda v: f"{v:+.3g}")
        if _bound(r):   # a capacity beyond the loads measured: a bound on the change
            return f"{_bound(r)}{f(r.change)} {r.verdict}"
        if not np.isfinite(r.change):
            return f"not measured apart ({getattr(r, 'A_cell', '')} -> {getattr(r, 'B_cell', '')})"
        lo = f(r.low) if np.isfinite(r.low) else "open"
        hi = f(r.high) if np.isfinite(r.high) else "open"
        ci = f" [{lo}, {hi}]" if np.isfinite(r.low) or np.isfinite(r.high) else ""
        return f"{f(r.change)}{ci} {r.verdict}"
    out = df.assign(cell=df.apply(cell, axis=1)).pivot(index="point", columns="label", values="cell")
    return out


def verdict(df: pd.DataFrame) -> str:
    """One line: how many point x metric pairs the two runs agree on, and which moved."""
    moved = df[~df["verdict"].isin(["not resolved", ONE_START])]
    line = f"{len(df) - len(moved)} of {len(df)} point x metric pairs agree within their 95% intervals"
    if (df["verdict"] == ONE_START).any():
        apart = int((df["verdict"] == ONE_START).sum())
        line = (f"one server start per point: {len(df) - len(moved) - apart} of {len(df)} point x metric pairs "
                f"agree within round-to-round noise and {apart} lie apart by more, which one start cannot tell "
                "from a restart: none is resolved")

    if "workload" in df and (df["workload"] == "different").any():
        line = "across different workloads, so no change is an effect: " + line
        label = "apart (B vs A)"
    else:
        label = "resolved (B vs A)"
    if moved.empty:
        return line
    return line + f"; {label}: " + ", ".join(
        f"{r.point} {r.label} {_bound(r)}{r.change:+.0%} {r.verdict}" if r.relative else
        f"{r.point} {r.label} {r.verdict}"
        for r in moved.itertuples())


def figure(df: pd.DataFrame, out: Path) -> Path | None:
    rel = df[df["relative"] & np.isfinite(df["change"].astype(float))]   # (a capacity bound on both sides: none)
    if rel.empty:
        return None
    labels = list(dict.fromkeys(rel["label"]))
    fig, axs = plt.subplots(1, len(labels), figsize=(4 * len(labels), 0.5 * rel["point"].nunique() + 1.8),
                            squeeze=False, sharey=True)
    for ax, label in zip(axs.flat, labels):
        part = rel[rel["label"] == label].reset_index(drop=True)
        y = np.arange(len(part))
        colours = ["#2ca02c" if v == "better" else "#d62728" if v == "worse" else "#7f7f7f" for v in part["verdict"]]
        # an open end (a capacity bound) draws no bar on that side
        ax.errorbar(part["change"] * 100, y, xerr=[((part["change"] - part["low"]) * 100).fillna(0),
                                                   ((part["high"] - part["change"]) * 100).fillna(0)],
                    fmt="none", ecolor=colours)
        ax.scatter(part["change"] * 100, y, c=colours, zorder=3)
        ax.axvline(0, color="black", lw=0.8)
        ax.set_yticks(y, part["point"])
        ax.set_title(label)
        ax.set_xlabel("B vs A (%)")
    fig.tight_layout()
    path = Path(out) / "compare.png"
    save_figure(fig, path, dpi=100)
    plt.close(fig)
    return path


def header(ra: report.Run, rb: report.Run) -> str:
    """What differs between the two studies (each key with both values) and the points
    measured in one run only: what a reader needs before the numbers."""
    diffs = study_differences(ra, rb)
    lines = [f"A: {ra.folder.path.name}", f"B: {rb.folder.path.name}"]
    if note := one_start_line(ra, rb):
        lines.insert(0, note)
    if diffs:
        lines.append("the studies differ in (A -> B):")
        lines += [f"{'*' if _workload_key(k) else ' '} {k}: {a!r} -> {b!r}" for k, a, b in diffs]
    else:
        lines.append("the studies are the same (parameters, engine, executor, vLLM, GPUs)")
    if not same_workload(diffs):
        lines.append("the workloads differ (* above): the numbers are shown side by side, but no change below is "
                     "an effect of the other differences; verdicts say only higher or lower")
    for name in METRICS:   # a figure the kit added later: a run made before has none
        has = [who for who, r in (("A", ra), ("B", rb)) if name in r.rounds.columns and r.rounds[name].notna().any()]
        if len(has) == 1:
            lines.append(f"{metrics.get(name).label}: not recorded by {'B' if has == ['A'] else 'A'} "
                         "(made before the kit recorded it), so not compared")
    pa, pb = [[s.point for s in r.measured] for r in (ra, rb)]
    for who, mine, theirs in (("A", pa, pb), ("B", pb, pa)):
        alone = [p for p in mine if p not in theirs]
        if alone:
            lines.append(f"left out, measured in {who} only: " + ", ".join(alone))
    return "\n".join(lines)


def compare_runs(run_a, run_b, out: Path | None = None) -> tuple[str, pd.DataFrame, str]:
    """(what differs and what was left out, the side-by-side table, the one-line
    verdict); with `out`, also the CSV and figure."""
    ra, rb = report.Run.load(run_a), report.Run.load(run_b)
    df, head = _compare(ra, rb), header(ra, rb)
    if df.empty:
        raise ValueError(f"{run_a} and {run_b} have no measured point in common\n{head}")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        df.to_csv(Path(out) / "compare.csv", index=False)
        figure(df, out)
    return head, table(df), verdict(df)
