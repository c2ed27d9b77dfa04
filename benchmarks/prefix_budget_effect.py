"""What the Prefix Reuse Budget did in a run that sweeps `scheduler.min_reuse_ratio`:
at each chunk size, each budget point against the point without it (min_reuse_ratio
off), per request class (all, shared-prefix, cold), with 95% intervals from the study's
start-to-start spread. Beside it, what the budget's own counters say it did (requests
deferred per round, how many went in by the age bound) and the hit rate a
never-evicting cache would have reached.

    python benchmarks/prefix_budget_effect.py results/<run>
"""
from __future__ import annotations

import argparse

import pandas as pd

from vllm_study import analysis, report

METRICS = ("ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms")
WHOLE_ROUND = ("output_throughput", "prefix_cache_hit_rate")
COUNTERS = ("pb_deferred", "pb_admitted_by_age", "pb_admitted_idle", "pb_defer_ms_p50", "pb_defer_ms_p99")


def _cell(iv: pd.DataFrame, point: str, metric: str) -> str:
    row = iv[(iv.point == point) & (iv.metric == metric)]
    if row.empty:
        return "n/a"
    r = row.iloc[0]
    return f"{r.value:.4g} [{r.ci_low:.4g}, {r.ci_high:.4g}]"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run")
    a = ap.parse_args()
    r = report.Run.load(a.run)
    values = {s.point: s.values for s in r.summaries}
    if not any("min_reuse_ratio" in v for v in values.values()):
        raise SystemExit(f"{a.run} does not sweep scheduler.min_reuse_ratio: nothing to compare")
    classes = sorted(r.rounds.loc[r.rounds["group"] == "class", "group_value"].dropna().unique())
    groups = [("all", None)] + [(c, ("class", c)) for c in classes]
    rows = []
    for chunk in sorted({v.get("max_num_batched_tokens") for v in values.values()}, key=str):
        at = {p: v for p, v in values.items() if v.get("max_num_batched_tokens") == chunk}
        off = next((p for p, v in at.items() if str(v["min_reuse_ratio"]) == "off"), None)
        if off is None:
            continue
        for label, group in groups:
            names = METRICS + (WHOLE_ROUND if group is None else ())
            iv = analysis.point_intervals(r.rounds, names, group)
            for point in at:
                if point == off:
                    continue
                for m in names:
                    data = analysis.MetricData.from_rounds(r.rounds, m, group)
                    if data is None or point not in data.starts or off not in data.starts:
                        continue
                    d = analysis.difference(data, point, off)
                    rows.append({"chunk": chunk, "budget": at[point]["min_reuse_ratio"], "class": label, "metric": m,
                                 "with budget": _cell(iv, point, m), "off": _cell(iv, off, m),
                                 "change": f"{d.estimate:+.1%} [{d.low:+.1%}, {d.high:+.1%}]" if d.relative
                                 else f"{d.estimate:+.3g} [{d.low:+.3g}, {d.high:+.3g}]",
                                 "verdict": d.verdict()})
    with pd.option_context("display.width", 250, "display.max_rows", 500, "display.max_colwidth", 40):
        print(pd.DataFrame(rows).to_string(index=False))
        whole = analysis.ok_rounds(r.rounds)
        cols = [c for c in ("expected_prefix_hit_rate", "prefix_cache_hit_rate", "preemptions", "waiting_peak")
                + COUNTERS if c in whole.columns]
        print("\nper round, median over a point's rounds (expected_prefix_hit_rate: a cache that never evicts)")
        print(whole.groupby("point", sort=False)[cols].median().to_string())
        print("\neach round: whether the shared prefix stayed cached (hit rate against a never-evicting "
              "cache) beside its TTFT P90, per class, and what the budget deferred")
        print(_each_round(r.rounds, classes).to_string())
    return 0


def _each_round(rounds: pd.DataFrame, classes: list[str]) -> pd.DataFrame:
    """One row per measured round: on this workload a round either keeps the shared prefix
    or loses it, and the medians over rounds hide which one happened."""
    ok = rounds[rounds["round_status"] == "ok"]
    key = ["point", "start", "round"]
    whole = ok[ok["group"] == "all"].set_index(key)
    out = pd.DataFrame({"hit rate": whole["prefix_cache_hit_rate"],
                        "of never-evicting": whole["prefix_cache_hit_rate"] / whole["expected_prefix_hit_rate"],
                        "TTFT P90 ms": whole["ttft_p90_ms"]})
    for c in classes:
        part = ok[(ok["group"] == "class") & (ok["group_value"] == c)].set_index(key)
        out[f"{c} TTFT P90 ms"] = part["ttft_p90_ms"]
    for col, label in (("pb_deferred", "deferred"), ("pb_admitted_by_age", "by age")):
        if col in whole.columns:
            out[label] = whole[col]
    return out.sort_index().round(3)


if __name__ == "__main__":
    raise SystemExit(main())
