"""Who runs a study's server starts.

- local: one after another on this machine (the default);
- gpus: as many at once as this host's GPUs allow, each on a disjoint set of
  `tensor_parallel_size` GPUs (CUDA_VISIBLE_DEVICES), with its own port, log and
  torch.compile cache;
- ray: each start a Ray task that asks for its GPUs (num_gpus) on the cluster at
  --ray-address; the task returns its start folder and the driver writes it into the
  run folder. Ray schedules; the kit does not.

Every executor keeps the sweep's contract: units go out in the run's randomized block
order, no new one starts once the time budget would be overrun, a failure is recorded
as data, and SIGTERM stops what is running (the sweep's handler).
"""
from __future__ import annotations

import io
import os
import tarfile
import tempfile
import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from pathlib import Path

from .grid import Unit
from .results import RunFolder


def gpu_slots(n_gpus: int, tp: int) -> list[list[int]]:
    """Disjoint GPU sets of `tp` GPUs each (GPUs left over stay idle)."""
    if tp < 1:
        raise ValueError(f"tensor_parallel_size must be at least 1, got {tp}")
    if n_gpus < tp:
        raise ValueError(f"a point needs {tp} GPU(s) (tensor_parallel_size) but this host has {n_gpus}")
    return [list(range(i, i + tp)) for i in range(0, n_gpus - tp + 1, tp)]


def compile_cache_env(slot: list[int] | None) -> dict[str, str]:
    """Its own torch.compile cache per GPU slot: concurrent servers never write one
    cache at once, and a slot's later starts still reuse what its earlier ones built."""
    if slot is None:
        return {}
    root = Path(os.environ.get("VLLM_CACHE_ROOT", Path.home() / ".cache" / "vllm"))
    return {"VLLM_CACHE_ROOT": str(root / f"gpus-{'-'.join(map(str, slot))}")}


class Dispatcher:
    """Runs units on slots (None = whatever this machine has), at most one unit per slot
    at a time, in order, while the time budget allows. `work(unit, slot)` runs one."""

    def __init__(self, slots: list, work, t0: float, max_minutes: float | None):
        self.slots, self.work, self.t0, self.max_minutes = list(slots), work, t0, max_minutes
        self.longest = 0.0
        self.lock = threading.Lock()

    def _fits(self, started: int) -> bool:
        """The first unit always goes (each invocation makes progress); a later one only
        if the longest so far would still end inside the budget."""
        if not self.max_minutes or started == 0:
            return True
        return time.monotonic() - self.t0 + self.longest <= self.max_minutes * 60

    def _timed(self, unit: Unit, slot):
        ts = time.monotonic()
        try:
            return self.work(unit, slot)
        finally:
            with self.lock:
                self.longest = max(self.longest, time.monotonic() - ts)

    def run(self, units: list[Unit]) -> tuple[int, float]:
        """Returns (units not started for the budget, the longest unit's seconds)."""
        free = list(self.slots)
        running: dict[Future, object] = {}
        started, left = 0, 0
        pool = ThreadPoolExecutor(max_workers=len(self.slots))
        try:
            for i, unit in enumerate(units):
                while not free:
                    done, _ = wait(running, return_when=FIRST_COMPLETED)
                    for f in done:
                        free.append(running.pop(f))
                        f.result()  # an exception in a unit is the sweep's to handle
                if not self._fits(started):
                    left = len(units) - i
                    break
                slot = free.pop(0)
                running[pool.submit(self._timed, unit, slot)] = slot
                started += 1
            for f in list(running):
                f.result()
        except BaseException:
            # Ctrl-C or SIGTERM: hand back at once; the sweep stops the running starts'
            # kernels and servers, which ends these threads
            pool.shutdown(wait=False, cancel_futures=True)
            raise
        pool.shutdown(wait=True)
        return left, self.longest


# -- Ray ----------------------------------------------------------------------------
def _pack(folder: Path) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        tar.add(folder, arcname=".")
    return buf.getvalue()


def ray_start(plan_json: str, unit: dict, point_id: str) -> bytes:
    """A Ray task body: one server start in a scratch run folder on the worker; returns
    the start folder packed. The worker needs the kit installed (the same environment)."""
    import ray

    from .sweep import run_unit
    scratch = Path(tempfile.mkdtemp(prefix="vllm-study-"))
    folder = RunFolder(scratch).point(point_id)
    folder.path.mkdir(parents=True)
    folder.plan_path.write_text(plan_json)
    u = Unit(**unit)
    gpus = [int(g) for g in ray.get_gpu_ids()] or None
    run_unit(RunFolder(scratch), u, gpus=gpus)
    return _pack(folder.start_dir(u.start))


def unpack_start(run: RunFolder, unit: Unit, packed: bytes) -> None:
    dest = run.point(unit.point).start_dir(unit.start)
    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(packed), mode="r:gz") as tar:
        tar.extractall(dest, filter="data")
