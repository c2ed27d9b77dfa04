"""Arrival times for open-loop load: Poisson (or burstier/smoother gamma) gaps at a
request rate, and a ladder of such rates within one round.

Gaps are gamma-distributed with shape = burstiness and mean 1/rate, as in vLLM's
`vllm bench serve --burstiness`: 1 is a Poisson process, below 1 burstier, above 1
more regular; like vllm bench, the gaps are rescaled to hit the rate exactly. Seeded,
so a run replays the same arrival times.
"""
from __future__ import annotations

import numpy as np


def arrivals(n: int, rate: float, burstiness: float, seed: int, start_s: float = 0.0) -> list[float]:
    """Send times (seconds from the round's start) of n requests, the first at start_s.

    The gaps are rescaled so their mean is exactly 1/rate, as `vllm bench serve` does:
    unscaled, 300 exponential gaps have a mean off by about 6% (1/sqrt(n)), so rounds
    and seeds would differ in load, not just in arrival pattern (README, client
    agreement: the kit's unscaled H200 schedules averaged 15.4 req/s where 16 was asked)."""
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=max(n - 1, 0))
    if len(gaps):
        gaps *= (1.0 / rate) / gaps.mean()
    return (start_s + np.concatenate(([0.0], np.cumsum(gaps)))).tolist()[:n]  # [:n]: n = 0


def ladder(n: int, rates: list[float], burstiness: float, seed: int) -> tuple[list[float], list[float]]:
    """n requests split evenly over the rates, one step after another. Returns the send
    times and, per request, the rate of its step."""
    times, step_of = [], []
    per = [n // len(rates) + (1 if i < n % len(rates) else 0) for i in range(len(rates))]
    start = 0.0
    for i, (rate, k) in enumerate(zip(rates, per)):
        t = arrivals(k, rate, burstiness, seed + i, start)
        times += t
        step_of += [rate] * k
        start = (t[-1] if t else start) + 1.0 / rate
    return times, step_of
