"""Two runs side by side: another vLLM version, GPU, model, a changed fixed argument, or
a gateway against a direct port. Per point that both runs measured, the change of each
headline metric from run A to run B with its 95% interval, and a verdict (better, worse,
not resolved).

Each run's point values and standard errors come from its own noise model (analysis.py);
the difference's interval uses the smaller of the two runs' degrees of freedom, which
errs on the wide side.

    python -m vllm_study compare results/<run A> results/<run B> --out compare/
"""
from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from . import analysis, metrics, report
from .analysis import Difference

METRICS = ("capacity_rps", "ttft_p90_ms", "itl_p90_ms", "tpot_p50_ms", "output_throughput", "prefix_cache_hit_rate")


def difference(a: analysis.MetricData, b: analysis.MetricData, point: str) -> Difference:
    """B minus A at one point: a relative change when both runs use the log scale;
    otherwise in the metric's unit (with an interval only when both are linear)."""
    se_a, df_a, _ = a.se(point, a.noise())
    se_b, df_b, _ = b.se(point, b.noise())
    half = analysis._t(min(df_a, df_b)) * float(np.hypot(se_a, se_b))
    if a.log and b.log:
        d = b.center(point) - a.center(point)
        return Difference(a.metric, point, point, True, float(np.expm1(d)), float(np.expm1(d - half)),
                          float(np.expm1(d + half)))
    d = float(b.back(b.center(point)) - a.back(a.center(point)))
    if a.log or b.log:  # one scale each: no common interval
        half = float("nan")
    return Difference(a.metric, point, point, False, d, d - half, d + half)


def compare(run_a, run_b, names=METRICS) -> pd.DataFrame:
    ra, rb = report.Run.load(run_a), report.Run.load(run_b)
    rows = []
    for name in names:
        a = analysis.MetricData.from_rounds(ra.rounds, name)
        b = analysis.MetricData.from_rounds(rb.rounds, name)
        if a is None or b is None:
            continue
        for point in [p for p in a.starts if p in b.starts]:
            d = difference(a, b, point)
            m = metrics.get(name)
            rows.append({"point": point, "metric": name, "A": float(a.back(a.center(point))),
                         "B": float(b.back(b.center(point))), "change": d.estimate, "low": d.low, "high": d.high,
                         "relative": d.relative, "verdict": d.verdict() if np.isfinite(d.low) else "not resolved",
                         "label": m.label})
    return pd.DataFrame(rows)


def table(df: pd.DataFrame) -> pd.DataFrame:
    """One row per point, one column per metric: 'B vs A: +12% [+3%, +21%] worse'."""
    if df.empty:
        return df
    def cell(r):
        f = (lambda v: f"{v:+.1%}") if r.relative else (lambda v: f"{v:+.3g}")
        ci = f" [{f(r.low)}, {f(r.high)}]" if np.isfinite(r.low) else ""
        return f"{f(r.change)}{ci} {r.verdict}"
    out = df.assign(cell=df.apply(cell, axis=1)).pivot(index="point", columns="label", values="cell")
    return out


def verdict(df: pd.DataFrame) -> str:
    """One line: how many point x metric pairs the two runs agree on, and which moved."""
    moved = df[df["verdict"] != "not resolved"]
    line = f"{len(df) - len(moved)} of {len(df)} point x metric pairs agree within their 95% intervals"
    if moved.empty:
        return line
    return line + "; resolved (B vs A): " + ", ".join(
        f"{r.point} {r.label} {r.change:+.0%} {r.verdict}" if r.relative else f"{r.point} {r.label} {r.verdict}"
        for r in moved.itertuples())


def figure(df: pd.DataFrame, out: Path) -> Path | None:
    rel = df[df["relative"]]
    if rel.empty:
        return None
    labels = list(dict.fromkeys(rel["label"]))
    fig, axs = plt.subplots(1, len(labels), figsize=(4 * len(labels), 0.5 * rel["point"].nunique() + 1.8),
                            squeeze=False, sharey=True)
    for ax, label in zip(axs.flat, labels):
        part = rel[rel["label"] == label].reset_index(drop=True)
        y = np.arange(len(part))
        colours = ["#2ca02c" if v == "better" else "#d62728" if v == "worse" else "#7f7f7f" for v in part["verdict"]]
        ax.errorbar(part["change"] * 100, y, xerr=[(part["change"] - part["low"]) * 100,
                                                   (part["high"] - part["change"]) * 100],
                    fmt="none", ecolor=colours)
        ax.scatter(part["change"] * 100, y, c=colours, zorder=3)
        ax.axvline(0, color="black", lw=0.8)
        ax.set_yticks(y, part["point"])
        ax.set_title(label)
        ax.set_xlabel("B vs A (%)")
    fig.tight_layout()
    path = Path(out) / "compare.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def run(run_a, run_b, out: Path | None = None) -> tuple[pd.DataFrame, str]:
    """(the side-by-side table, the one-line verdict); with `out`, also the CSV and figure."""
    df = compare(run_a, run_b)
    if df.empty:
        raise ValueError(f"{run_a} and {run_b} have no measured point in common")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        df.to_csv(Path(out) / "compare.csv", index=False)
        figure(df, out)
    return table(df), verdict(df)
