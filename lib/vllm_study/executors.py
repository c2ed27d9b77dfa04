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

import fcntl
import io
import os
import queue
import shutil
import tarfile
import tempfile
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
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


class SlotLock:
    """One server at a time on a slot, across processes. The sweep starts a start's
    notebook (papermill, kernel, imports, plan) while the slot's previous start is still
    running; the notebook takes this lock before its server touches the GPU (before it
    spawns it, or, started ahead, while the server is held at its engine's init), and
    the previous one gives it back once its own server has stopped. An flock: the OS
    releases it if its holder dies."""

    def __init__(self, path: str | Path):
        self.path, self.fd = Path(path), None

    def acquire(self, wait: bool = True) -> bool:
        """Takes the slot, blocking until it is free; wait=False: only if it is free now.
        Returns whether it is held (if not, nothing is)."""
        fd = os.open(self.path, os.O_CREAT | os.O_RDWR, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        self.fd = fd
        return True

    @property
    def held(self) -> bool:
        return self.fd is not None

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing the descriptor releases the flock
            self.fd = None


SLOT_LOCKS = ".slot-*.lock"  # in the run folder while a sweep runs (and in .gitignore)


def slot_lock_path(run_dir: Path, slot: list[int] | None) -> Path:
    return Path(run_dir) / SLOT_LOCKS.replace("*", "gpus-" + "-".join(map(str, slot)) if slot else "local")


@dataclass
class UnitLengths:
    """The longest unit so far, of each kind, from when it had its slot to itself. A unit
    handed a free slot carries its whole server start-up; one queued behind a running
    unit (started ahead) hid most of it behind that one's measurement, so it is shorter
    (7B on one H200: 3.2 min for a slot's first start, under 2.2 min for those behind).
    Charging a queued unit the first start's length would leave budget unused."""
    free: float = 0.0
    behind: float = 0.0

    @property
    def longest(self) -> float:
        return max(self.free, self.behind)

    def bound(self, behind: bool) -> float:
        """What a unit of this kind may take: the longest of its kind, or, before one of
        its kind has ended, the longest of the other."""
        mine, other = (self.behind, self.free) if behind else (self.free, self.behind)
        return mine or other

    def add(self, seconds: float, behind: bool) -> None:
        if behind:
            self.behind = max(self.behind, seconds)
        else:
            self.free = max(self.free, seconds)


class Dispatcher:
    """Runs units on slots (None = whatever this machine has), in order, while the time
    budget allows. `work(unit, slot, release)` runs one; it may call release() early
    (once its server is spawned and has the slot), and the slot's next unit then starts
    preparing and waits at the slot's SlotLock; otherwise the slot is free again when its
    unit ends. So a slot has at most two units: one running, one prepared and waiting."""

    def __init__(self, slots: list, work, t0: float, max_minutes: float | None,
                 lengths: UnitLengths | None = None):
        self.slots, self.work, self.t0, self.max_minutes = list(slots), work, t0, max_minutes
        # `lengths`: what an earlier dispatcher of the same sweep measured (its precision
        # blocks are dispatched anew)
        self.lengths = lengths or UnitLengths()
        self.began: dict[int, float] = {}  # slot index: when its latest unit was handed to it
        self.began_behind: dict[int, bool] = {}  # slot index: whether that unit was queued behind another
        self.ended: dict[int, float] = {}  # slot index: when its last unit ended
        self.running: dict[int, int] = {}  # slot index: its units not yet ended (at most two)
        self.reoffer: set[int] = set()  # slots released early whose next unit did not fit yet
        self.lock = threading.Lock()

    def _fits(self, started: int, i: int, behind: bool) -> bool:
        """The sweep's first unit always goes (each invocation makes progress); any other
        only if a unit as long as the longest of its kind so far would still end inside
        the budget. One queued behind a running unit (its slot released early) starts when
        that one ends: at the latest, the running one's bound after it had its slot."""
        if not self.max_minutes or (started == 0 and not self.lengths.longest):
            return True
        now = time.monotonic()
        need = self.lengths.bound(behind)
        if behind:
            with self.lock:
                since = max(self.began[i], self.ended.get(i, 0.0))
                running = self.lengths.bound(self.began_behind[i])
            need += max(0.0, running - (now - since))
        return now - self.t0 + need <= self.max_minutes * 60

    def _timed(self, unit: Unit, i: int, release, behind: bool):
        ts = time.monotonic()
        with self.lock:
            self.began[i], self.began_behind[i] = ts, behind
            self.running[i] = self.running.get(i, 0) + 1
        try:
            return self.work(unit, self.slots[i], lambda: release(early=True))
        finally:
            with self.lock:
                now = time.monotonic()
                # a unit queued behind another had its slot only once that one ended
                self.lengths.add(now - max(ts, self.ended.get(i, ts)), behind)
                self.ended[i] = now
                self.running[i] -= 1
            release(early=False)

    def _releaser(self, free: queue.Queue, i: int):
        once = threading.Lock()

        def release(early: bool):
            if early and self.max_minutes and not self.lengths.longest:
                return  # under a budget, nothing queues behind a unit before one unit's length is known
            if once.acquire(blocking=False):  # the first call hands the slot back; later ones do nothing
                free.put((i, early))
            elif not early:
                with self.lock:
                    if i in self.reoffer and not self.running[i]:  # the next unit waits to know it fits
                        self.reoffer.discard(i)
                        free.put((i, False))
        return release

    def _reoffer_when_done(self, free: queue.Queue, i: int) -> None:
        """A unit did not fit behind slot i's running one: offer the slot again, as free,
        once that one has ended (now, if it already has)."""
        with self.lock:
            if not self.running[i]:
                free.put((i, False))
            else:
                self.reoffer.add(i)

    @staticmethod
    def _next_free(free: queue.Queue, futures: list[Future]):
        while True:
            try:
                return free.get(timeout=0.2)
            except queue.Empty:
                for f in futures:
                    if f.done():
                        f.result()  # an exception in a unit is the sweep's to handle

    def run(self, units: list[Unit]) -> tuple[int, UnitLengths]:
        """Returns (units not started for the budget, the longest units' seconds)."""
        free: queue.Queue = queue.Queue()  # (slot index, released early: its unit still runs)
        for i in range(len(self.slots)):
            free.put((i, False))
        futures: list[Future] = []
        started, left = 0, 0
        pool = ThreadPoolExecutor(max_workers=2 * len(self.slots))
        try:
            n = 0
            while n < len(units):
                i, behind = self._next_free(free, futures)
                if not self._fits(started, i, behind):
                    if behind:  # the running unit may end sooner than the estimate: ask again then
                        self._reoffer_when_done(free, i)
                        continue
                    left = len(units) - n
                    break
                futures.append(pool.submit(self._timed, units[n], i, self._releaser(free, i), behind))
                started, n = started + 1, n + 1
            for f in futures:
                f.result()
        except BaseException:
            # Ctrl-C or SIGTERM: hand back at once; the sweep stops the running starts'
            # kernels and servers, which ends these threads
            pool.shutdown(wait=False, cancel_futures=True)
            raise
        pool.shutdown(wait=True)
        return left, self.lengths


# -- Ray ----------------------------------------------------------------------------
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

    from . import orphan_guard
    from .sweep import run_unit
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

    from .server import without_colours
    died = (rx.WorkerCrashedError, rx.NodeDiedError, rx.OutOfMemoryError, rx.LocalRayletDiedError)
    text = " ".join(ln.strip() for ln in without_colours(str(error)).splitlines() if ln.strip())
    if isinstance(error, died):
        return f"the Ray worker running this start died: {text}"[:500]
    return f"the Ray task running this start failed: {type(error).__name__}: {text}"[:500]


def record_lost_start(run: RunFolder, unit: Unit, rounds_planned: int, started_utc: str, reason: str) -> None:
    """A failed start in the run folder for a Ray start that never came back (its worker
    died, its node went away): its rounds are gone with the worker's scratch folder; the
    report shows the reason and `--resume --retry-failed` runs it again."""
    from .results import START, StartRecord, now_utc
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
