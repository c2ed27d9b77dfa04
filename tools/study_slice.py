"""Run a long study in slices on a machine that gives a job a fixed wall-clock limit.

The first slice (no run of the study yet under --runs) optionally runs a knee ladder
study first and starts the main study at the rate it finds; every later slice resumes
the run. Each slice stops between server starts before --minutes is up (the sweep's
--max-minutes) and packs the runs folder into --pack, so what was measured leaves the
machine even if the next slice never comes.

    python tools/study_slice.py params/h200-qwen2.5-32b.yaml --knee params/h200-qwen2.5-32b-knee.yaml \\
        --runs /tmp/runs --minutes 9 --pack $OUT/runs.tar.gz [--executor gpus]

A server start longer than a job's limit (a capacity search on primed windows: ~15 min
on one H200) cannot finish in a slice, and a start cut off mid-search runs again whole.
--wait S runs the slice in the background (its own session, log beside --runs) and
returns after at most S seconds, packing what --runs holds then; the same command again,
while the slice runs, waits on that slice instead of starting one, and packs again. The
machine must stay up between the calls (their jobs back to back).

    python tools/study_slice.py STUDY --runs /tmp/runs --minutes 16 --wait 540 --pack $OUT/runs.tar.gz
"""
from __future__ import annotations

import argparse
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import detach  # tools/: this script's folder

from vllm_study.define.study_file import load_study
from vllm_study.records.results import RunFolder

ROOT = Path(__file__).resolve().parents[1]


def find_run(runs: Path, study_name: str, say: bool = False) -> Path | None:
    """The latest run of `study_name` under `runs`; say=True prints, where none was
    taken, why each run there was not (a run brought along that is not picked up would
    silently start the study anew)."""
    found, others = [], []
    for m in sorted(runs.glob("*/manifest.json")):
        try:
            study = RunFolder(m.parent).manifest().study
        except ValueError as e:  # a run of another layout: not ours
            others.append(f"{m.parent}: not a run this kit reads ({e})")
            continue
        if study == study_name:
            found.append(m.parent)
        else:
            others.append(f"{m.parent}: a run of {study}, not of {study_name}")
    if say and not found:
        print("\n".join(others + [f"no run of {study_name} under {runs} (its folders: "
                                  f"{', '.join(sorted(p.name for p in runs.iterdir())) or 'none'})"]), flush=True)
    return found[-1] if found else None


CURRENT: list[subprocess.Popen] = []
MIN_START_MINUTES = 3.0   # below this, leave the next server start to the next slice


def sweep(*args) -> int:
    cmd = [sys.executable, "-m", "vllm_study", "sweep", *map(str, args), "--no-report"]
    print("+", " ".join(cmd), flush=True)
    proc = subprocess.Popen(cmd, cwd=ROOT)
    CURRENT.append(proc)
    try:
        return proc.wait()
    finally:
        CURRENT.remove(proc)


def _forward_sigterm(signum, frame):
    """A slice killed from outside (a job limit): the sweep stops its server and keeps
    what it measured, then the runs are still packed."""
    for proc in CURRENT:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
    raise KeyboardInterrupt


def detached(a: argparse.Namespace, argv: list[str]) -> int:
    """--wait: start the slice in the background unless one of these --runs is running,
    wait for it at most a.wait seconds (tools/detach.py), pack --runs. 0: the slice ended
    (its own exit status is in its log); 3: it still runs (call again to wait for it)."""
    # the background slice packs nothing itself: the waiter packs what the runs hold
    child = [sys.executable, str(Path(__file__).resolve()), *_without(argv, "--wait", "--pack")]
    still = detach.wait_on(child, Path(f"{a.runs}.slice.pid"), Path(f"{a.runs}.slice.log"), a.wait,
                           marker="study_slice", cwd=ROOT, what="the slice")
    if a.pack:
        pack(a.runs, a.pack)
    if still:
        print("\nthe slice still runs: the same command again waits for it", flush=True)
        return detach.STILL_RUNS
    return 0


def _without(argv: list[str], *flags: str) -> list[str]:
    """argv less each flag and its value (as `--flag V` or `--flag=V`)."""
    out, skip = [], False
    for x in argv:
        if skip:
            skip = False
        elif x in flags:
            skip = True
        elif not any(x.startswith(f + "=") for f in flags):
            out.append(x)
    return out


def pack(runs: Path, to: Path) -> None:
    detach.pack([runs], to, ["runs"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("study", type=Path)
    ap.add_argument("--knee", type=Path, help="a ladder study to run first; its knee rate overrides the study's")
    ap.add_argument("--runs", type=Path, default=Path("/tmp/runs"))
    ap.add_argument("--minutes", type=float, required=True, help="this slice's wall-clock budget")
    ap.add_argument("--pack", type=Path, help="tar.gz the runs folder here when the slice ends")
    ap.add_argument("--carried", type=Path, default=ROOT / "results",
                    help="where an earlier slice's run may have been brought along (copied into --runs)")
    ap.add_argument("--wait", type=float, metavar="S",
                    help="run the slice in the background and return within S seconds (module docstring)")
    # anything else (--executor gpus, --parallel 2) goes to the main study's sweep
    a, sweep_args = ap.parse_known_args()
    if a.wait is not None:
        a.runs.mkdir(parents=True, exist_ok=True)
        return detached(a, sys.argv[1:])
    t0 = time.monotonic()
    a.runs.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, _forward_sigterm)
    rc = 0
    left = lambda: a.minutes - (time.monotonic() - t0) / 60  # noqa: E731
    name = load_study(a.study).name
    try:
        run = find_run(a.runs, name)
        carried = find_run(a.carried, name, say=run is None) if a.carried.exists() else None
        if run is None and carried is not None:  # a fresh machine: continue the run brought along
            run = Path(shutil.copytree(carried, a.runs / carried.name))
            print(f"continuing {carried} in {run}", flush=True)
        knee_file = a.runs / "knee.yaml"
        if run is None and a.knee and not knee_file.exists():
            rc = sweep(a.knee, "--results", a.runs, "--max-minutes", f"{left():.2f}")
            knee_run = find_run(a.runs, load_study(a.knee).name)
            if rc == 0 and knee_run:
                subprocess.run([sys.executable, str(ROOT / "benchmarks" / "knee.py"), str(knee_run),
                                "--out", str(knee_file)], cwd=ROOT)
        if left() < MIN_START_MINUTES:
            print(f"{left():.1f} min left: the next server start waits for the next slice", flush=True)
        elif run:
            rc = sweep("--resume", run, "--max-minutes", f"{left():.2f}", *sweep_args)
        else:
            override = [knee_file] if knee_file.exists() else []
            rc = sweep(a.study, *override, "--results", a.runs, "--max-minutes", f"{left():.2f}", *sweep_args)
    except KeyboardInterrupt:
        rc = 130
    finally:
        if a.pack:
            pack(a.runs, a.pack)
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
