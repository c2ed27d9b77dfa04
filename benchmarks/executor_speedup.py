"""The same study under two executors (e.g. `local` and `gpus` on a two-GPU host): how
much less wall time the second took, and whether its numbers agree with the first's.

Wall time is the time the run was busy: per slice (the first sweep and each `--resume`,
from the manifest), its first start's notebook begin to its last start's finish, so a
run made in several slices (tools/study_slice.py) is not charged for the time between
them. Agreement is `compare`'s per-point difference with its 95% interval: under `gpus`
every start had a neighbour on the host, so a resolved difference is a neighbour's
effect, or a difference between the two runs themselves (time, order), which one pair
of runs cannot tell apart.

    python benchmarks/executor_speedup.py results/<local run> results/<gpus run> [--target 0.55]
"""
from __future__ import annotations

import argparse
import datetime as dt
from pathlib import Path

import pandas as pd

from point_overhead import notebook_begin  # benchmarks/ is the script's folder
from vllm_study.report import compare
from vllm_study.records.results import NOTEBOOK, RunFolder


def busy_seconds(run: RunFolder) -> tuple[float, int]:
    """(seconds busy, slices): each sweep's first notebook begin to its last finish."""
    m = run.manifest()
    slices: dict[int, list[float]] = {}
    for folder in map(run.point, run.point_ids()):
        for rec in folder.starts():
            begin = notebook_begin(folder.start_dir(rec.start) / NOTEBOOK)
            if begin is None or not rec.finished_utc:
                continue
            end = dt.datetime.fromisoformat(rec.finished_utc).timestamp()
            span = slices.setdefault(m.sweep_of(begin), [begin, end])
            span[0], span[1] = min(span[0], begin), max(span[1], end)
    return sum(b - a for a, b in slices.values()), len(slices)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("first", type=Path, help="the run under the reference executor (local)")
    ap.add_argument("second", type=Path, help="the same study under the other executor (gpus)")
    ap.add_argument("--target", type=float, default=0.55, help="wall-time ratio to meet")
    a = ap.parse_args()
    runs = [RunFolder(a.first), RunFolder(a.second)]
    walls = []
    for run in runs:
        seconds, slices = busy_seconds(run)
        m = run.manifest()
        walls.append(seconds)
        print(f"{run.path.name}: executor {m.executor}, {sum(len(run.point(p).starts()) for p in run.point_ids())} "
              f"starts, busy {seconds / 60:.1f} min in {slices} slice(s), {len(m.overlaps)} overlapping pair(s)")
    ratio = walls[1] / walls[0]
    print(f"wall-time ratio {ratio:.2f} (target <= {a.target}: {'met' if ratio <= a.target else 'not met'})")
    print("\n".join(agreement(a.first, a.second)))
    return 0


def agreement(first: Path, second: Path) -> list[str]:
    """compare's header (what differs; first, where either run had one start a point, that
    start-to-start spread is not in the intervals), its table and its verdict."""
    try:
        head, table, line = compare.compare_runs(first, second)
    except ValueError:
        return ["no point measured in both runs"]
    with pd.option_context("display.width", 200, "display.max_rows", 200):
        return [head, table.to_string(), line]


if __name__ == "__main__":
    raise SystemExit(main())
