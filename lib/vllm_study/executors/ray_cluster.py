"""Executor ray: each server start a Ray task that asks for its GPUs (num_gpus) on the
cluster at --ray-address; the task returns its start folder and the driver writes it
into the run folder. Ray schedules; the kit does not. No task is retried: a start whose
worker dies is a failed start with Ray's reason, and the sweep goes on.

A start that serves several points (server.live_knobs, or a search's live batch) is one
task too: it carries every served point's plan and brings back each one's start folder
(the lead's holds the launch and the server log; the others name it in `served_by`)."""
from __future__ import annotations

import io
import shutil
import tarfile
import tempfile
from pathlib import Path

from tqdm import tqdm

from ..define.grid import Unit
from ..measure.point import summarize
from ..records.results import RunFolder, now_utc, resume_hint
from ..measure.unit import run_unit
from . import Executor
from ..launch import orphan_guard
from ..launch.server import without_colours
from ..records.results import START, StartRecord


class RayExecutor(Executor):
    kind = "ray"
    rounds_live = False  # a task's rounds come back with its start folder, all at once

    def __init__(self, run, study, engine, points, ray_address=None, parallel=None):
        import ray
        super().__init__(run, study, engine, points)
        ray.init(address=ray_address, ignore_reinit_error=True, log_to_driver=False)
        have = ray.cluster_resources()
        tp = self.tp
        # a GPU point takes tp GPUs; a CPU server wants two cores of its own
        width = max(1, int(have.get("GPU", 0)) // tp) if engine == "gpu" else max(1, int(have.get("CPU", 1)) // 2)
        self.slots = [None] * (parallel or width)
        # max_retries=0: a start whose worker died is a failed start, recorded as such
        # (Ray's default, 3 retries, started it again unrecorded, beside its orphans)
        self.task = ray.remote(num_gpus=tp if engine == "gpu" else 0, num_cpus=1, max_retries=0)(ray_start)

    def __call__(self, unit: Unit, slot, bar: tqdm | None, release=None):
        import ray
        plans = {p: self.run.point(p).plan_path.read_text() for p in unit.points}
        started = now_utc()
        try:
            packed = ray.get(self.task.remote(plans, unit.model_dump()))
        except ray.exceptions.RayError as e:
            # its worker died (the guard stopped what it ran) or the task raised: the start
            # failed, as data; the sweep goes on with the other units
            record_lost_start(self.run, unit, self.study.steps_per_start, started, lost_start_reason(e))
            tqdm.write(f"  {unit.point} start {unit.start} came back from Ray without its results; "
                       f"once the sweep has ended, this runs it again:\n    {resume_hint(self.run)} --retry-failed")
        else:
            unpack_start(self.run, unit, packed)
        # the other served points' summaries, as the point notebook writes them under the
        # other executors (a search reads each trial's); the lead's is returned
        for p in unit.serves[1:]:
            summarize(self.run.point(p), self.run.point(p).plan())
        folder = self.run.point(unit.point)
        return summarize(folder, folder.plan())


def _pack(folder: Path) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        tar.add(folder, arcname=".")
    return buf.getvalue()


def ray_start(plans: dict[str, str], unit: dict) -> dict[str, bytes]:
    """A Ray task body: one server start in a scratch run folder on the worker; `plans`:
    each point the start serves, its plan (point.json). Returns each point's start folder
    packed. The worker needs the kit installed (the same environment).
    Its papermill, kernel and server each run in a session of their own and would outlive
    a killed worker: a guard process (orphan_guard) stops them and removes the scratch
    folder if the worker dies. The scratch folder goes once the start folders are packed."""
    import ray

    scratch = Path(tempfile.mkdtemp(prefix="vllm-study-"))
    guard = orphan_guard.launch(scratch)
    done = False
    try:
        run = RunFolder(scratch)
        for point_id, plan_json in plans.items():
            folder = run.point(point_id)
            folder.path.mkdir(parents=True)
            folder.plan_path.write_text(plan_json)
        u = Unit(**unit)
        gpus = [int(g) for g in ray.get_gpu_ids()] or None
        run_unit(run, u, gpus=gpus)
        # the notebook makes the served points' folders: one that died before leaves none to
        # bring back (as it leaves none under the other executors)
        packed = {p: _pack(d) for p in u.points if (d := run.point(p).start_dir(u.start)).is_dir()}
        done = True
        return packed
    finally:
        # done: nothing of the start runs any more, the guard just exits; else (the task
        # raised, or was cancelled) it stops what is left of the start first
        orphan_guard.release(guard, done)
        shutil.rmtree(scratch, ignore_errors=True)


def lost_start_reason(error: BaseException) -> str:
    """Why a Ray start came back without its start folder, in one line."""
    import ray.exceptions as rx

    died = (rx.WorkerCrashedError, rx.NodeDiedError, rx.OutOfMemoryError, rx.LocalRayletDiedError)
    text = " ".join(ln.strip() for ln in without_colours(str(error)).splitlines() if ln.strip())
    if isinstance(error, died):
        return f"the Ray worker running this start died: {text}"[:500]
    return f"the Ray task running this start failed: {type(error).__name__}: {text}"[:500]


def record_lost_start(run: RunFolder, unit: Unit, rounds_planned: int, started_utc: str, reason: str) -> None:
    """A failed start in the run folder, for each point it served, for a Ray start that
    never came back (its worker died, its node went away): its rounds are gone with the
    worker's scratch folder; the report shows the reason and `--resume --retry-failed`
    runs it again."""
    lead = f"{unit.point}/{run.point(unit.point).start_dir(unit.start).name}"  # as live_start names it
    for p in unit.points:
        StartRecord(point=p, start=unit.start, block=unit.block, status="failed", reason=reason,
                    started_utc=started_utc, finished_utc=now_utc(), host="unknown (a Ray worker)",
                    rounds_planned=rounds_planned, serves=unit.serves if p == unit.point else [],
                    served_by=None if p == unit.point else lead).save(_fresh_start_dir(run, p, unit.start) / START)


def _fresh_start_dir(run: RunFolder, point: str, start: int) -> Path:
    """The point's start folder in the run, emptied of an earlier try's files (a start run
    again with --retry-failed): none of them may be read as this try's."""
    dest = run.point(point).start_dir(start)
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    return dest


def unpack_start(run: RunFolder, unit: Unit, packed: dict[str, bytes]) -> None:
    """Each served point's start folder, as the task packed it, into the run folder."""
    for point, data in packed.items():
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
            tar.extractall(_fresh_start_dir(run, point, unit.start), filter="data")
