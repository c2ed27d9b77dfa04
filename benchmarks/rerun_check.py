"""Do points started again later fall inside a study's published intervals?

For each point both runs measured and each headline metric: the study's value with its
95% confidence interval (where the point's mean over starts lies) and its 95%
prediction interval for one more server start (where a single new start should land:
the right yardstick for a re-run of one start per point), and the re-run's value,
start by start. The last line counts how many re-run values fall inside each.

    python benchmarks/rerun_check.py results/<study> results/<re-run>
"""
from __future__ import annotations

import argparse

import numpy as np
import pandas as pd

from vllm_study.analysis import intervals as analysis
from vllm_study.vocab import metrics
from vllm_study.report import report

METRICS = ("ttft_p90_ms", "itl_p90_ms", "tpot_p50_ms", "output_throughput", "prefix_cache_hit_rate")


def check(study: report.Run, rerun: report.Run, names=METRICS) -> pd.DataFrame:
    """One row per re-run start x point x metric; the published intervals are the ones
    the study's report shows (`Run.interval`)."""
    rows = []
    for name in names:
        data = analysis.MetricData.from_rounds(rerun.rounds, name)
        if data is None:
            continue
        for point, values in data.starts.items():
            p = study.interval(point, name)
            if p is None:
                continue
            for start, v in enumerate(values, 1):
                v = float(data.back(v))
                rows.append({"point": point, "metric": metrics.get(name).label, "start": start,
                             "published": p["value"], "ci_low": p["ci_low"], "ci_high": p["ci_high"],
                             "next_low": p["next_start_low"], "next_high": p["next_start_high"], "re-run": v,
                             "in CI": bool(p["ci_low"] <= v <= p["ci_high"]),
                             "in prediction": bool(p["next_start_low"] <= v <= p["next_start_high"]),
                             "change": v / p["value"] - 1 if p["value"] else np.nan})
    return pd.DataFrame(rows)


def one_start_line(study: report.Run) -> str | None:
    """Where the study measured each point from one start, its intervals (the prediction
    interval for one more start too) hold no start-to-start spread: a re-run's start may
    fall outside them by that spread alone."""
    return analysis.one_start_note(analysis.starts_per_point(study.rounds),
                                   why="the study measured each point from one server start, so its prediction "
                                       "interval for one more start holds round-to-round spread only")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("study")
    ap.add_argument("rerun")
    a = ap.parse_args()
    study = report.Run.load(a.study)
    df = check(study, report.Run.load(a.rerun))
    if df.empty:
        raise SystemExit(f"{a.rerun} measured no point that {a.study} published")
    with pd.option_context("display.width", 200, "display.max_columns", None):
        print(df.round(4).to_string(index=False))
    if note := one_start_line(study):
        print(note)
    n = len(df)
    print(f"{int(df['in CI'].sum())} of {n} re-run values inside the published 95% confidence interval; "
          f"{int(df['in prediction'].sum())} of {n} inside the 95% prediction interval for one more start; "
          f"change from the published value: median {df['change'].abs().median():.1%}, "
          f"largest {df['change'].abs().max():.1%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
