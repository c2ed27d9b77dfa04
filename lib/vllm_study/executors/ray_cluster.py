"""Executor ray: each server start a Ray task that asks for its GPUs (num_gpus) on the
cluster at --ray-address; the task returns its start folder and the driver writes it
into the run folder. Ray schedules; the kit does not. No task is retried: a start whose
worker dies is a failed start with Ray's reason, and the sweep goes on."""
from __future__ import annotations

import io
import shutil
import tarfile
import tempfile
from pathlib import Path

from tqdm import tqdm

from ..define.grid import Unit
from ..define.schema import StudyError
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
        if any(u.serves for u in run.manifest().order):  # a task ships one point's folder, not a group's
            raise StudyError("executor ray runs one point a server start, and this run shares starts between "
                             "points (server.live_knobs): set server.live_knobs: false in the study, or use "
                             "--executor local or gpus")
        if study.search and study.server.live_on(engine) and study.search.live_batch > 1:
            raise StudyError("executor ray runs one point a server start, and this search shares starts between "
                             "trials (server.live_knobs with search.live_batch > 1): set search.live_batch: 1 or "
                             "server.live_knobs: false, or use --executor local or gpus")
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
        folder = self.run.point(unit.point)
        started = now_utc()
        try:
            packed = ray.get(self.task.remote(folder.plan_path.read_text(), unit.model_dump(), unit.point))
        except ray.exceptions.RayError as e:
            # its worker died (the guard stopped what it ran) or the task raised: the start
            # failed, as data; the sweep goes on with the other units
            record_lost_start(self.run, unit, self.study.steps_per_start, started, lost_start_reason(e))
            tqdm.write(f"  {unit.point} start {unit.start} came back from Ray without its results; "
                       f"once the sweep has ended, this runs it again:\n    {resume_hint(self.run)} --retry-failed")
        else:
            unpack_start(self.run, unit, packed)
        return summarize(folder, folder.plan())


def _pack(folder: Path) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        tar.add(folder, arcname=".")
    return buf.getvalue()


def ray_start(plan_json: str, unit: dict, point_id: str) -> bytes:
    """A Ray task body: one server start in a scratch run folder on the worker; returns
    the start folder packed. The worker needs the kit installed (the same environment).
    Its papermill, kernel and server each run in a session of their own and would outlive
    a killed worker: a guard process (orphan_guard) stops them and removes the scratch
    folder if the worker dies. The scratch folder goes once the start folder is packed."""
    import ray

    scratch = Path(tempfile.mkdtemp(prefix="vllm-study-"))
    guard = orphan_guard.launch(scratch)
    done = False
    try:
        folder = RunFolder(scratch).point(point_id)
        folder.path.mkdir(parents=True)
        folder.plan_path.write_text(plan_json)
        u = Unit(**unit)
        gpus = [int(g) for g in ray.get_gpu_ids()] or None
        run_unit(RunFolder(scratch), u, gpus=gpus)
        packed = _pack(folder.start_dir(u.start))
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
    """A failed start in the run folder for a Ray start that never came back (its worker
    died, its node went away): its rounds are gone with the worker's scratch folder; the
    report shows the reason and `--resume --retry-failed` runs it again."""
    dest = _fresh_start_dir(run, unit)
    StartRecord(point=unit.point, start=unit.start, block=unit.block, status="failed", reason=reason,
                started_utc=started_utc, finished_utc=now_utc(), host="unknown (a Ray worker)",
                rounds_planned=rounds_planned).save(dest / START)


def _fresh_start_dir(run: RunFolder, unit: Unit) -> Path:
    """The unit's start folder in the run, emptied of an earlier try's files (a start run
    again with --retry-failed): none of them may be read as this try's."""
    dest = run.point(unit.point).start_dir(unit.start)
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    return dest


def unpack_start(run: RunFolder, unit: Unit, packed: bytes) -> None:
    dest = _fresh_start_dir(run, unit)
    with tarfile.open(fileobj=io.BytesIO(packed), mode="r:gz") as tar:
        tar.extractall(dest, filter="data")
