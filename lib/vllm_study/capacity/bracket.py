"""The most load a server start sustains within an SLO: a probe at the bracket's top,
then a bisection over the load, each step one measured round; the bracket's bottom is
measured only when every step above it missed.

The search is written against a `measure(load) -> Step` function, so the same code
runs a live start (point.py), a synthetic SLO function with a known capacity (the unit
tests) and a completed run read back from disk. It assumes what open-loop serving
gives: above some load the SLO is missed, below it met. A step that failed (errors,
timeouts, a dead server) is a miss, never a pass.

Loads scale multiplicatively (2 to 4 req/s is as big a step as 4 to 8), so the
bisection is geometric and its precision is a ratio: precision 0.05 stops once the
bracket's high end is within 5% of its low end. Concurrency is a whole number: its
midpoints are rounded and it stops once the two ends are neighbours.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from pydantic import BaseModel

# A latency bound is judged on the round's figure measured from each request's
# scheduled arrival where the round had a schedule (open loop): a client or server that
# falls behind then cannot hide its delay as a late send (coordinated omission).
FROM_SCHEDULE = {"ttft": "ttft_sched", "e2e": "e2e_sched"}


@dataclass(frozen=True)
class Step:
    load: float
    met: bool
    why: str                 # the bounds it missed, or why it failed; "" when met
    round: int | None = None  # the round record that measured it


class CapacityRecord(BaseModel):
    """One start's search, as start.json keeps it."""
    over: Literal["speed", "rate", "concurrency"]
    load: float | None              # the highest load that met the SLO (None: not even lo)
    bracket: tuple[float, float | None]   # met at [0], missed at [1] (None: hi met, capacity >= hi)
    censored: Literal["below", "above"] | None = None  # below lo / at or above hi
    requests_per_s: float | None = None   # the load as requests per second (the report's unit)
    at_round: int | None = None     # the round measured at the capacity (its latencies are "at capacity")
    steps: list[dict] = []          # every step: load, met, why, round


@dataclass
class Bracket:
    over: Literal["speed", "rate", "concurrency"]
    lo: float
    hi: float
    precision: float
    max_steps: int
    steps: list[Step] = field(default_factory=list)

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
        """Probe hi (a pass: the capacity is at or above it), then bisect between the
        highest pass and the lowest miss; lo is measured only if no step above it met
        (a miss there: the capacity is below the bracket). hi goes first because a
        step's round takes about its window's span / load: the low loads are the slow
        steps, and a bisection that finds a pass never needs lo itself."""
        if self._take(measure, self.hi).met:
            return self._record(self.steps[-1], (self.hi, None), "above")
        best, lo, hi = None, self.lo, self.hi
        while len(self.steps) < self.max_steps - (best is None) and not self._done(lo, hi):
            mid = self._mid(lo, hi)
            if mid is None:
                break
            s = self._take(measure, mid)
            if s.met:
                best, lo = s, mid
            else:
                hi = mid
        if best is None:  # every step above lo missed: lo decides between a bracket and "below"
            s = self._take(measure, self.lo)
            if not s.met:
                return self._record(None, (0.0, self.lo), "below")
            best = s
        return self._record(best, (lo, hi), None)

    def _take(self, measure, load: float) -> Step:
        s = measure(load)
        self.steps.append(s)
        return s

    def _record(self, best: Step | None, bracket, censored) -> CapacityRecord:
        # below lo: the report still shows the latencies the lowest step had
        at = best.round if best else self.steps[-1].round
        return CapacityRecord(over=self.over, load=best.load if best else None, bracket=bracket, censored=censored,
                              at_round=at, steps=[vars(s) for s in self.steps])


def planned_steps(lo: float, hi: float, precision: float, max_steps: int, integer: bool = False) -> int:
    """The most steps a search over [lo, hi] can take (for time estimates and progress)."""
    if integer:
        bisections = math.ceil(math.log2(max(hi - lo, 1)))
    else:
        bisections = math.ceil(math.log2(max(math.log(hi / lo) / math.log1p(precision), 1)))
    return min(max_steps, 2 + bisections)


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


def judge(values: dict, slo: dict[str, float], failed_reason: str | None = None) -> tuple[bool, str]:
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
