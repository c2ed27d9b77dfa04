"""One unit (one server start of one point): the point notebook executed by papermill
in a process of its own, followed through the files it writes. Every executor runs its
units through run_unit, here or on a Ray worker."""
from __future__ import annotations

import importlib.resources
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import yaml
from tqdm import tqdm

from ..define.grid import Unit
from .point import summarize
from ..records.results import LOG, NOTEBOOK, ROUNDS, START, RunFolder, StartRecord, read_rounds
from ..launch.server import pgid_path, stop_group_from_file

REPO = Path(__file__).resolve().parents[3]  # a source checkout: its notebooks/ folder, below


def notebook(name: str) -> Path:
    """A notebook shipped as vllm_study.notebooks. An editable install maps only `lib/`,
    so there the source tree's notebooks/ folder is used."""
    try:
        return Path(str(importlib.resources.files("vllm_study.notebooks") / name))
    except ModuleNotFoundError:
        return REPO / "notebooks" / name


POINT_PARAMS = {"point_file", "start", "block", "out_dir", "gpus", "slot_lock", "serves"}  # what point_params gives


def _watch_start(start_dir: Path, bar: tqdm | None, on_started, stop: threading.Event, label: str = "",
                 served: tuple[Path, ...] = ()) -> None:
    """Follow the point notebook (another process) through its files: advance the bar as
    rounds land, and name this start on it once it measures (with start-ahead, the slot's
    next start prepares meanwhile: the bar names the one measuring); call on_started once
    its server is spawned and has the slot (a server started ahead: once it is let go at
    its engine's init; an endpoint target: once its rounds are over), or once it has ended.
    `served`: the other points' folders of a start that serves several (live knobs)."""
    seen, named = 0, False
    while not stop.wait(0.5):
        if bar is not None:
            n = sum(len(read_rounds(d / ROUNDS)) for d in (start_dir, *served))
            if n > seen:
                bar.update(n - seen)
                seen = n
        if on_started is None and (named or bar is None):
            continue
        try:
            rec = StartRecord.load_if(start_dir / START)
        except ValueError:  # caught mid-write; read it again next time
            rec = None
        if rec is None:
            continue
        if bar is not None and not named and "warmup" in rec.timeline:
            bar.set_description(label, refresh=True)
            named = True
        if on_started is not None:
            t = rec.timeline
            if {"spawn", "slot"} <= t.keys() or "measured" in t or rec.status != "running":
                on_started()
                on_started = None


# Set while an interrupted sweep stops its children: a notebook process that dies of
# that stop is not a failed start (the start stays "running", for --resume to redo).
STOPPING = threading.Event()


def stop_leftover_server(start_dir: Path) -> None:
    """Safety net: if the notebook's kernel died (or was interrupted) without stopping its
    server, stop the process group the server recorded (never anything found by name)."""
    if stop_group_from_file(pgid_path(start_dir / LOG)):
        tqdm.write(f"  stopped a server left running by {start_dir.parent.name}/{start_dir.name}")


def point_params(plan: Path, sdir: Path, unit: Unit, gpus: list[int] | None, slot_lock: Path | None,
                 nbdir: Path) -> dict:
    """The point notebook's parameters (POINT_PARAMS). Paths are relative to the notebook's
    folder (the kernel's cwd): the executed notebook then names no machine's folders."""
    return {"point_file": os.path.relpath(plan, nbdir), "start": unit.start, "block": unit.block,
            "out_dir": os.path.relpath(sdir, nbdir), "gpus": ",".join(map(str, gpus)) if gpus else "",
            "slot_lock": os.path.relpath(slot_lock, nbdir) if slot_lock else "", "serves": ",".join(unit.serves)}


def run_unit(run: RunFolder, unit: Unit, gpus: list[int] | None = None, bar: tqdm | None = None,
             slot_lock: Path | None = None, on_started=None):
    """Execute the point notebook for one unit and return the point's summary. A notebook
    that dies before recording an outcome has its error recorded as the outcome.
    `slot_lock`: the lock its server waits for (slots.SlotLock); `on_started`: called
    once its server is spawned and has the slot: the slot's next start then prepares
    (papermill, kernel, imports, plan) and waits at the lock, or, started ahead
    (server.start_ahead), also spawns its server, which imports and is held at its
    engine's init until this one has stopped.

    papermill runs in a process of its own: it changes the working directory of the
    process it runs in while a notebook executes, which would break relative paths here
    and races between units that run side by side (executor gpus)."""
    folder = run.point(unit.point)
    sdir = folder.start_dir(unit.start)
    sdir.mkdir(parents=True, exist_ok=True)
    nbdir = notebook("point.ipynb").parent
    params = point_params(folder.plan_path, sdir, unit, gpus, slot_lock, nbdir)
    out = (sdir / NOTEBOOK).resolve()
    stop = threading.Event()
    label = unit.label + (f" on GPUs {gpus}" if gpus else "")
    served = tuple(run.point(p).start_dir(unit.start).resolve() for p in unit.serves[1:])
    watcher = threading.Thread(target=_watch_start, args=(sdir.resolve(), bar, on_started, stop, label, served),
                               daemon=True) if bar is not None or on_started is not None else None
    if watcher:
        watcher.start()
    try:
        done = subprocess.run([sys.executable, "-m", "papermill", str(notebook("point.ipynb")), str(out),
                               "--cwd", str(nbdir), "--no-progress-bar", "--kernel", "python3",
                               "--parameters_yaml", yaml.safe_dump(params)], capture_output=True, text=True,
                              # a terminal's Ctrl-C reaches the sweep alone, which stops the unit
                              start_new_session=True)
        for d in (sdir, *served):
            rec = StartRecord.load_if(d / START)
            if done.returncode != 0 and rec is not None and rec.status == "running" and not STOPPING.is_set():
                # the notebook died before recording an outcome: its error is the outcome
                rec.status, rec.reason = "failed", f"notebook error: {_notebook_error(out, done.stderr)}"[:500]
                rec.save(d / START)
                if d != sdir:
                    summarize(run.point(d.parent.name), run.point(d.parent.name).plan())
    finally:
        stop.set()
        if watcher:
            watcher.join()
        stop_leftover_server(sdir)
    return summarize(folder, folder.plan())


def _notebook_error(nb: Path, stderr: str) -> str:
    """The error a papermill run stopped on: from the executed notebook where it was saved,
    else the last line papermill printed."""
    try:
        for cell in json.loads(nb.read_text())["cells"]:
            for o in cell.get("outputs", []):
                if o.get("output_type") == "error":
                    return f"{o['ename']}: {o['evalue']}"
    except (OSError, ValueError, KeyError):
        pass
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    return lines[-1] if lines else "papermill failed without a message"
