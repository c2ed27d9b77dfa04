"""Seaborn figures for a run: heatmaps over the grid (medians annotated; failed points
grey, points missing rounds marked), metric-vs-axis lines with their 95% intervals, and
each round per point. Colours, labels and number formats come from the metric registry.

Each drawing function returns None when it drew, or a sentence saying why it could not
(a one-axis study has no heatmap; a study where every point failed has nothing to draw).
"""
from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import seaborn as sns

from matplotlib.patches import Rectangle
from matplotlib.textpath import TextPath

from ..analysis import intervals
from ..vocab import axes, metrics
from . import capacity_section as cs
from .capacity_section import is_capacity_study, slo_metrics
from .report import Run, long_estimates
from ..vocab.figure_file import save_figure

PARTIAL_NOTE = ("boxed = cannot be told apart from the best point (95%); * = not every planned round was "
                "measured; grey = failed")


def _nothing(r: Run) -> str | None:
    if not r.measured:
        return ("no point has a measured round, so there is nothing to draw: "
                "the failure table above says why each point failed")
    return None


# A capacity study's panels: each point's figures come from its own capacity's load
CAPACITY_NOTE = ("boxed (capacity only) = the best capacity and those not told apart from it; '@' = the load each "
                 "cell was measured at (its own capacity's, so latencies are not compared across cells); "
                 "grey '< x' = missed the SLO at the lowest load x; * = not every planned round was measured")


def heatmap(est: pd.DataFrame, status: pd.DataFrame, metric: str, x: str, y: str | list[str], ax,
            tied: set | None = None, empty: dict | None = None, below: dict | None = None) -> None:
    """One cell per (x, y) point: the value, '*' where rounds are missing, grey + 'failed'
    where none were measured, a box around the points tied with the best. `y` may be
    several axes (a row per combination of their values). `empty`: what a cell with no
    value says instead of 'n/a' (a capacity below the floor: '< 2.95'); `below`: a second
    line under a cell's value (the load it was measured at)."""
    m = metrics.get(metric)
    sub = est[est["metric"] == metric]
    table = sub.pivot_table(index=y, columns=x, values="value", aggfunc="first")
    table = table.reindex(index=status.index, columns=status.columns).astype(float)
    # pcolormesh, not sns.heatmap: seaborn draws the whole figure on every call (to check
    # tick-label overlap), which made a 13-panel grid take ~20 s; this one takes ~3 s.
    values = table.to_numpy()
    mesh = ax.pcolormesh(np.ma.masked_invalid(values), cmap=m.cmap, edgecolors="white", linewidth=0.5)
    ax.figure.colorbar(mesh, ax=ax, label=m.title).outline.set_linewidth(0)
    for side in ax.spines.values():
        side.set_visible(False)
    ax.set_xticks(np.arange(len(table.columns)) + 0.5, [axes.get(x).fmt(v) for v in table.columns])
    ax.set_yticks(np.arange(len(table.index)) + 0.5, [_values_label(y, v) for v in table.index])
    ax.tick_params(length=0)
    ax.set_facecolor("#d9d9d9")
    for (i, j), v in np.ndenumerate(values):
        st = status.iat[i, j]
        key = (table.index[i], table.columns[j])
        if np.isnan(v):
            text, colour = ("failed" if st == "failed" else (empty or {}).get(key, "n/a")), "#b00020"
        else:
            text, colour = m.format(v) + ("*" if st != "ok" else ""), "white" if _dark(table, v, m) else "black"
        if below and key in below and not (np.isnan(v) and st == "failed"):
            text += f"\n{below[key]}"
        ax.text(j + 0.5, i + 0.5, text, ha="center", va="center", color=colour, fontsize=9 if "\n" not in text else 8)
        if tied and (table.index[i], table.columns[j]) in tied:
            ax.add_patch(Rectangle((j + 0.04, i + 0.04), 0.92, 0.92, fill=False, edgecolor="#d62728", lw=2))
    ax.set_xlabel(axes.get(x).label)
    ax.set_ylabel(axes.get(y).label if isinstance(y, str) else ", ".join(axes.get(a).short for a in y))
    ax.set_title(m.title)


def _others(r: Run, x: str) -> list[str]:
    """The axes other than `x`: a figure over `x` keeps each combination of their values
    apart (a row of a heatmap, a line of a trend); drawing only one of them would put two
    points in one cell and show whichever came first."""
    return [a for a in r.axes if a != x]


def _values_label(names: str | list[str], values) -> str:
    """A row's or line's values: '1024' for one axis, 'mns=1024, pc=on' for several."""
    if isinstance(names, str):
        return axes.get(names).fmt(values)
    return ", ".join(f"{axes.get(a).short}={axes.get(a).fmt(v)}" for a, v in zip(names, values))


def _dark(table: pd.DataFrame, v: float, m: metrics.Metric) -> bool:
    """Is the cell's colour dark (text in white)? viridis is dark at its low end."""
    lo, hi = np.nanmin(table.to_numpy()), np.nanmax(table.to_numpy())
    frac = 0.5 if hi == lo else (v - lo) / (hi - lo)
    return (frac < 0.5) if m.cmap == "viridis" else (frac > 0.5)


def _status_table(r: Run, x: str, y: str | list[str]) -> pd.DataFrame:
    rows = [{**s.values, "status": s.status} for s in r.summaries]
    return pd.DataFrame(rows).pivot_table(index=y, columns=x, values="status", aggfunc="first")


def heatmap_names(r: Run, names=metrics.HEATMAPS) -> list[str]:
    """The panels in order: a capacity study's capacity first, then the metrics the SLO
    bounds (capacity_section.slo_metrics: e.g. ITL P99, which HEATMAPS lacks), then the rest."""
    lead = (["capacity_rps"] if is_capacity_study(r) else []) + (slo_metrics(r) if r.slo or is_capacity_study(r)
                                                                 else [])
    return list(dict.fromkeys([*lead, *names]))


def heatmap_grid(r: Run, names=metrics.HEATMAPS, out: Path | None = None, cols: int = 3) -> str | None:
    """The heatmaps over the first two axes (more axes: a row per combination). In a
    capacity study each point's figures come from the round at its own capacity (or at the
    floor where it missed there): a latency 'best' would favour the point measured at the
    lowest load, so only the capacity panel boxes its best, and each other cell says the
    load it was measured at."""
    if len(r.axes) < 2:
        return "no second grid axis: no heatmap" + ("; see the trend lines below" if r.axes else "")
    if why := _nothing(r):
        return why
    x, ys = r.axes[0], _others(r, r.axes[0])
    y = ys[0] if len(ys) == 1 else ys
    est = long_estimates(r)
    present = [n for n in heatmap_names(r, names) if n in set(est["metric"])]
    status = _status_table(r, x, y)
    capacity = is_capacity_study(r)
    key = {s.point: ((s.values[y] if isinstance(y, str) else tuple(s.values[a] for a in ys)), s.values[x])
           for s in r.summaries if x in s.values and all(a in s.values for a in ys)}
    at = {key[p]: "@" + cs.measured_at_words(r, p) for p in key} if capacity else None
    empty = {key[p]: cs.below_lowest_load(r, p) for p in key if cs.below_everywhere(r, p)} if capacity else None
    rows = -(-len(present) // cols)
    fig, axs = plt.subplots(rows, cols, figsize=(5.2 * cols, 4.2 * rows), squeeze=False)
    for ax, n in zip(axs.flat, present):
        tied = None
        if capacity:   # the recommendation's best capacity and its ties; no latency is compared across loads
            if n == "capacity_rps":
                rec = r.recommendation({})
                tied = {key[p] for p in [rec.point, *rec.tied] if p in key}
            heatmap(est, status, n, x, y, ax, tied, empty=empty if n == "capacity_rps" else None,
                    below=None if n == "capacity_rps" else at)
            continue
        vb = intervals.versus_best(r.rounds, n)
        if not vb.empty:
            cells = est[(est["metric"] == n) & est["point"].isin(vb.index[vb["tied_with_best"]])]
            rows = cells[y] if isinstance(y, str) else cells[ys].itertuples(index=False, name=None)
            tied = set(zip(rows, cells[x]))
        heatmap(est, status, n, x, y, ax, tied)
    for ax in list(axs.flat)[len(present):]:
        ax.axis("off")
    fig.text(0.01, 0.002, CAPACITY_NOTE if capacity else PARTIAL_NOTE, fontsize=8)
    fig.tight_layout(rect=(0, 0.02, 1, 1))
    if out:
        save_figure(fig, out, dpi=110)
    return None


def _x_axis(ax, x: str, values) -> None:
    """The x axis as the registry scales and labels it: log2 for sizes (ticks at the
    values, 128 not 2^7), a tick per value for categories (off/on), matplotlib's own for
    linear ones; tick labels as point ids write the values."""
    a = axes.get(x)
    ax.set_xlabel(a.label)
    if a.scale == "linear":
        return
    ticks = pd.Series(list(values)).dropna().drop_duplicates().sort_values().tolist()
    if a.scale == "log2":
        ax.set_xscale("log", base=2)
        ax.minorticks_off()
        ticks = [int(t) for t in ticks]  # sizes: a column with a gap (NaN) holds them as floats
    ax.set_xticks(ticks, [a.fmt(t) for t in ticks])


def trend_vs_axis(r: Run, names=metrics.TRENDS, out: Path | None = None) -> str | None:
    """Each metric against the first axis (log2 for sizes, as axes.py says), one line per
    combination of the other axes' values, with the 95% interval as a band."""
    if not r.axes:
        return "an endpoint study has no grid axis: see the target comparison above"
    if why := _nothing(r):
        return why
    x = r.axes[0]
    hue = _others(r, x)
    est = long_estimates(r)
    capacity = is_capacity_study(r)
    if capacity:   # capacity first, then the SLO's metrics, each point's at its own capacity's load
        names = list(dict.fromkeys(["capacity_rps", *slo_metrics(r), *names]))
    names = [n for n in names if n in set(est["metric"])]  # capacity only where a study searched it
    if not names:
        return "none of the trend metrics was measured"
    # one colour a line in every panel, though a panel may lack a line (a capacity below the floor)
    cycle = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    colour = {k: cycle[i % len(cycle)] for i, (k, _) in enumerate(est.groupby(hue))} if hue else {}
    fig, axs = plt.subplots(1, len(names), figsize=(5 * len(names), 3.8), squeeze=False)
    for ax, n in zip(axs.flat, names):
        m = metrics.get(n)
        sub = est[est["metric"] == n].sort_values(x)
        for key, part in (sub.groupby(hue) if hue else [(None, sub)]):
            label = _values_label(hue, key) if hue else None
            line, = ax.plot(part[x], part["value"], marker="o", label=label, color=colour.get(key))
            ax.fill_between(part[x], part["ci_low"], part["ci_high"], color=line.get_color(), alpha=0.2)
            odd = part[part["status"] != "ok"]
            ax.scatter(odd[x], odd["value"], marker="*", s=120, color=line.get_color(), zorder=3)
            if capacity and n not in ("capacity_rps", "capacity_load"):   # the load each was measured at
                for px, py, pid in zip(part[x], part["value"], part["point"]):
                    ax.annotate("@" + cs.measured_at_words(r, pid), (px, py), xytext=(3, 4),
                                textcoords="offset points", fontsize=7, color=line.get_color())
        bound_at = _capacity_bounds(ax, r, n, x) if n in ("capacity_rps", "capacity_load") else []
        _x_axis(ax, x, pd.concat([sub[x], pd.Series(bound_at, dtype=sub[x].dtype)]))
        ax.set_title(m.title)
        ax.set_ylabel(m.title)
        if hue or bound_at:
            handles, labels = ax.get_legend_handles_labels()
            seen = dict(zip(labels, handles))   # one entry per kind of bound
            ax.legend(seen.values(), seen.keys(), fontsize=8)
    fig.text(0.01, 0.002, "bands: 95% intervals; * = not every planned round was measured"
             + ("; @ = the load a point's figures were measured at (its own capacity's: latencies are not "
                "compared across points)" if capacity else ""), fontsize=8)
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    if out:
        save_figure(fig, out, dpi=110)
    return None


def _capacity_bounds(ax, r: Run, name: str, x: str) -> list:
    """A capacity that is a bound (capacity.estimate) has no value on the line: a
    grey triangle at its bound, pointing down for "below the lowest load", up for "at or
    above the highest"; never a point at 0. Returns the axis values it drew at."""
    drawn = []
    for s in r.summaries:
        pc = r.capacity(s.point)
        if pc is None or pc.config.kind not in ("below", "at_least") or x not in s.values:
            continue
        bound = pc.rps(pc.config.value) if name == "capacity_rps" else pc.config.value
        if bound is None:
            continue
        down = pc.config.kind == "below"
        ax.scatter([s.values[x]], [bound], marker="v" if down else "^", s=80, color="grey", zorder=3,
                   label="< lowest load" if down else "≥ highest load")
        drawn.append(s.values[x])
    return drawn


def round_trend(r: Run, metric: str = "ttft_p90_ms", out: Path | None = None) -> str | None:
    """The metric in each round of each server start, per point: the spread is the noise
    the medians sit on."""
    df = r.rounds
    if df.empty or metric not in df.columns:
        return _nothing(r) or f"no round has {metric}"
    df = df[(df["group"] == "all") & (df["round_status"] == "ok")].copy()
    if df.empty:
        return _nothing(r) or "no round completed"
    df["start.round"] = df["start"].astype(int).astype(str) + "." + df["round"].astype(int).astype(str)
    m = metrics.get(metric)
    fig, ax = plt.subplots(figsize=(7, 3.8))
    sns.lineplot(data=df, x="start.round", y=metric, hue="point", marker="o", ax=ax)
    ax.set_title(f"{m.title} per round (server start . round)")
    ax.set_ylabel(m.title)
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    if out:
        save_figure(fig, out, dpi=110)
    return None


def cache_size_curve(curve: pd.DataFrame, kv_tokens: int, unbounded: float, label: str, block_tokens: int,
                     out: Path | None = None) -> str | None:
    """The cache model's hit rate over the whole trace against the cache size (log x),
    the never-evicting rate as a ceiling, this server's KV size marked."""
    fig, ax = plt.subplots(figsize=(7, 3.8))
    ax.plot(curve["kv_tokens"], curve["hit_rate"], marker="o",
            label=f"the cache model (vLLM's LRU, {block_tokens}-token blocks)")
    ax.axhline(unbounded, color="grey", linestyle="--", label=f"never evicting: {unbounded:.3f}")
    at = curve.loc[curve["kv_tokens"] == kv_tokens, "hit_rate"]
    ax.axvline(kv_tokens, color="C3", linestyle=":",
               label=f"this server's KV cache: {kv_tokens:,} tokens" + (f" ({at.iloc[0]:.3f})" if len(at) else ""))
    ax.set_xscale("log")
    ax.set_xlabel("prefix cache size (tokens of KV)")
    ax.set_ylabel("token hit rate over the whole trace")
    ax.set_ylim(0, max(unbounded, curve["hit_rate"].max()) * 1.1 or 1)
    ax.set_title(f"Hit rate against cache size: {label}", fontsize=10)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    if out:
        save_figure(fig, out, dpi=110)
    return None


def _spread(wanted: list[float], gap: float, lo: float = 0.0, hi: float = 1.0) -> list[float]:
    """Positions as near the wanted ones (sorted ascending) as can be with every two at
    least `gap` apart, all within [lo + gap/2, hi - gap/2]: a forward pass pushes each up
    off the one below it, a backward pass pulls the top ones back under hi. (The caller
    makes room: len(wanted) * gap <= hi - lo.)"""
    out: list[float] = []
    for w in wanted:
        out.append(max(w, lo + gap / 2, out[-1] + gap if out else lo))
    for i in range(len(out) - 1, -1, -1):
        out[i] = min(out[i], hi - gap / 2, out[i + 1] - gap if i + 1 < len(out) else hi)
    return out


PARETO_LABEL_PT = 7.5   # the front's labels: font size, and their line pitch below
PARETO_LINE = 1.5       # times the font size: one label's height with a little air


def pareto_plot(table: pd.DataFrame, out: Path | None = None) -> str | None:
    """Throughput per GPU against per-user speed, and against TTFT P90; the front of each
    (points no other point beats on both) drawn as a line, ties kept.

    Only the front's points are named, each in a column beside its panel with a leader
    line to the point: labels at the points overlapped wherever points sat close (tied
    points sit on top of each other), while a column spaced a line apart cannot overlap,
    nor cover a point. The dominated points are grey and unnamed: they are no one's
    choice, and the Pareto table lists every point's values."""
    if table.empty:
        return "no point has throughput, TPOT and TTFT measured: no Pareto front"
    y = "output tok/s per GPU"
    panels = ((("per-user tok/s", "front: speed"), "throughput vs per-user speed (both: higher is better)"),
              (("TTFT P90 (ms)", "front: TTFT"), "throughput vs TTFT P90 (lower TTFT is better)"))
    most = max(int(table[front].sum()) for (_, front), _ in panels)
    pitch = PARETO_LABEL_PT * PARETO_LINE / 72                       # inches per label
    named = table.index[table["front: speed"] | table["front: TTFT"]]
    # the longest name (TextPath: its width in points at this size), and the leader's gap
    label_w = max(TextPath((0, 0), str(n), size=PARETO_LABEL_PT).get_extents().width for n in named) / 72 + 0.3
    left, right, gap, top, bottom = 0.75, 0.1, 0.75, 0.35, 0.55
    # 11 x 4.2 inches as before (the committed reports' nbval check reads "<Figure size
    # 1100x420 ...>"), wider only for long names, taller only for more labels than fit
    ax_w = max(2.8, (11 - left - gap - right) / 2 - label_w)
    ax_h = max(4.2 - bottom - top, most * pitch / 0.95)              # room for every label in one column
    width = left + 2 * (ax_w + label_w) + gap + right
    height = bottom + ax_h + top
    fig = plt.figure(figsize=(width, height))
    for i, ((x, front), title) in enumerate(panels):
        x0 = left + i * (ax_w + label_w + gap)
        ax = fig.add_axes((x0 / width, bottom / height, ax_w / width, ax_h / height))
        on = table[table[front]].sort_values(x)
        ax.scatter(table[x], table[y], color="#9e9e9e", zorder=2, label="dominated")
        ax.plot(on[x], on[y], marker="o", color="#d62728", zorder=3, label="front")
        ax.set_xlabel(x)
        ax.set_ylabel(y)
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=8)
        ylo, yhi = ax.get_ylim()
        by_y = on.sort_values([y, x])
        wanted = [(v - ylo) / (yhi - ylo) for v in by_y[y]]
        gap_frac = pitch / ax_h
        for (name, row), at in zip(by_y.iterrows(), _spread(wanted, gap_frac)):
            ax.annotate(str(name), (row[x], row[y]), xytext=(1.03, at), textcoords="axes fraction",
                        fontsize=PARETO_LABEL_PT, va="center", ha="left", annotation_clip=False,
                        arrowprops={"arrowstyle": "-", "color": "#d62728", "lw": 0.6, "alpha": 0.7,
                                    "shrinkA": 0, "shrinkB": 3})
    if out:
        save_figure(fig, out, dpi=100)
    return None


def slice_plot(r: Run, metric: str, x: str | None = None, hue: str | None = None, other: Run | None = None,
               out: Path | None = None) -> str | None:
    """One metric against one grid axis: each point's value with its 95% interval, every
    round as a dot behind it (starts in different shades), a line per combination of the
    other axes' values (`hue` named first in its label); with `other`, that run's values
    dashed beside."""
    if not r.axes:
        return "an endpoint study has no grid axis: see the target comparison"
    x = x or r.axes[0]
    hue = sorted(_others(r, x), key=lambda a: a != hue)
    m = metrics.get(metric)
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    for run, style, tag in ((r, "-", ""), (other, "--", " (other run)")):
        if run is None:
            continue
        est = long_estimates(run)
        est = est[est["metric"] == metric] if not est.empty else est
        if est.empty:
            continue
        rounds = run.rounds[(run.rounds["group"] == "all") & (run.rounds["round_status"] == "ok")]
        for key, part in (est.groupby(hue) if hue else [(None, est)]):
            part = part.sort_values(x)
            label = (_values_label(hue, key) if hue else metric) + tag
            line, = ax.plot(part[x], part["value"], style, marker="o", label=label)
            ax.fill_between(part[x], part["ci_low"], part["ci_high"], color=line.get_color(), alpha=0.15)
            dots = rounds[rounds["point"].isin(part["point"])]
            ax.scatter(dots[x], dots[metric], s=12, color=line.get_color(), alpha=0.5)
    _x_axis(ax, x, [v for run in (r, other) if run for v in long_estimates(run)[x]])
    ax.set_ylabel(m.title)
    ax.set_title(f"{m.title}: value, 95% interval and every round")
    ax.legend(fontsize=8)
    fig.tight_layout()
    if out:
        save_figure(fig, out, dpi=100)
    return None


def margin_vs_load(r: Run, out: Path | None = None) -> str | None:
    """What decides a capacity study: each config's binding SLO margin (the largest of its
    bounds' measured / limit; at most 1 meets the SLO) at every load its search measured,
    one dot a start's step and a line through their medians, the SLO at 1, and each
    config's capacity with its 95% interval on that line (a triangle where it is a bound).
    The margins are those the search judged (capacity.bracket: a step's windows pooled)."""
    if not is_capacity_study(r):
        return "not a capacity study"
    cycle = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    fig, ax = plt.subplots(figsize=(8, 4.4))
    drawn = False
    for i, s in enumerate(r.summaries):
        colour = cycle[i % len(cycle)]
        steps = [(st["load"], max(st["margins"].values())) for c in cs.completed_capacities(r, s.point)
                 for st in c.steps if st.get("margins") and st.get("load") is not None]
        pc = r.capacity(s.point)
        if not steps or pc is None:
            continue
        drawn = True
        df = pd.DataFrame(steps, columns=["load", "margin"])
        med = df.groupby("load")["margin"].median()
        ax.scatter(df["load"], df["margin"], s=14, color=colour, alpha=0.5)
        ax.plot(med.index, med.values, marker="o", color=colour,
                label=f"{s.point}: {pc.cell('load')} (binds: {cs.binding_bound(r, s.point)})")
        c = pc.config
        if c.kind == "value":
            lo = c.low if c.low is not None else df["load"].min()
            hi = c.high if c.high is not None else df["load"].max()
            ax.plot([lo, hi], [1, 1], color=colour, lw=7, alpha=0.35, solid_capstyle="butt")
            ax.scatter([c.value], [1], marker="|", s=200, color=colour, zorder=4)
        elif c.kind in ("below", "at_least"):
            ax.scatter([c.value], [1], marker="<" if c.kind == "below" else ">", s=90, color=colour, zorder=4)
    if not drawn:
        plt.close(fig)
        return ("no capacity step recorded its SLO margins (runs searched before the margins were kept): "
                "the capacity table below has each config's bracket and the bound that decided it")
    ax.axhline(1, color="black", linestyle="--", lw=1, label="the SLO (margin 1)")
    over = r.study.capacity.over
    ax.set_xlabel({"speed": "load: speed (x the trace's real rate)", "rate": "load: requests/s"}.get(
        over, f"load: {over}"))
    ax.set_ylabel("binding SLO margin (measured / bound)")
    ax.set_title("Where each config crosses the SLO: its capacity [95% interval] on the dashed line", fontsize=10)
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    if out:
        save_figure(fig, out, dpi=100)
    return None
