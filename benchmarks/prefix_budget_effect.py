"""What the Prefix Reuse Budget did in a run that sweeps `scheduler.min_reuse_ratio`:
at each chunk size, each budget point against the point without it (min_reuse_ratio
off), per request class (all, shared-prefix, cold), with 95% intervals from the study's
start-to-start spread: the report's own comparison (report_effects.axis_effect_frame, shown in
the report's cell beside "Did each knob bind?"), printed in full. Beside it, what the
budget's own counters say it did (requests deferred per round, how many went in by the
age bound) and the hit rate a never-evicting cache would have reached.

    python benchmarks/prefix_budget_effect.py results/<run>
"""
from __future__ import annotations

import argparse

import pandas as pd

from vllm_study.analysis import intervals as analysis
from vllm_study.report import report
from vllm_study.report import binding, effects as report_effects

COUNTERS = ("pb_deferred", "pb_admitted_by_age", "pb_admitted_idle", "pb_defer_ms_p50", "pb_defer_ms_p99")
# the report's column names, as this script has always shown them
SHOWN = {"max_num_batched_tokens": "chunk", "min_reuse_ratio": "budget", "value": "with budget",
         "reference value": "off"}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run")
    a = ap.parse_args()
    r = report.Run.load(a.run)
    axis = binding.scheduler_axis(r)
    if axis is None:
        raise SystemExit(f"{a.run} does not sweep scheduler.min_reuse_ratio: nothing to compare")
    # the report's own comparison (report_effects.axis_effect_frame): one implementation for both
    effects = report_effects.axis_effect_frame(r, axis)
    first = [c for c in effects.columns if c not in report_effects.EFFECT_COLUMNS]
    shown = effects[first + ["group", "metric", "value", "reference value", "change", "verdict"]].rename(
        columns=SHOWN)
    classes = sorted(r.rounds.loc[r.rounds["group"] == "class", "group_value"].dropna().unique())
    with pd.option_context("display.width", 250, "display.max_rows", 500, "display.max_colwidth", 60):
        print(shown.to_string(index=False))
        for note in report_effects.axis_effect_notes(r, axis)[1:]:
            print(note)
        deferrals = binding.deferral_table(r)
        if deferrals is not None:
            print("\nrequests the budget deferred per round: median over measured rounds (min to max)")
            print(deferrals.to_string())
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
