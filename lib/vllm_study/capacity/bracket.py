"""The most load a server start sustains within an SLO: a probe at the bracket's top,
then a bisection over the load, each step one measured round; the bracket's bottom is
measured only when every step above it missed; where it misses too, the search halves
the load down to a floor, and bisects between the first pass and the miss above it.

The search is written against a `measure(load) -> Step` function, so the same code
runs a live start (point.py), a synthetic SLO function with a known capacity (the unit
tests) and a completed run read back from disk. It assumes what open-loop serving
gives: above some load the SLO is missed, below it met. A step that failed (errors,
timeouts, a dead server) is a miss, never a pass.

Loads scale multiplicatively (2 to 4 req/s is as big a step as 4 to 8), so the
bisection is geometric and its precision is a ratio: precision 0.05 stops once the
bracket's high end is within 5% of its low end. Concurrency is a whole number: its
midpoints are rounded and it stops once the two ends are neighbours.

The step budget: `max_steps` for the probe, the bisection above lo and lo itself, as
before; below lo, the halving may take up to ceil(log2(lo / floor)) more steps (3 with
the default floor lo / 8), and the bisection below lo gets what the halving left of them.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal, TypeVar

from pydantic import BaseModel

R = TypeVar("R")

# A latency bound is judged on the round's figure measured from each request's
# scheduled arrival where the round had a schedule (open loop): a client or server that
# falls behind then cannot hide its delay as a late send (coordinated omission).
FROM_SCHEDULE = {"ttft": "ttft_sched", "e2e": "e2e_sched"}


class Stopped(Exception):
    """measure() raises it where the start itself failed (its server died, say) before the
    step had its verdict: the search ends with the steps that ran, the one that raised is
    none of them (a dead server says nothing of that load), and the record has no capacity."""


@dataclass(frozen=True)
class Step:
    load: float
    met: bool
    why: str                 # the bounds it missed, or why it failed; "" when met
    round: int | None = None  # the round record that measured it
    margins: dict[str, float] | None = None  # per SLO bound: measured / limit (met at <= 1)


class CapacityRecord(BaseModel):
    """One start's search, as start.json keeps it."""
    over: Literal["speed", "rate", "concurrency"]
    load: float | None              # the highest load that met the SLO (None: not even the floor)
    bracket: tuple[float, float | None]   # met at [0], missed at [1] (None: hi met, capacity >= hi)
    censored: Literal["below", "above"] | None = None  # below the floor / at or above hi
    floor: float | None = None      # the lowest load the search could go to (None: lo, runs before the floor)
    requests_per_s: float | None = None   # the load as requests per second (the report's unit)
    at_round: int | None = None     # the round measured at the capacity (its latencies are "at capacity")
    steps: list[dict] = []          # every step: load, met, why, round, margins (not in older runs)
    stopped: str | None = None      # why the search ended before its answer (the start failed): no capacity

    def step_rounds(self, rounds: list[R]) -> list[list[R]]:
        """Each step's round records (anything with .round and .load): its `round` and the
        rounds after it at its load, up to the next step's. One a step, or with
        trace.windows one a window, which the step judged pooled (measure.rounds)."""
        firsts = [s.get("round") for s in self.steps]
        later = sorted(r for r in firsts if r is not None)
        out = []
        for s, first in zip(self.steps, firsts):
            if first is None:
                out.append([])
                continue
            nxt = next((r for r in later if r > first), math.inf)
            out.append(sorted((r for r in rounds if r.round == first
                               or (first < r.round < nxt and r.load == s["load"])), key=lambda r: r.round))
        return out


@dataclass
class Bracket:
    over: Literal["speed", "rate", "concurrency"]
    lo: float
    hi: float
    precision: float
    max_steps: int
    floor: float | None = None   # halve below lo down to this where lo misses (None: stop at lo)
    probe: Literal["hi", "lo"] = "hi"   # where the search begins (run's docstring)
    steps: list[Step] = field(default_factory=list)

    def __post_init__(self):
        if self.floor is None:
            self.floor = self.lo

    @property
    def integer(self) -> bool:
        return self.over == "concurrency"

    def _mid(self, lo: float, hi: float) -> float | None:
        m = math.sqrt(lo * hi)
        if self.integer:
            m = float(round(m))
            if m <= lo or m >= hi:
                m = lo + 1 if lo + 1 < hi else None
        return m

    def _done(self, lo: float, hi: float) -> bool:
        if self.integer and hi - lo <= 1:
            return True
        return hi / lo - 1 <= self.precision

    def run(self, measure: Callable[[float], Step]) -> CapacityRecord:
        """The search (_run); where measure() raises Stopped, the steps that ran and why
        it stopped, with no capacity: load None, the bracket as far as those steps went."""
        try:
            return self._run(measure)
        except Stopped as e:
            met = [s.load for s in self.steps if s.met]
            missed = [s.load for s in self.steps if not s.met]
            return CapacityRecord(over=self.over, load=None, bracket=(max(met, default=0.0), min(missed, default=None)),
                                  floor=self.floor, steps=[vars(s) for s in self.steps], stopped=str(e))

    def _run(self, measure: Callable[[float], Step]) -> CapacityRecord:
        """Probe hi (a pass: the capacity is at or above it), then bisect between the
        highest pass and the lowest miss; lo is measured only if no step above it met
        (a miss there: the capacity is below the bracket). hi goes first because a
        step's round takes about its window's span / load: the low loads are the slow
        steps, and a bisection that finds a pass never needs lo itself.

        probe="lo" turns that round for studies with configs that may miss at every load:
        lo first, and a miss there goes straight below it (one step, where hi-first spends
        the whole budget before it learns that); a pass goes on to hi, then bisects."""
        if self.probe == "lo":
            first = self._take(measure, self.lo)
            if not first.met:
                return self._below(measure)
            if self._take(measure, self.hi).met:
                return self._record(self.steps[-1], (self.hi, None), "above")
            best, lo, hi = self._bisect(measure, first, self.lo, self.hi, self.max_steps)
            return self._record(best, (lo, hi), None)
        if self._take(measure, self.hi).met:
            return self._record(self.steps[-1], (self.hi, None), "above")
        best, lo, hi = self._bisect(measure, None, self.lo, self.hi, self.max_steps)
        if best is None:  # every step above lo missed: lo decides between a bracket and going lower
            s = self._take(measure, self.lo)
            if not s.met:
                return self._below(measure)
            best = s
        return self._record(best, (lo, hi), None)

    def _below(self, measure: Callable[[float], Step]) -> CapacityRecord:
        """lo missed: halve the load until a step meets the SLO or the floor misses (a
        bound: "below floor"), then bisect between that pass and the miss above it with the
        steps the halving left (module docstring)."""
        step_budget = self.max_steps + halvings(self.lo, self.floor, self.integer)
        hi, load = self.lo, self.lo
        while load > self.floor:
            load = max(math.floor(load / 2) if self.integer else load / 2, self.floor)
            s = self._take(measure, load)
            if s.met:
                break
            hi = load
        else:
            return self._record(None, (0.0, self.floor), "below")
        best, lo, hi = self._bisect(measure, s, load, hi, step_budget)
        return self._record(best, (lo, hi), None)

    def _bisect(self, measure, best: Step | None, lo: float, hi: float, step_budget: int):
        """Bisect between lo and a miss at hi until the bracket is precise or the search
        has taken `step_budget` steps; while nothing has passed, one step is kept back for lo."""
        while len(self.steps) < step_budget - (best is None) and not self._done(lo, hi):
            mid = self._mid(lo, hi)
            if mid is None:
                break
            s = self._take(measure, mid)
            if s.met:
                best, lo = s, mid
            else:
                hi = mid
        return best, lo, hi

    def _take(self, measure, load: float) -> Step:
        s = measure(load)
        self.steps.append(s)
        return s

    def _record(self, best: Step | None, bracket, censored) -> CapacityRecord:
        # below the floor: the report still shows the latencies the lowest step had
        at = best.round if best else self.steps[-1].round
        return CapacityRecord(over=self.over, load=best.load if best else None, bracket=bracket, censored=censored,
                              floor=self.floor, at_round=at, steps=[vars(s) for s in self.steps])


def halvings(lo: float, floor: float, integer: bool = False) -> int:
    """The most steps the halving below lo takes to reach the floor."""
    if floor >= lo:
        return 0
    if integer:
        n, load = 0, lo
        while load > floor:
            load, n = max(math.floor(load / 2), floor), n + 1
        return n
    return math.ceil(math.log2(lo / floor) - 1e-9)


def planned_steps(lo: float, hi: float, precision: float, max_steps: int, integer: bool = False,
                  floor: float | None = None) -> int:
    """The most steps a search over [lo, hi] can take (for time estimates and progress);
    with a floor, the halving's steps below lo too."""
    extra = halvings(lo, floor, integer) if floor is not None else 0
    if integer:
        bisections = math.ceil(math.log2(max(hi - lo, 1)))
    else:
        bisections = math.ceil(math.log2(max(math.log(hi / lo) / math.log1p(precision), 1)))
    return min(max_steps, 2 + bisections) + extra


def trace_speed(over: str | None, load: float | None, trace_rate: float, default: float) -> float:
    """A trace's time scale for a capacity step: the load itself over speed; over rate, the
    speed that offers that many requests/s; otherwise (no step) the study's own speed."""
    if over == "speed":
        return load
    if over == "rate":
        return load / trace_rate
    return default


def bound_key(bound: str, values: dict) -> str:
    """The round figure a bound is judged on: ttft_p90_ms -> ttft_sched_p90_ms where the
    round measured latencies from a schedule."""
    lat, rest = bound.split("_", 1)
    sched = FROM_SCHEDULE.get(lat)
    key = f"{sched}_{rest}" if sched else bound
    return key if values.get(key) is not None else bound


def margins(values: dict, slo: dict[str, float]) -> dict[str, float]:
    """Each SLO bound's margin: the round's figure (bound_key) over its limit; met at <= 1.
    A bound the round did not measure has none."""
    out = {}
    for bound, limit in slo.items():
        v = values.get(bound_key(bound, values))
        if v is not None:
            out[bound] = v / limit
    return out


def meets_slo(values: dict, slo: dict[str, float], failed_reason: str | None = None) -> tuple[bool, str]:
    """Did a round meet every bound? Failed requests or a failed round are a miss."""
    if failed_reason:
        return False, failed_reason
    if values.get("failed"):
        return False, f"{values['failed']:.0f} of {values['requests']:.0f} requests failed"
    if not values.get("completed"):
        return False, "no request completed"
    missed = []
    for bound, limit in slo.items():
        key = bound_key(bound, values)
        v = values.get(key)
        if v is None:
            missed.append(f"{key} not measured")
        elif v > limit:
            missed.append(f"{key} {v:.0f} > {limit:g}")
    return not missed, "; ".join(missed)
