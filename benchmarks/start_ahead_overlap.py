"""Does a server started ahead disturb the rounds it imports beside?

A server started ahead (server.start_ahead) spawns when the slot's current start takes
the slot and imports for 40-65 s, until it is held at its engine's init: on one GPU that
overlaps the current start's first round, never its later ones. This script finds, for
every round, the seconds of it during which another start's server was importing (its
spawn to its hold, from start.json timelines; a round's span is its end stamp less its
duration, so to the second), and for every start the log ratio of its first round to
its later ones. Rounds differ by their order and their prompts (every start replays the
same seeded rounds), so the ratio is compared between starts whose first round had
imports beside it and starts where no round had: the difference, with a Welch 95%
interval, is what the imports add. Runs without start-ahead add starts of the second kind.

    python benchmarks/start_ahead_overlap.py results/<run with start-ahead> [results/<run> ...]
"""
from __future__ import annotations

import argparse
import datetime as dt

import numpy as np
import pandas as pd
from scipy import stats as sps

from vllm_study.records.results import RunFolder

METRICS = ("ttft_p50_ms", "ttft_p90_ms", "itl_p50_ms", "tpot_p50_ms", "output_throughput")
BESIDE_S = 5.0  # a first round with at least this long beside imports counts as disturbed


def import_windows(run: RunFolder) -> list[tuple[str, float, float]]:
    """(start, from, to): when each start's server imported before its hold."""
    return [(f"{pid}#s{s.start}", s.timeline["spawn"], s.timeline["held"])
            for pid in run.point_ids() for s in run.point(pid).starts() if "held" in s.timeline]


def round_rows(run: RunFolder) -> pd.DataFrame:
    windows = import_windows(run)
    rows = []
    for pid in run.point_ids():
        for r in run.point(pid).rounds():
            if r.status != "ok":
                continue
            end = dt.datetime.fromisoformat(r.utc).timestamp()
            begin = end - r.metrics["duration_s"]
            me = f"{pid}#s{r.start}"
            overlap = sum(max(0.0, min(end, b) - max(begin, a)) for who, a, b in windows if who != me)
            rows.append({"run": run.path.name, "point": pid, "start": r.start, "round": r.round,
                         "overlap_s": overlap, **{m: r.metrics.get(m) for m in METRICS}})
    return pd.DataFrame(rows)


def start_ratios(rounds: pd.DataFrame) -> pd.DataFrame:
    """One row per start: log(first round / median of its later rounds) per metric, and
    whether imports ran beside its first round only ('beside') or beside none ('clean')."""
    rows = []
    for (run, point, start), g in rounds.groupby(["run", "point", "start"]):
        first, later = g[g["round"] == 0], g[g["round"] > 0]
        if first.empty or later.empty:
            continue
        if later["overlap_s"].max() > 1:
            kind = "other"
        else:
            kind = "beside" if first["overlap_s"].iloc[0] >= BESIDE_S else "clean" if first["overlap_s"].iloc[0] < 1 \
                else "other"
        rows.append({"run": run, "start": f"{point}#s{start}", "kind": kind,
                     "first_overlap_s": first["overlap_s"].iloc[0],
                     **{m: np.log(first[m].iloc[0] / later[m].median()) for m in METRICS}})
    return pd.DataFrame(rows)


def _pct(x: float) -> str:
    return f"{np.expm1(x):+.1%}" if np.isfinite(x) else "n/a"


def compare(ratios: pd.DataFrame) -> pd.DataFrame:
    """Per metric: the first/later ratio of each kind of start, and beside less clean."""
    a, b = ratios[ratios["kind"] == "beside"], ratios[ratios["kind"] == "clean"]
    out = []
    for m in METRICS:
        x, y = a[m].to_numpy(), b[m].to_numpy()
        vx, vy = x.var(ddof=1) / len(x), y.var(ddof=1) / len(y)
        dof = (vx + vy) ** 2 / (vx ** 2 / (len(x) - 1) + vy ** 2 / (len(y) - 1))  # Welch-Satterthwaite
        d, half = x.mean() - y.mean(), sps.t.ppf(0.975, dof) * np.sqrt(vx + vy)
        out.append({"metric": m, "first/later, imports beside": _pct(x.mean()), "first/later, clean": _pct(y.mean()),
                    "imports' effect": _pct(d), "95% CI": f"[{_pct(d - half)}, {_pct(d + half)}]",
                    "resolved": "yes" if (d - half) * (d + half) > 0 else "no"})
    return pd.DataFrame(out).set_index("metric")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+")
    a = ap.parse_args()
    ratios = start_ratios(pd.concat([round_rows(RunFolder(r)) for r in a.runs], ignore_index=True))
    print(ratios[["run", "start", "kind", "first_overlap_s"]].round(1).to_string(index=False))
    counts = ratios["kind"].value_counts()
    print(f"\nstarts: {counts.get('beside', 0)} with imports beside their first round (>= {BESIDE_S:g} s), "
          f"{counts.get('clean', 0)} with none beside any round, {counts.get('other', 0)} in between (left out)")
    if min(counts.get("beside", 0), counts.get("clean", 0)) < 2:
        raise SystemExit("too few starts of each kind to compare")
    print("\nfirst round against the later rounds of a start (mean over starts), and what imports beside it add "
          "(Welch 95% interval):")
    print(compare(ratios).to_string())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
