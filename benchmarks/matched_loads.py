"""What one knob does at the same load, in a capacity study: two values of one grid axis
compared at every load (speed, rate or concurrency) where both were measured with every
other axis equal. A capacity comparison compares each config at its own capacity, i.e.
at different loads; this compares like with like, on the search's own steps.

Per matched cell (other axes, load): the ratio of the two values' geometric means over
their starts, with a t interval from the within-cell start-to-start spread pooled over
all cells; then the mean log ratio over cells. Cells of one start share its server, so
the overall interval treats them as independent and is somewhat too narrow.

    python benchmarks/matched_loads.py results/<run> enable_prefix_caching true false \\
        [--metric ttft_sched_p90_ms --metric ttft_p50_ms]
"""
from __future__ import annotations

import argparse

import numpy as np
import pandas as pd
from scipy import stats

from vllm_study.report import report

DEFAULT_METRICS = ("ttft_sched_p90_ms", "ttft_p50_ms", "itl_p99_ms", "output_throughput")


def matched(rounds: pd.DataFrame, axis: str, a: str, b: str, metric: str, axes: list[str]) -> pd.DataFrame:
    df = rounds[(rounds["group"] == "all") & (rounds["round_status"] == "ok") & rounds[metric].gt(0)]
    df = df.assign(_v=np.log(df[metric]), _level=df[axis].astype(str).str.lower())
    cells = []
    by = [x for x in axes if x != axis] + ["load"]
    for key, g in df.groupby(by):
        va, vb = g[g["_level"] == a]["_v"].to_numpy(), g[g["_level"] == b]["_v"].to_numpy()
        if len(va) and len(vb):
            name = ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in zip(by, key))
            cells.append({"cell": name, "a": va, "b": vb})
    if not cells:
        return pd.DataFrame()
    resid = np.concatenate([np.concatenate([c["a"] - c["a"].mean(), c["b"] - c["b"].mean()]) for c in cells])
    dof = sum(len(c["a"]) + len(c["b"]) - 2 for c in cells)
    if dof < 1:
        raise SystemExit(f"{metric}: one start per level in every cell: no spread to build an interval from")
    sd, t = float(np.sqrt((resid ** 2).sum() / dof)), float(stats.t.ppf(0.975, dof))
    rows, var_sum = [], 0.0
    for c in cells:
        d, var = c["a"].mean() - c["b"].mean(), 1 / len(c["a"]) + 1 / len(c["b"])
        var_sum += var
        rows.append({"cell": c["cell"], "ratio": np.expm1(d), "low": np.expm1(d - t * sd * np.sqrt(var)),
                     "high": np.expm1(d + t * sd * np.sqrt(var)), "_d": d})
    mean_d, half = np.mean([r["_d"] for r in rows]), t * sd * np.sqrt(var_sum) / len(rows)
    rows.append({"cell": f"over {len(cells)} cells (pooled sd {np.expm1(sd):.1%}, df {dof})",
                 "ratio": np.expm1(mean_d), "low": np.expm1(mean_d - half), "high": np.expm1(mean_d + half),
                 "_d": mean_d})
    return pd.DataFrame(rows).drop(columns="_d")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run")
    ap.add_argument("axis", help="a grid axis, e.g. enable_prefix_caching")
    ap.add_argument("a", help="the value compared (the ratio's numerator)")
    ap.add_argument("b", help="the value compared against")
    ap.add_argument("--metric", action="append", help=f"default: {', '.join(DEFAULT_METRICS)}")
    o = ap.parse_args()
    r = report.Run.load(o.run)
    axes = r.axes
    if o.axis not in axes:
        raise SystemExit(f"{o.axis!r} is not an axis of this study's grid: {axes}")
    if "load" not in r.rounds.columns:
        raise SystemExit(f"{o.run} is not a capacity study: its rounds have no load to match on")
    for m in o.metric or DEFAULT_METRICS:
        if m not in r.rounds.columns:
            print(f"{m}: not measured in this run\n")
            continue
        t = matched(r.rounds, o.axis, o.a.lower(), o.b.lower(), m, axes)
        print(f"{m}: {o.axis}={o.a} over {o.axis}={o.b} at matched loads")
        if t.empty:
            print("  no load where both were measured\n")
            continue
        for _, row in t.iterrows():
            print(f"  {row['cell']}: {row['ratio']:+.1%} [{row['low']:+.1%}, {row['high']:+.1%}]")
        print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
