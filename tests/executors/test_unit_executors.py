"""Executors without servers: GPU sets, ports for servers started side by side, the
dispatcher's concurrency, order and time budget, a slot's next unit preparing while the
previous one finishes (and the slot lock that keeps their servers apart), and per-slot
compile caches."""
from __future__ import annotations

import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from vllm_study.executors import Dispatcher, UnitLengths
from vllm_study.launch.slots import SlotLock, compile_cache_env, gpu_slots, slot_lock_path
from vllm_study.define.grid import Unit
from vllm_study.launch.server import free_port


@pytest.mark.parametrize("n, tp, want", [(4, 1, [[0], [1], [2], [3]]), (4, 2, [[0, 1], [2, 3]]),
                                         (3, 2, [[0, 1]]), (8, 4, [[0, 1, 2, 3], [4, 5, 6, 7]]), (2, 2, [[0, 1]])])
def test_gpu_slots_are_disjoint_sets_of_tp_gpus(n, tp, want):
    assert gpu_slots(n, tp) == want


def test_a_point_wider_than_the_host_is_refused():
    with pytest.raises(ValueError, match="needs 4 GPU"):
        gpu_slots(2, 4)


def test_ports_handed_out_at_once_never_repeat():
    with ThreadPoolExecutor(8) as pool:
        ports = list(pool.map(lambda _: free_port(), range(200)))
    assert len(set(ports)) == 200


def test_each_gpu_slot_has_its_own_compile_cache(monkeypatch):
    monkeypatch.setenv("VLLM_CACHE_ROOT", "/cache")
    assert compile_cache_env([0, 1]) == {"VLLM_CACHE_ROOT": "/cache/gpus-0-1"}
    assert compile_cache_env([2, 3]) != compile_cache_env([0, 1]) and compile_cache_env(None) == {}


def _units(n):
    return [Unit(point=f"p{i}", start=1, block=1) for i in range(n)]


def test_dispatcher_fills_every_slot_in_order_and_never_shares_one():
    busy, log, lock = set(), [], threading.Lock()
    peak = [0]

    def work(unit, slot, release):
        with lock:
            assert tuple(slot) not in busy  # one unit per slot at a time
            busy.add(tuple(slot))
            log.append(unit.point)
            peak[0] = max(peak[0], len(busy))
        time.sleep(0.05)
        with lock:
            busy.discard(tuple(slot))

    left, _ = Dispatcher(gpu_slots(4, 2), work, time.monotonic(), None).run(_units(7))
    assert left == 0 and log == [f"p{i}" for i in range(7)] and peak[0] == 2


def test_dispatcher_stops_starting_units_when_the_budget_would_be_overrun():
    def work(unit, slot, release):
        time.sleep(0.3)

    t0 = time.monotonic()
    left, lengths = Dispatcher([None], work, t0, max_minutes=0.5 / 60).run(_units(5))
    # one at a time, 0.3 s each, 0.5 s budget: after the first, the second would end past it
    assert left == 4 and 0.3 <= lengths.free < 1.0 and lengths.behind == 0
    # a spent budget still lets the first unit go: every invocation makes progress
    left, _ = Dispatcher([None], work, t0 - 60, max_minutes=0.5 / 60).run(_units(3))
    assert left == 2


def test_an_error_in_a_unit_reaches_the_sweep():
    def work(unit, slot, release):
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        Dispatcher([None, None], work, time.monotonic(), None).run(_units(3))


def test_a_released_slot_takes_its_next_unit_while_the_last_one_finishes(tmp_path):
    """Each unit holds its slot's lock for its 'server' phase and releases the slot
    early: the next unit starts preparing (overlapping the previous one's finish) but its
    server phase begins only after the previous one's ended; never more than two units
    on a slot, never two server phases at once."""
    events, lock = [], threading.Lock()
    per_slot: dict = {}

    def work(unit, slot, release):
        key = tuple(slot)
        with lock:
            per_slot[key] = per_slot.get(key, 0) + 1
            assert per_slot[key] <= 2
            events.append(("prepare", unit.point, key, time.monotonic()))
        sl = SlotLock(slot_lock_path(tmp_path, slot))
        sl.acquire()
        t_server = time.monotonic()
        # phases of 0.3 s: a loaded machine's thread wake-ups (0.1 s and more) stay inside them
        time.sleep(0.3)  # the server measures
        release()        # measured: the slot's next unit may prepare
        time.sleep(0.3)  # the server stops
        with lock:
            events.append(("server", unit.point, key, t_server, time.monotonic()))
        sl.release()
        time.sleep(0.3)  # results written after the lock is given back
        with lock:
            per_slot[key] -= 1

    left, _ = Dispatcher([[0], [1]], work, time.monotonic(), None).run(_units(6))
    assert left == 0
    servers = sorted((e for e in events if e[0] == "server"), key=lambda e: e[3])
    prepared = {e[1]: e[3] for e in events if e[0] == "prepare"}
    for slot in ((0,), (1,)):
        mine = [e for e in servers if e[2] == slot]
        assert len(mine) == 3
        for a, b in zip(mine, mine[1:]):
            assert a[4] <= b[3]           # server phases on one slot never overlap
            assert prepared[b[1]] < a[4]  # the next began preparing while the last one stopped


def test_a_slot_takes_no_third_unit_while_its_first_still_finishes(tmp_path):
    """Slot 0's first unit takes longer after its server stopped than the next unit's whole
    server phase: that next unit's early release waits until the first has ended, so the
    slot never holds three units (the one finishing, the one measured, a third preparing),
    though slot 1's short units leave the pool threads to start one."""
    lock, per_slot, peak, first = threading.Lock(), {}, {}, {}

    def work(unit, slot, release):
        key = tuple(slot)
        with lock:
            per_slot[key] = per_slot.get(key, 0) + 1
            peak[key] = max(peak.get(key, 0), per_slot[key])
            slow = first.setdefault(key, unit.point) == unit.point and key == (0,)
        if key == (1,):
            time.sleep(0.05)   # slot 1: short units that never release early
        else:
            sl = SlotLock(slot_lock_path(tmp_path, slot))
            sl.acquire()
            time.sleep(0.1)    # the server measures
            release()
            sl.release()
            time.sleep(1.5 if slow else 0.05)   # slot 0's first unit: long results after its server stopped
        with lock:
            per_slot[key] -= 1

    left, _ = Dispatcher([[0], [1]], work, time.monotonic(), None).run(_units(12))
    assert left == 0 and peak[(0,)] == 2


# The budget tests below are stated in seconds and run SCALE times slower: their margins
# (0.1-0.2 s stated) then outlast a loaded machine's thread and lock latencies (at 3x,
# a CI machine running vLLM servers beside them once let a unit through that should not fit).
SCALE = 5


def test_a_unit_queued_behind_another_counts_that_ones_time_against_the_budget():
    """Units of 0.3 s that release their slot at once, under a 0.8 s budget: the second
    waits for the first to end (no length known yet), then a third queued behind the
    second would end at ~0.3 + 2 x 0.3 s, past the budget: two run."""
    ran = []

    def work(unit, slot, release):
        release()
        ran.append(unit.point)
        time.sleep(SCALE * 0.3)

    left, _ = Dispatcher([None], work, time.monotonic(), max_minutes=SCALE * 0.8 / 60).run(_units(4))
    assert ran == ["p0", "p1"] and left == 2


def test_a_queued_unit_is_charged_only_what_the_running_one_may_still_take():
    """Units of 0.6 s that release their slot 0.4 s in, under a 2 s budget. p0 runs
    alone (no length known yet); p1 follows and releases at ~1.0 s: p2, queued behind it,
    would start by ~1.0 + (0.6 - 0.4) and end by ~1.8 s, inside the budget, so it is
    prepared (charging a whole 2 x 0.6 s would have refused it). p3, queued behind p2 at
    its release (~1.4 s, 0.2 s after p2 had the slot), would end by ~2.4 s: refused."""
    ran = []

    def work(unit, slot, release):
        ran.append(unit.point)
        time.sleep(SCALE * 0.4)
        release()
        time.sleep(SCALE * 0.2)

    left, _ = Dispatcher([None], work, time.monotonic(), max_minutes=SCALE * 2.0 / 60).run(_units(5))
    assert ran == ["p0", "p1", "p2"] and left == 2


def test_a_unit_that_did_not_fit_behind_a_running_one_is_asked_again_when_it_ends():
    """p0 takes 0.9 s (the longest), the rest 0.4 s and release their slot at once; 2.4 s
    budget. Behind p1 (released at ~0.9 s) p2 could end by 0.9 + 0.9 + 0.9 = 2.7 s: not
    yet. When p1 ends (~1.3 s) it fits (1.3 + 0.9 = 2.2 s) and runs; p3, asked again when
    p2 ends (~1.7 s), would end by 2.6 s: refused."""
    ran = []

    def work(unit, slot, release):
        ran.append(unit.point)
        release()
        time.sleep(SCALE * (0.9 if unit.point == "p0" else 0.4))

    left, _ = Dispatcher([None], work, time.monotonic(), max_minutes=SCALE * 2.4 / 60).run(_units(5))
    assert ran == ["p0", "p1", "p2"] and left == 2


def _at_the_slot_lock(tmp_path, ran: list, rest_s: float, tail_s: float = 0.0, events: list | None = None):
    """As a sweep's units do: wait at the slot's lock, release the slot (the server has
    spawned and has it), then hold it for 0.9 s (p0) or `rest_s` (the others), x SCALE;
    then take `tail_s` more after handing the lock on (a start writing its summary once
    its server is stopped). `events`: (point, "handed" | "ended", monotonic time)."""
    def work(unit, slot, release):
        if events is not None:
            events.append((unit.point, "handed", time.monotonic()))
        lock = SlotLock(slot_lock_path(tmp_path, slot))
        lock.acquire()
        try:
            ran.append(unit.point)
            release()
            time.sleep(SCALE * (0.9 if unit.point == "p0" else rest_s))
        finally:
            lock.release()
        time.sleep(SCALE * tail_s)
        if events is not None:
            events.append((unit.point, "ended", time.monotonic()))
    return work


def test_a_unit_prepared_behind_another_still_counts_as_running(tmp_path):
    """As a sweep's units do: each waits at its slot's lock, then releases the slot
    (its server spawned). p0 takes 0.9 s, the rest 0.4 s; 2.9 s budget. p2 is prepared
    behind p1 (fits by ~2.7 s); p3 does not fit behind p2 (~3.1 s) and must wait for p2
    to end (~1.7 s: fits by ~2.6 s), although p1 ended after p2 began preparing; p4 then
    fits neither behind p3 nor after it (~3.0 s)."""
    ran = []
    work = _at_the_slot_lock(tmp_path, ran, rest_s=0.4)
    left, _ = Dispatcher([[0]], work, time.monotonic(), max_minutes=SCALE * 2.9 / 60).run(_units(6))
    assert ran == ["p0", "p1", "p2", "p3"] and left == 2


def test_a_unit_that_took_the_slot_is_counted_from_then_though_the_one_before_has_not_ended(tmp_path):
    """The next unit takes the slot's lock while the one before still ends (0.3 s after
    handing the lock on); the dispatcher must count the running unit's time from when it
    took the slot, not from when the one before ended. p0: 0.9 s + 0.3 s; the rest 0.4 s +
    0.3 s; 3.8 s budget. p2 is prepared behind p1 (by ~3.6 s); when p2 takes the slot
    (~1.6 s) p3 does not fit behind it (~4.0 s: counted from p1's handing, ~3.6 s, it
    would) and is handed the slot only once p2 has ended (then it fits by ~3.5 s)."""
    ran, events = [], []
    work = _at_the_slot_lock(tmp_path, ran, rest_s=0.4, tail_s=0.3, events=events)
    left, _ = Dispatcher([[0]], work, time.monotonic(), max_minutes=SCALE * 3.8 / 60).run(_units(6))
    at = {(p, what): t for p, what, t in events}
    assert ran == ["p0", "p1", "p2", "p3"] and left == 2
    assert at["p2", "handed"] < at["p1", "ended"] and at["p3", "handed"] >= at["p2", "ended"]


def test_units_queued_behind_another_are_charged_the_longest_of_their_own_kind(tmp_path):
    """As a sweep started ahead: p0 has a free slot and takes 0.9 s (its whole start-up),
    the rest wait at the slot's lock, release it at once and take 0.3 s on it; 2.85 s
    budget. p2 is prepared behind p1 (by ~2.7 s with nothing of its kind known); p3 not
    behind p2 (~3.0 s) but on the free slot after it (~2.4 s). Once p2, queued behind,
    has ended in 0.3 s, p4, p5 and p6 are each prepared behind the one before (~2.7 s at
    the latest, p6); p7 would end by ~3.0 s. Charging every unit p0's 0.9 s would have
    run p0-p4 only."""
    ran = []
    work = _at_the_slot_lock(tmp_path, ran, rest_s=0.3)
    left, lengths = Dispatcher([[0]], work, time.monotonic(), max_minutes=SCALE * 2.85 / 60).run(_units(9))
    assert ran == [f"p{i}" for i in range(7)] and left == 2
    assert 0.9 <= lengths.free / SCALE < 1.0 and 0.3 <= lengths.behind / SCALE < 0.4


def test_unit_lengths_bound_a_kind_by_the_other_until_one_of_its_own_has_ended():
    lengths = UnitLengths()
    lengths.add(0.9, behind=False)
    assert lengths.bound(behind=True) == lengths.bound(behind=False) == 0.9
    lengths.add(0.3, behind=True)
    lengths.add(0.2, behind=True)
    assert (lengths.bound(behind=True), lengths.bound(behind=False), lengths.longest) == (0.3, 0.9, 0.9)
    assert UnitLengths(behind=0.4).bound(behind=False) == 0.4


def test_a_slot_lock_held_by_a_process_that_dies_is_free_again(tmp_path):
    path = tmp_path / ".slot-gpus-0.lock"
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; sys.path.insert(0, 'lib');"
                               "from vllm_study.launch.slots import SlotLock;"
                               f"SlotLock({str(path)!r}).acquire(); print('held', flush=True); time.sleep(60)"],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        waiter = SlotLock(path)
        got = threading.Event()
        t = threading.Thread(target=lambda: (waiter.acquire(), got.set()), daemon=True)
        t.start()
        assert not got.wait(0.5)  # held by the other process
        holder.kill()
        assert got.wait(5)        # the OS released it with the process
        waiter.release()
    finally:
        holder.kill()
        holder.wait()


def test_acquire_without_waiting_takes_a_free_slot_and_leaves_a_busy_one(tmp_path):
    path = tmp_path / ".slot-gpus-0.lock"
    first, second = SlotLock(path), SlotLock(path)
    assert first.acquire(wait=False) and first.held
    # busy: nothing held, nothing leaked
    assert not second.acquire(wait=False) and not second.held and second.fd is None
    first.release()
    assert second.acquire(wait=False)
    second.release()


def test_a_later_dispatch_of_the_same_sweep_keeps_the_longest_unit_it_was_given():
    """A sweep's precision blocks are dispatched anew: given the longest unit so far, the
    budget binds their first unit too, and a slot is handed on early from the first unit
    on (a fresh sweep waits for one unit's length before anything queues behind a unit)."""
    spans: dict[str, list[float]] = {}

    def work(unit, slot, release):
        spans[unit.point] = [time.monotonic()]
        release()  # "spawned and has the slot": the next unit may prepare now
        time.sleep(0.3)
        spans[unit.point].append(time.monotonic())

    t0 = time.monotonic()
    left, _ = Dispatcher([None], work, t0, max_minutes=0.5 / 60, lengths=UnitLengths(free=0.6)).run(_units(2))
    assert left == 2 and spans == {}  # a 0.6 s unit would end past the 0.5 s budget: none goes
    left, _ = Dispatcher([None], work, t0, max_minutes=10, lengths=UnitLengths(free=0.3)).run(_units(2))
    assert left == 0 and spans["p1"][0] < spans["p0"][1]  # p1 began while p0 still ran
    spans.clear()
    left, _ = Dispatcher([None], work, time.monotonic(), max_minutes=10).run(_units(2))
    assert left == 0 and spans["p1"][0] >= spans["p0"][1]  # fresh: p0's length unknown, p1 waited


def test_the_progress_bar_advances_once_per_round_as_rounds_land(tmp_path):
    """The start's watcher follows rounds.jsonl, so the bar moves per round (not per
    start) and a partly written last line is not counted until it is complete."""
    import io

    from tqdm import tqdm

    from vllm_study.records.results import ROUNDS, RoundRecord
    from vllm_study.measure.unit import _watch_start

    def line(i):
        return RoundRecord(point="p", start=1, round=i, status="ok", utc="t", metrics={}).model_dump_json()

    def wait_for(n):
        deadline = time.monotonic() + 10
        while bar.n != n and time.monotonic() < deadline:
            time.sleep(0.05)
        return bar.n

    bar, stop = tqdm(total=3, file=io.StringIO()), threading.Event()
    watcher = threading.Thread(target=_watch_start, args=(tmp_path, bar, None, stop), daemon=True)
    watcher.start()
    try:
        rounds = tmp_path / ROUNDS
        rounds.write_text(line(0) + "\n")
        assert wait_for(1) == 1
        with open(rounds, "a") as f:
            f.write(line(1)[:20])  # mid-write
        time.sleep(1.2)
        assert bar.n == 1
        with open(rounds, "a") as f:
            f.write(line(1)[20:] + "\n")
        assert wait_for(2) == 2
    finally:
        stop.set()
        watcher.join()


def test_a_resumed_run_bounds_its_next_starts_by_the_longest_it_recorded(tmp_path):
    """A slice whose first start ended fast (a config that missed at the floor) must not
    then begin one as long as the run's bisecting starts: it would be cut off mid-search
    by the machine's limit. The first unit of an invocation still always goes."""
    from synthetic_run import make_capacity_run
    from vllm_study.executors import recorded_lengths
    from vllm_study.records.results import StartRecord

    run = make_capacity_run(tmp_path, {"mbt=256": 3.0, "mbt=512": 5.0})
    times = {"mbt=256": ("2026-01-01T00:00:00+00:00", "2026-01-01T00:15:18+00:00"),
             "mbt=512": ("2026-01-01T01:00:00+00:00", "2026-01-01T01:05:42+00:00")}
    for pid in run.point_ids():
        path = run.point(pid).start_dir(1) / "start.json"
        rec = StartRecord.model_validate_json(path.read_text())
        rec.started_utc, rec.finished_utc = times[pid]
        rec.save(path)
    # start 2 of each (started_utc "x") holds no time
    assert recorded_lengths(run) == UnitLengths(before=918.0, points={"mbt=256": 918.0, "mbt=512": 342.0})

    def work(unit, slot, release):
        time.sleep(0.2)

    budget = 0.7 / 60
    left, _ = Dispatcher([None], work, time.monotonic(), budget, UnitLengths(before=0.6)).run(_units(3))
    assert left == 2  # 0.2 s measured, but the next may take the recorded 0.6 s: past 0.7 s
    left, _ = Dispatcher([None], work, time.monotonic(), budget).run(_units(3))
    assert left == 0  # measured alone, 0.2 s units fit three times


def test_a_point_started_before_is_bounded_by_its_own_longest_start():
    """A run's 15-minute bisection must not keep a config that missed at the floor in 5
    minutes from its next start: each point's own recorded length bounds it; a point
    never started is bounded by the run's longest."""
    lengths = UnitLengths(before=0.9, points={"fast": 0.2})
    assert lengths.bound(False, "fast") == 0.2 and lengths.bound(False, "new") == 0.9

    ran = []

    def work(unit, slot, release):
        ran.append(unit.point)
        time.sleep(0.2)

    units = [Unit(point=p, start=2, block=2) for p in ("slow", "fast", "slow2")]
    left, after = Dispatcher([None], work, time.monotonic(), 0.7 / 60,
                             UnitLengths(before=0.6, points={"slow": 0.6, "fast": 0.2})).run(units)
    # "slow" goes first (every invocation makes progress); "fast" fits at its own 0.2 s; a
    # third start of a point never started may take the run's 0.6 s: past 0.7 s
    assert ran == ["slow", "fast"] and left == 1 and after.points["slow"] >= 0.2
