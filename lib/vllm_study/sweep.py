"""Run a study: one papermill execution of notebooks/point.ipynb per grid point, then
the report notebook. A point that fails is recorded and the sweep goes on; a time
budget stops cleanly between points; `resume` skips points already finished.
"""
from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import papermill as pm
from tqdm import tqdm

from . import runfolder
from .counters import NvmlProbe
from .params import Point, Study, expand, load_study
from .point import LOG, ROUNDS, SUMMARY
from .server import pgid_path, stop_group_from_file

REPO = Path(__file__).resolve().parents[2]
NOTEBOOKS = REPO / "notebooks"
POINT_NB, REPORT_NB = NOTEBOOKS / "point.ipynb", NOTEBOOKS / "report.ipynb"


def resolve_engine(engine: str) -> str:
    if engine != "auto":
        return engine
    return "gpu" if NvmlProbe().available else "cpu"


def check_parameters(notebook: Path, names) -> None:
    """papermill only warns about parameters a notebook does not declare; a typo would
    then silently run the default. Refuse instead."""
    declared = pm.inspect_notebook(str(notebook))
    unknown = sorted(set(names) - set(declared))
    if unknown:
        raise ValueError(f"{notebook.name} has no parameter(s) {unknown}; it declares "
                         f"{sorted(declared)}")


def _watch_rounds(point_dir: Path, bar: tqdm, stop: threading.Event) -> None:
    """Advance the bar as the point notebook (another process) appends rounds."""
    seen = 0
    f = point_dir / ROUNDS
    while not stop.wait(1.0):
        n = f.read_text().count("\n") if f.exists() else 0
        if n > seen:
            bar.update(n - seen)
            seen = n


def _stop_leftover_server(point_dir: Path) -> None:
    """Safety net: if the point's kernel died (or was interrupted) without stopping its
    server, stop the process group the server recorded (never anything found by name)."""
    if stop_group_from_file(pgid_path(point_dir / LOG)):
        tqdm.write(f"  stopped a server left running by {point_dir.name}")


def _stop_children() -> None:
    """Stop what this process started and is still running (papermill's kernel)."""
    import psutil
    kids = psutil.Process().children(recursive=True)
    for k in kids:
        k.terminate()
    _, alive = psutil.wait_procs(kids, timeout=10)
    for k in alive:
        k.kill()


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def run_point_notebook(run: Path, point: Point, engine: str, bar: tqdm | None = None) -> dict:
    pdir = run / runfolder.POINTS / point.id
    pdir.mkdir(parents=True, exist_ok=True)
    # Paths relative to notebooks/ (the kernel's cwd): the executed notebook then names
    # no machine's folders.
    params = {"study_file": os.path.relpath(run / "study.yaml", NOTEBOOKS), "point_id": point.id,
              "point_dir": os.path.relpath(pdir, NOTEBOOKS), "engine": engine}
    stop = threading.Event()
    watcher = threading.Thread(target=_watch_rounds, args=(pdir, bar, stop), daemon=True) if bar else None
    if watcher:
        watcher.start()
    try:
        pm.execute_notebook(str(POINT_NB), str(pdir / "point.ipynb"), parameters=params,
                            cwd=str(NOTEBOOKS), progress_bar=False, kernel_name="python3")
    except pm.PapermillExecutionError as e:
        # The notebook is saved with the traceback; unless the point already recorded its
        # outcome (ok, or failed with a reason), the error is its result.
        s = runfolder.read_point(pdir) or {"point": point.id, "values": point.values}
        if s.get("status") not in ("ok", "failed"):
            s.update(status="failed", reason=f"notebook error: {e.ename}: {e.evalue}"[:500])
            (pdir / SUMMARY).write_text(json.dumps(s, indent=2, default=str))
    finally:
        stop.set()
        if watcher:
            watcher.join()
        _stop_leftover_server(pdir)
    return runfolder.read_point(pdir) or {}


def render_report(run: Path) -> Path:
    runfolder.write_summary_csv(run)
    out = run / "report.ipynb"
    pm.execute_notebook(str(REPORT_NB), str(out), parameters={"run_dir": "."}, cwd=str(run),
                        progress_bar=False, kernel_name="python3")
    return out


def sweep(params_files: list[str], results: Path, engine: str = "auto", resume: Path | None = None,
          max_minutes: float | None = None, retry_failed: bool = False) -> Path:
    t0 = time.monotonic()
    if resume:
        run = Path(resume)
        study: Study = load_study(run / "study.yaml")
    else:
        study = load_study(*params_files)
    engine = resolve_engine(engine if not resume else _manifest_engine(run, engine))
    points = expand(study, engine)  # raises StudyError before anything starts
    check_parameters(POINT_NB, {"study_file", "point_id", "point_dir", "engine"})
    check_parameters(REPORT_NB, {"run_dir"})
    if not resume:
        run = runfolder.new_run_dir(results, study, REPO)
        runfolder.write_manifest(run, study, engine, points, REPO)
    todo = []
    for p in points:
        s = runfolder.read_point(run / runfolder.POINTS / p.id)
        finished = s and s.get("status") in ("ok", "failed")
        if not finished or (retry_failed and s["status"] == "failed"):
            todo.append(p)
    if resume and todo:
        runfolder.record_resume(run, REPO, [p.id for p in todo])
    print(f"run: {run}\n{len(points)} points, {len(points) - len(todo)} already finished, "
          f"{study.rounds} rounds each, engine {engine}")
    for p in points:
        for w in p.warnings:
            print(f"  warning {p.id}: {w}")
    # SIGTERM (a scheduler, `kill`) ends the sweep the way Ctrl-C does: the current
    # point's server is stopped, finished points stay, --resume completes the rest.
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        stopped_for_time, i = _run_points(run, todo, study, engine, t0, max_minutes)
    except KeyboardInterrupt:
        _stop_children()
        for p in todo:
            _stop_leftover_server(run / runfolder.POINTS / p.id)
        runfolder.write_summary_csv(run)
        print(f"\ninterrupted: finished points are kept in {run}; complete the run with: "
              f"python -m vllm_study sweep --resume {run}", flush=True)
        raise
    finally:
        signal.signal(signal.SIGTERM, previous)
    if stopped_for_time:
        left = len(todo) - i
        print(f"stopped after {max_minutes} minutes with {left} point(s) left; "
              f"continue with: python -m vllm_study sweep --resume {run}")
    render_report(run)
    return run


def _run_points(run: Path, todo: list[Point], study: Study, engine: str, t0: float,
                max_minutes: float | None) -> tuple[bool, int]:
    """Returns (stopped for the time budget?, index of the first point not run)."""
    with tqdm(total=len(todo) * study.rounds, unit="round", dynamic_ncols=True) as bar:
        longest = 0.0
        for i, p in enumerate(todo):
            elapsed = time.monotonic() - t0
            if max_minutes and i > 0 and elapsed + longest > max_minutes * 60:
                return True, i
            bar.set_description(f"point {i + 1}/{len(todo)} {p.id}")
            ts = time.monotonic()
            s = run_point_notebook(run, p, engine, bar)
            longest = max(longest, time.monotonic() - ts)
            bar.update(study.rounds * (i + 1) - bar.n)  # a failed point's rounds count as done
            if s.get("status") == "failed":
                tqdm.write(f"  {p.id}: FAILED: {s.get('reason')}")
    return False, len(todo)


def _manifest_engine(run: Path, requested: str) -> str:
    m = runfolder.read_manifest(run) or {}
    return m.get("engine", requested) if requested == "auto" else requested


def dry_run(params_files: list[str], engine: str = "auto") -> list[Point]:
    study = load_study(*params_files)
    engine = resolve_engine(engine)
    points = expand(study, engine)
    print(f"study {study.name}: {len(points)} points x {study.rounds} rounds, engine {engine}")
    for p in points:
        print(f"\n{p.id}\n  vllm args: {' '.join(p.engine_args.cli())}\n  effective: {p.effective}")
        for w in p.warnings:
            print(f"  warning: {w}")
    return points
