"""Where a server start's wall time goes, from a finished run's own records: vLLM's
start-up (process launch to a healthy /health, `launch.startup_s`), the measurement
(warm-up and rounds, from the executed point notebook's cell timings), and the rest,
which is the kit's: imports, tokenizer and workload set-up, model folder, counters,
stopping the server, writing results. Also the gap between one start's notebook ending
and the next one beginning on the same GPU slot (the sweep, papermill and the kernel).

    python benchmarks/point_overhead.py results/<run> [results/<run> ...]
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
from pathlib import Path

import pandas as pd

from vllm_study.results import NOTEBOOK, RunFolder

# the point notebook's code cells, by what their source starts with: vLLM serving the
# kit's requests, the kit's imports, and the launch (vLLM's start-up and the kit's set-up)
MEASURING = ("run.warmup()", "run.run_rounds(")
IMPORTS, LAUNCH = "from vllm_study import notebook_support", "run = ns.PointRun("
BETWEEN_SLICES_S = 300  # a longer gap is a stop and a resume, not the sweep's own


def _when(s: str) -> dt.datetime:
    return dt.datetime.fromisoformat(s.replace("Z", "+00:00"))


def start_rows(run: RunFolder) -> list[dict]:
    rows = []
    for folder in map(run.point, run.point_ids()):
        for rec in folder.starts():
            nb_path = folder.start_dir(rec.start) / NOTEBOOK
            if rec.launch is None or rec.launch.startup_s is None or not nb_path.exists():
                continue
            nb = json.loads(nb_path.read_text())
            meta = nb["metadata"].get("papermill", {})
            if not meta.get("start_time") or not meta.get("end_time"):
                continue
            def took(*starts: str) -> float:
                return sum(c["metadata"]["papermill"].get("duration") or 0 for c in nb["cells"]
                           if c["cell_type"] == "code" and "".join(c["source"]).startswith(starts))
            measuring = took(*MEASURING)
            t0, t1 = _when(meta["start_time"]), _when(meta["end_time"])
            wall = (t1 - t0).total_seconds()
            rows.append({"run": run.path.name, "start": f"{folder.path.name}#s{rec.start}",
                         "slot": ",".join(str(g.index) for g in rec.gpus) or "-", "begin": t0, "end": t1,
                         "notebook_s": wall, "vllm_startup_s": rec.launch.startup_s, "measuring_s": measuring,
                         "kit_s": wall - rec.launch.startup_s - measuring, "kit_imports_s": took(IMPORTS),
                         "kit_launch_s": took(LAUNCH) - rec.launch.startup_s})
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", type=Path)
    a = ap.parse_args()
    for path in a.runs:
        df = pd.DataFrame(start_rows(RunFolder(path)))
        if df.empty:
            print(f"{path}: no start with a launch time and an executed notebook")
            continue
        df = df.sort_values("begin")
        # the gap before each start on its slot: sweep bookkeeping, papermill and kernel start
        gap = (df["begin"] - df.groupby("slot")["end"].shift()).dt.total_seconds()
        df["gap_before_s"] = gap.where(gap < BETWEEN_SLICES_S)
        cols = ["start", "slot", "notebook_s", "vllm_startup_s", "measuring_s", "kit_s", "kit_imports_s",
                "kit_launch_s", "gap_before_s"]
        print(f"\n{path.name}")
        print(df[cols].round(1).to_string(index=False))
        kit = df["kit_s"].median()
        gap = df["gap_before_s"].median()
        print(f"median per start: vLLM start-up {df['vllm_startup_s'].median():.1f} s, measuring "
              f"{df['measuring_s'].median():.1f} s, kit inside the notebook {kit:.1f} s (imports "
              f"{df['kit_imports_s'].median():.1f} s, launch beside vLLM's start-up {df['kit_launch_s'].median():.1f} s), "
              f"gap between starts "
              f"{gap:.1f} s" + ("" if pd.notna(gap) else " (one start per slot)"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
