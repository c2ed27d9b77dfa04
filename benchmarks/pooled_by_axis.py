"""One grid axis on its own: each of its values averaged over the other axes' points,
which serve as replicates. Valid only where the other axes did not bind (the report's
"Did each knob bind?" says), and it inherits any confounding of the run order.

Per metric: each point's value (mean of its starts' medians, log scale where positive),
the mean per value of `axis`, a one-way ANOVA over the axis values, and the contrast of
the values at or below `--split` against those above, with a 95% t-interval from the
pooled within-value spread.

    python benchmarks/pooled_by_axis.py results/<run> --axis max_num_batched_tokens --split 256
"""
from __future__ import annotations

import argparse

import numpy as np
import pandas as pd
from scipy import stats

from vllm_study.analysis import intervals as analysis
from vllm_study.report import report

METRICS = ("ttft_p50_ms", "ttft_p90_ms", "itl_p90_ms", "itl_p99_ms", "tpot_p50_ms", "output_throughput")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run")
    ap.add_argument("--axis", default="max_num_batched_tokens")
    ap.add_argument("--split", type=float, help="contrast values <= split against values > split")
    a = ap.parse_args()
    r = report.Run.load(a.run)
    values = {s.point: s.values[a.axis] for s in r.summaries}
    for m in METRICS:
        d = analysis.MetricData.from_rounds(r.rounds, m)
        if d is None:
            continue
        t = pd.DataFrame([(values[p], d.center(p)) for p in d.starts], columns=["x", "v"])
        groups = t.groupby("x")["v"]
        resid = t["v"] - groups.transform("mean")
        dfw = len(t) - t["x"].nunique()
        s = float(np.sqrt((resid ** 2).sum() / dfw)) if dfw else float("nan")
        means = {k: round(float(d.back(v)), 1) for k, v in groups.mean().items()}
        p = stats.f_oneway(*[g.values for _, g in groups]).pvalue if dfw else float("nan")
        line = f"{m}: means by {a.axis} {means}; within-value spread {s:.3f} ({dfw} df); ANOVA p = {p:.3g}"
        if a.split is not None and dfw:
            lo, hi = t[t["x"] <= a.split]["v"], t[t["x"] > a.split]["v"]
            diff = lo.mean() - hi.mean()
            half = stats.t.ppf(0.975, dfw) * s * np.sqrt(1 / len(lo) + 1 / len(hi))
            f = (lambda x: f"{np.expm1(x):+.1%}") if d.log else (lambda x: f"{x:+.3g}")
            line += f"; <= {a.split:g} vs above: {f(diff)} [{f(diff - half)}, {f(diff + half)}]"
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
