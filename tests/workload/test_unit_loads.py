"""Arrival processes: seeded, at the asked rate, burstiness as vllm bench serve defines it."""
from __future__ import annotations

import numpy as np
import pytest

from vllm_study.workload import loads


def test_poisson_arrivals_have_the_rate_and_replay():
    t = loads.arrivals(4000, rate=20.0, burstiness=1.0, seed=7)
    assert t[0] == 0.0 and all(b >= a for a, b in zip(t, t[1:]))
    gaps = np.diff(t)
    assert gaps.mean() == pytest.approx(1 / 20.0, rel=1e-9)  # exactly the rate, as vllm bench
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.1)  # exponential: CV 1
    assert t == loads.arrivals(4000, rate=20.0, burstiness=1.0, seed=7)
    assert t != loads.arrivals(4000, rate=20.0, burstiness=1.0, seed=8)


def test_small_rounds_hit_the_rate_too():
    # Unscaled, 30 exponential gaps miss the rate by ~18% (1/sqrt(n)); vllm bench rescales too.
    for seed in range(20):
        t = loads.arrivals(31, rate=8.0, burstiness=1.0, seed=seed, start_s=2.0)
        assert t[0] == 2.0 and t[-1] == pytest.approx(2.0 + 30 / 8.0)
    assert loads.arrivals(1, rate=8.0, burstiness=1.0, seed=0) == [0.0]
    assert loads.arrivals(0, rate=8.0, burstiness=1.0, seed=0) == []


def test_burstiness_changes_the_spread_not_the_rate():
    bursty = np.diff(loads.arrivals(4000, rate=10.0, burstiness=0.25, seed=1))
    smooth = np.diff(loads.arrivals(4000, rate=10.0, burstiness=4.0, seed=1))
    assert bursty.mean() == pytest.approx(0.1, rel=1e-9) and smooth.mean() == pytest.approx(0.1, rel=1e-9)
    assert bursty.std() / bursty.mean() == pytest.approx(2.0, rel=0.15)   # CV = 1/sqrt(shape)
    assert smooth.std() / smooth.mean() == pytest.approx(0.5, rel=0.1)


def test_ladder_steps_follow_each_other_at_their_rates():
    times, step = loads.ladder(301, rates=[10.0, 20.0, 30.0], burstiness=1.0, seed=3)
    assert len(times) == len(step) == 301
    assert [step.count(r) for r in (10.0, 20.0, 30.0)] == [101, 100, 100]
    assert all(b >= a for a, b in zip(times, times[1:]))  # steps do not overlap
    for rate in (10.0, 20.0, 30.0):
        ts = [t for t, s in zip(times, step) if s == rate]
        assert np.diff(ts).mean() == pytest.approx(1 / rate, rel=1e-9)
