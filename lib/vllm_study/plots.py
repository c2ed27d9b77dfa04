"""Seaborn figures for a run: heatmaps over the grid (medians annotated, failed points
masked and labelled), metric-vs-chunk-size lines, and the per-round trend."""
from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import seaborn as sns

from .params import AXIS_ABBREV, _fmt


def _label(axis: str) -> str:
    return {"max_num_batched_tokens": "max_num_batched_tokens (chunk size)",
            "kv_cache_memory_bytes": "KV cache size"}.get(axis, axis)


def heatmap(med: pd.DataFrame, metric: str, x: str, y: str, title: str, fmt: str = ".0f",
            ax=None, cmap: str = "viridis_r"):
    """One cell per (x, y) point; failed points (no value) are grey and say 'failed'."""
    ax = ax or plt.gca()
    table = med.pivot_table(index=y, columns=x, values=metric, aggfunc="first", dropna=False)
    status = med.pivot_table(index=y, columns=x, values="status", aggfunc="first")
    table = table.reindex(index=status.index, columns=status.columns).astype(float)
    sns.heatmap(table, annot=True, fmt=fmt, mask=table.isna(), cmap=cmap, ax=ax,
                cbar_kws={"label": title}, linewidths=0.5, linecolor="white")
    ax.set_facecolor("#d9d9d9")
    for (i, j), v in np.ndenumerate(table.to_numpy()):
        if np.isnan(v):
            ax.text(j + 0.5, i + 0.5, "failed" if status.iat[i, j] == "failed" else "n/a",
                    ha="center", va="center", color="#b00020", fontsize=9)
    ax.set_xticklabels([_fmt(x, v) for v in table.columns])
    ax.set_yticklabels([_fmt(y, v) for v in table.index], rotation=0)
    ax.set_xlabel(_label(x))
    ax.set_ylabel(_label(y))
    ax.invert_yaxis()
    ax.set_title(title)
    return ax


def heatmap_grid(med: pd.DataFrame, metrics: dict[str, tuple[str, str]], x: str, y: str,
                 out: Path | None = None, cols: int = 3):
    """Several heatmaps side by side; metrics: column -> (title, number format)."""
    present = {m: v for m, v in metrics.items() if m in med.columns and med[m].notna().any()}
    rows = -(-len(present) // cols)
    fig, axs = plt.subplots(rows, cols, figsize=(5.2 * cols, 4.2 * rows), squeeze=False)
    for ax, (m, (title, fmt)) in zip(axs.flat, present.items()):
        heatmap(med, m, x, y, title, fmt, ax=ax,
                cmap="viridis" if "throughput" in m or "hit" in m else "viridis_r")
    for ax in list(axs.flat)[len(present):]:
        ax.axis("off")
    fig.tight_layout()
    if out:
        fig.savefig(out, dpi=110)
    return fig


def trend_vs_axis(med: pd.DataFrame, metrics: dict[str, str], x: str, hue: str | None,
                  out: Path | None = None):
    """Each metric against x (log2 axis for chunk sizes), one line per hue value."""
    fig, axs = plt.subplots(1, len(metrics), figsize=(5 * len(metrics), 3.8), squeeze=False)
    data = med.copy()
    if hue:
        data[hue] = data[hue].map(lambda v: f"{AXIS_ABBREV.get(hue, hue)}={_fmt(hue, v)}")
    for ax, (m, title) in zip(axs.flat, metrics.items()):
        if m in data.columns:
            sns.lineplot(data=data, x=x, y=m, hue=hue, marker="o", ax=ax)
        if x == "max_num_batched_tokens":
            ax.set_xscale("log", base=2)
            ticks = sorted(data[x].unique())
            ax.set_xticks(ticks, [str(int(t)) for t in ticks])  # 128, not 2^7
            ax.minorticks_off()
        ax.set_title(title)
        ax.set_xlabel(_label(x))
        ax.set_ylabel(title)
    fig.tight_layout()
    if out:
        fig.savefig(out, dpi=110)
    return fig


def round_trend(rounds: pd.DataFrame, metric: str = "ttft_p90_ms", title: str = "TTFT P90 ms",
                out: Path | None = None):
    """The metric in each round, per point: spread across rounds is the noise floor."""
    fig, ax = plt.subplots(figsize=(7, 3.8))
    sns.lineplot(data=rounds, x="round", y=metric, hue="point", marker="o", ax=ax)
    ax.set_xticks(sorted(rounds["round"].unique()))
    ax.set_title(f"{title} per round")
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    if out:
        fig.savefig(out, dpi=110)
    return fig
