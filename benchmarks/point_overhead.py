"""Where a server start's wall time goes, from a finished run's own records.

Runs that record each start's timeline (start.json `timeline`: spawn, ready, warmup,
measured, stop, stopped) split a GPU slot's time into vLLM's (start-up: spawn to a
healthy /health; shutdown: SIGTERM to the process group gone), the measurement (warm-up
and rounds) and the kit's, which is everything else on the slot's critical path:
  - before the server: from the slot's previous server gone (or, for a slot's first
    start, from its notebook's beginning: papermill, kernel, imports) to this spawn, or,
    for a server started ahead, to the moment it was let go at its engine's init;
  - ready to warm-up, and rounds over to SIGTERM.
A slot's next start prepares (papermill, kernel, imports, plan) while the previous one
runs and waits for its server to stop, so that work is off the critical path and
counted nowhere. A server started ahead (server.start_ahead) also spawns and imports
then: vllm_startup_s is its start-up less the time it was held, on_path_s the part of
it left on the slot's critical path.

Older runs without a timeline are split by the point notebook's cell timings instead
(vLLM's start-up, the measuring cells, the rest), plus the gap between notebooks.

    python benchmarks/point_overhead.py results/<run> [results/<run> ...]
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
from pathlib import Path

import pandas as pd

from vllm_study.launch import startup_log
from vllm_study.records.results import NOTEBOOK, TIMELINE, RunFolder, on_gpu, read_log

# the point notebook's code cells, by what their source starts with: vLLM serving the
# kit's requests, the kit's imports, and the launch (vLLM's start-up and the kit's set-up)
MEASURING = ("run.warmup()", "run.run_rounds(")
IMPORTS = ("from vllm_study import notebook_support", "from vllm_study import point_notebook")
LAUNCH = ("run = ns.PointRun(", "run = pn.PointRun(", "run = pn.PointStart(")  # older runs' notebooks too


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
                         "kit_s": wall - rec.launch.startup_s - measuring, "kit_imports_s": took(*IMPORTS),
                         "kit_launch_s": took(*LAUNCH) - rec.launch.startup_s})
    return rows


def notebook_begin(path: Path) -> float | None:
    try:
        t = json.loads(path.read_text())["metadata"]["papermill"]["start_time"]
        return _when(t).timestamp() if t else None
    except (OSError, ValueError, KeyError):
        return None


def startup_split(start_dir: Path, spawn_to_ready_s: float) -> dict:
    """Where vLLM's start-up went: before its engine initializes (processes, imports),
    weights, torch.compile, CUDA graphs, the whole engine init, and after it. A hold at
    the engine's init falls after its line, so before_engine_s does not include it."""
    text = read_log(start_dir)
    if not text:
        return {}
    out = startup_log.figures(text)
    del out["gpu_startup_s"]
    span = startup_log.engine_to_serving_s(text)
    if span is not None:
        out["before_engine_s"] = spawn_to_ready_s - span
    return out


def timeline_frame(run: RunFolder) -> pd.DataFrame:
    """One row per start with a whole timeline: the kit's seconds on the slot's critical
    path beside vLLM's start-up and shutdown and the measurement."""
    rows = []
    for folder in map(run.point, run.point_ids()):
        for rec in folder.starts():
            t = rec.timeline
            if not all(k in t for k in TIMELINE):
                continue
            rows.append({**t, "start": f"{folder.path.name}#s{rec.start}",
                         "slot": ",".join(str(g.index) for g in rec.gpus) or "-",  # the GPU set, not t["slot"]
                         "begin": notebook_begin(folder.start_dir(rec.start) / NOTEBOOK),
                         "slot_wait_s": rec.launch.slot_wait_s, "ahead": rec.launch.started_ahead,
                         "on_gpu": on_gpu(t), "held_s": t["slot"] - t["held"] if "held" in t else 0.0,
                         **startup_split(folder.start_dir(rec.start), t["ready"] - t["spawn"])})
    df = pd.DataFrame(rows)
    if df.empty:
        return df
    df = df.sort_values("on_gpu")
    df["sweep"] = df["spawn"].map(run.manifest().sweep_of)  # a resume starts every slot afresh
    previous = df.groupby(["sweep", "slot"])["stopped"].shift()
    follows = previous.notna()  # not a slot's first start in its sweep
    df["follows"] = follows
    df["before_s"] = (df["on_gpu"] - previous).where(follows, df["on_gpu"] - df["begin"])
    df["ready_to_warmup_s"] = df["warmup"] - df["ready"]
    df["measured_to_stop_s"] = df["stop"] - df["measured"]
    df["kit_s"] = df[["before_s", "ready_to_warmup_s", "measured_to_stop_s"]].sum(axis=1, min_count=3)
    df["vllm_startup_s"] = df["ready"] - df["spawn"] - df["held_s"]
    df["on_path_s"] = df["ready"] - df["on_gpu"]
    df["measuring_s"] = df["measured"] - df["warmup"]
    df["vllm_stop_s"] = df["stopped"] - df["stop"]
    return df


def print_timeline(name: str, df: pd.DataFrame) -> None:
    cols = ["start", "slot", "follows", "ahead", "before_s", "ready_to_warmup_s", "measured_to_stop_s", "kit_s",
            "vllm_startup_s", "on_path_s", "measuring_s", "vllm_stop_s", "slot_wait_s"]
    print(f"\n{name}")
    print(df[cols].round(2).to_string(index=False))
    split = [c for c in ("before_engine_s", "weights_s", "compile_s", "graphs_s", "engine_init_s") if c in df]
    if split:
        df[split] = df[split].apply(pd.to_numeric)  # figures a log lacks are NaN, not None
        print("vLLM's start-up by its own log (before_engine_s: its processes starting and importing):")
        print(df[["start", "vllm_startup_s", *split]].round(1).to_string(index=False))
    steady, first = df[df["follows"]], df[~df["follows"]]
    print(f"kit's seconds per start on the slot's critical path: median {steady['kit_s'].median():.2f} s "
          f"over {len(steady)} start(s) that follow another on their slot (max {steady['kit_s'].max():.2f} s); "
          f"{first['kit_s'].median():.2f} s for a slot's first start ({len(first)}: papermill, kernel and imports "
          f"included). vLLM: start-up median {df['vllm_startup_s'].median():.1f} s "
          f"({df['on_path_s'].median():.1f} s of it on the slot's critical path), "
          f"shutdown {df['vllm_stop_s'].median():.1f} s; measuring {df['measuring_s'].median():.1f} s")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", type=Path)
    a = ap.parse_args()
    for path in a.runs:
        run = RunFolder(path)
        timed = timeline_frame(run)
        if not timed.empty:
            print_timeline(path.name, timed)
            continue
        df = pd.DataFrame(start_rows(run))
        if df.empty:
            print(f"{path}: no start with a launch time and an executed notebook")
            continue
        df = df.sort_values("begin")
        manifest = run.manifest()
        df["sweep"] = df["begin"].map(lambda t: manifest.sweep_of(t.timestamp()))
        # the gap before each start on its slot: sweep bookkeeping, papermill and kernel start
        df["gap_before_s"] = (df["begin"] - df.groupby(["sweep", "slot"])["end"].shift()).dt.total_seconds()
        cols = ["start", "slot", "notebook_s", "vllm_startup_s", "measuring_s", "kit_s", "kit_imports_s",
                "kit_launch_s", "gap_before_s"]
        print(f"\n{path.name}")
        print(df[cols].round(1).to_string(index=False))
        kit = df["kit_s"].median()
        gap = df["gap_before_s"].median()
        print(f"median per start: vLLM start-up {df['vllm_startup_s'].median():.1f} s, measuring "
              f"{df['measuring_s'].median():.1f} s, kit inside the notebook {kit:.1f} s (imports "
              f"{df['kit_imports_s'].median():.1f} s, launch beside vLLM's start-up "
              f"{df['kit_launch_s'].median():.1f} s), "
              f"gap between starts "
              f"{gap:.1f} s" + ("" if pd.notna(gap) else " (one start per slot)"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
