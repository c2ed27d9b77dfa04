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

An executor is one module of this package with one Executor subclass, named in
EXECUTORS; the Dispatcher below hands it units, one per free slot, within the budget.
"""
from __future__ import annotations

import datetime as dt
import importlib
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from ..define.grid import Unit
from ..define.schema import StudyError

# name -> "module:class" in this package; imported when chosen (Ray only where it is asked for)
EXECUTORS = {"local": "local:LocalExecutor", "gpus": "local:GpusExecutor", "ray": "ray_cluster:RayExecutor"}


class Executor:
    """Runs one unit on one of its slots and returns the point's summary. `slots`: what
    can run at once (a slot is a GPU set, or None); `rounds_live`: whether a unit's rounds
    land in the run folder as they are measured (the progress bar follows them), or come
    back with the unit."""
    kind = ""
    rounds_live = True

    def __init__(self, run, study, engine: str, points: list, ray_address: str | None = None,
                 parallel: int | None = None):
        self.run, self.study, self.engine = run, study, engine
        self.tp = max((p.engine_args.tensor_parallel_size or 1) for p in points) if points else 1
        self.slots: list = [None]

    def __call__(self, unit: Unit, slot, bar, release=None):
        raise NotImplementedError


def make(name: str, run, study, engine: str, points: list, ray_address: str | None = None,
         parallel: int | None = None) -> Executor:
    """The executor called `name` (EXECUTORS), ready to run this study's units."""
    if name not in EXECUTORS:
        raise StudyError(f"unknown executor {name!r}: {', '.join(EXECUTORS)}")
    module, cls = EXECUTORS[name].split(":")
    return getattr(importlib.import_module(f".{module}", __name__), cls)(run, study, engine, points, ray_address,
                                                                         parallel)


@dataclass
class UnitLengths:
    """The longest unit so far, of each kind, from when it had its slot to itself. A unit
    handed a free slot carries its whole server start-up; one queued behind a running
    unit (started ahead) hid most of it behind that one's measurement, so it is shorter
    (7B on one H200: 3.2 min for a slot's first start, under 2.2 min for those behind).
    Charging a queued unit the first start's length would leave budget unused."""
    free: float = 0.0
    behind: float = 0.0
    # the longest start a resumed run recorded before this invocation (recorded_lengths):
    # a slice whose first unit missed fast must not then begin one that bisects for 15 min
    before: float = 0.0
    # point id: its longest start, recorded or measured. A config's next start runs the
    # same search on the same server, so its own length bounds it better than the longest
    # of any (a 5-minute miss at the floor beside a 15-minute bisection)
    points: dict[str, float] = field(default_factory=dict)

    @property
    def longest(self) -> float:
        """Measured in this invocation only: its first unit always goes (_fits)."""
        return max(self.free, self.behind)

    def bound(self, behind: bool, point: str | None = None) -> float:
        """What a unit of this kind may take: a start of `point` as long as its longest;
        a point not started yet, the longest of its kind, or, before one of its kind has
        ended, the longest of the other, never less than the run's recorded longest start."""
        if point in self.points:
            return self.points[point]
        mine, other = (self.behind, self.free) if behind else (self.free, self.behind)
        return max(mine or other, self.before)

    def add(self, seconds: float, behind: bool, point: str | None = None) -> None:
        if behind:
            self.behind = max(self.behind, seconds)
        else:
            self.free = max(self.free, seconds)
        if point is not None:
            self.points[point] = max(self.points.get(point, 0.0), seconds)


def recorded_lengths(run) -> UnitLengths:
    """What a resumed run's start records say its starts take: each finished start's slot
    time (started_utc, when the slot was taken, to finished_utc), the longest overall and
    each point's longest."""
    lengths = UnitLengths()
    for pid in run.point_ids():
        for s in run.point(pid).starts():
            if s.finished_utc and s.started_utc[:1].isdigit() and not s.served_by:
                took = (dt.datetime.fromisoformat(s.finished_utc) - dt.datetime.fromisoformat(s.started_utc))
                lengths.points[pid] = max(lengths.points.get(pid, 0.0), took.total_seconds())
    lengths.before = max(lengths.points.values(), default=0.0)
    return lengths


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
        # slot index: when the unit that has the slot began to count against the budget:
        # handed a free slot, when it was handed; queued behind another, when it took the
        # slot (its early release). Taken from the unit itself, not from when the dispatcher
        # saw the one before end: the next unit can take the slot's lock before that.
        self.since: dict[int, float] = {}
        self.since_behind: dict[int, bool] = {}  # slot index: whether that unit was queued behind another
        self.on_slot: dict[int, str] = {}  # slot index: the point of the unit last handed it
        self.ended: dict[int, float] = {}  # slot index: when its last unit ended
        self.running: dict[int, int] = {}  # slot index: its units not yet ended (at most two)
        self.reoffer: set[int] = set()  # slots released early whose next unit did not fit yet
        # slot index: an early release held back while the unit before the releasing one
        # still finishes (its results, after its server stopped): a third unit would crowd
        # the slot. It is made once that unit ends.
        self.held: dict[int, Callable[[bool], None]] = {}
        self.lock = threading.Lock()

    def _fits(self, started: int, i: int, behind: bool, point: str | None = None) -> bool:
        """The sweep's first unit always goes (each invocation makes progress); any other
        only if it would still end inside the budget, taking as long as UnitLengths.bound
        says (`point`: the next unit's, where known before it is drawn). One queued behind
        a running unit (its slot released early) starts when that one ends: at the latest,
        the running one's bound after it had its slot."""
        if not self.max_minutes or (started == 0 and not self.lengths.longest):
            return True
        now = time.monotonic()
        need = self.lengths.bound(behind, point)
        if behind:
            with self.lock:
                since, running = self.since[i], self.lengths.bound(self.since_behind[i], self.on_slot.get(i))
            need += max(0.0, running - (now - since))
        return now - self.t0 + need <= self.max_minutes * 60

    def _timed(self, unit: Unit, i: int, release, behind: bool):
        ts = time.monotonic()
        took: list[float] = []  # when a unit queued behind another took the slot

        def early():
            if behind and not took:
                with self.lock:
                    took.append(time.monotonic())
                    self.since[i], self.since_behind[i] = took[0], True
            release(early=True)

        with self.lock:
            if not behind:  # one queued behind counts from when it takes the slot (early())
                self.since[i], self.since_behind[i] = ts, False
            self.on_slot[i] = unit.point
            self.running[i] = self.running.get(i, 0) + 1
        try:
            return self.work(unit, self.slots[i], early)
        finally:
            with self.lock:
                now = time.monotonic()
                # a unit queued behind another had its slot only once that one ended; one
                # that never took it (it failed first) is counted from then
                had = took[0] if took else max(ts, self.ended.get(i, ts)) if behind else ts
                self.lengths.add(now - had, behind, unit.point)
                self.ended[i] = now
                self.running[i] -= 1
                held = self.held.pop(i, None)
            if held is not None:
                held(True)
            release(early=False)

    def _releaser(self, free: queue.Queue, i: int):
        once = threading.Lock()

        def release(early: bool):
            if early and self.max_minutes and not self.lengths.longest:
                return  # under a budget, nothing queues behind a unit before one unit's length is known
            if early:
                with self.lock:
                    if self.running.get(i, 0) >= 2:   # the unit before still finishing: later (self.held)
                        self.held[i] = release
                        return
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

    def run(self, units) -> tuple[int, UnitLengths]:
        """Returns (units not started for the budget, the longest units' seconds). `units`:
        a list, or anything with len() that gives units one at a time (a search's trials:
        the next one is asked for only once a slot is free and it fits the budget)."""
        free: queue.Queue = queue.Queue()  # (slot index, released early: its unit still runs)
        for i in range(len(self.slots)):
            free.put((i, False))
        futures: list[Future] = []
        started, left, total = 0, 0, len(units)
        source = iter(units)
        pool = ThreadPoolExecutor(max_workers=2 * len(self.slots))
        try:
            n = 0
            while n < total:
                i, behind = self._next_free(free, futures)
                upcoming = units[n].point if isinstance(units, list) else None  # a search's: not drawn yet
                if not self._fits(started, i, behind, upcoming):
                    if behind:  # the running unit may end sooner than the estimate: ask again then
                        self._reoffer_when_done(free, i)
                        continue
                    left = total - n
                    break
                unit = next(source, None)
                if unit is None:  # a source that ran out before its len (a search with nothing new to try)
                    break
                futures.append(pool.submit(self._timed, unit, i, self._releaser(free, i), behind))
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


