"""Executors without servers: GPU sets, ports for servers started side by side, the
dispatcher's concurrency, order and time budget, and per-slot compile caches."""
from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from vllm_study.executors import Dispatcher, compile_cache_env, gpu_slots
from vllm_study.grid import Unit
from vllm_study.server import free_port


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

    def work(unit, slot):
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
    def work(unit, slot):
        time.sleep(0.3)

    t0 = time.monotonic()
    left, longest = Dispatcher([None], work, t0, max_minutes=0.5 / 60).run(_units(5))
    # one at a time, 0.3 s each, 0.5 s budget: after the first, the second would end past it
    assert left == 4 and 0.3 <= longest < 1.0
    # a spent budget still lets the first unit go: every invocation makes progress
    left, _ = Dispatcher([None], work, t0 - 60, max_minutes=0.5 / 60).run(_units(3))
    assert left == 2


def test_an_error_in_a_unit_reaches_the_sweep():
    def work(unit, slot):
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        Dispatcher([None, None], work, time.monotonic(), None).run(_units(3))
