"""capacity.fit: crossings of fitted margins, censored starts as bounds, bootstrap
intervals that widen with the bracket, the censored likelihood over starts, the gain."""
from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

from vllm_study.capacity.fit import (CENSORED_OFFSET, Bound, ConfigCapacity, StartCapacity, StepData, _StepSample,
                                     _start_interval, bounds_from_slo, combine, crossing, fit_start, gain)

TTFT = bounds_from_slo({"ttft_p90_ms": 1000})


def lm(*margins):
    """per-step log margins of one bound"""
    return np.log(np.array(margins))[:, None]


# -- crossings ---------------------------------------------------------------------------
def test_crossing_interpolates_log_margin_against_log_load():
    # log margin -0.2 at 1, +0.2 at 2: crosses halfway on the log scale, at sqrt(2)
    x = crossing([1, 2, 4], np.array([[-0.2], [0.2], [0.6]]))
    assert math.exp(x) == pytest.approx(math.sqrt(2), rel=1e-12)


def test_a_violation_is_pooled_into_one_knot_at_its_blocks_centre():
    # 0.3 at 2 then 0.1 at 4 violate monotonicity: pooled to 0.2 at the centre of log 2 and log 4
    x = crossing([1, 2, 4], np.array([[-0.2], [0.3], [0.1]]))
    assert math.exp(x) == pytest.approx(2 ** 0.75, rel=1e-12)
    # a heavier step pulls the block's value and centre toward it
    x = crossing([1, 2, 4], np.array([[-0.2], [0.3], [0.1]]), weights=[1, 1, 3])
    y_block, x_block = (0.3 + 3 * 0.1) / 4, (math.log(2) + 3 * math.log(4)) / 4
    assert x == pytest.approx(0.2 / (0.2 + y_block) * x_block, rel=1e-12)
    # two misses barely over the limit and out of order (a loaded machine's trace search:
    # margin 1.061 at 3.08 x, 1.012 at 4.76 x, 0.378 at 2 x) pool to a knot near 3.83 x, so
    # the fit crosses at 3.74 x, above the lower miss: the capacity is the fit's, its
    # interval (from the requests) what says how close to the miss it may be
    x = crossing([2, 3.0844, 4.7568], np.log([[0.3776], [1.0608], [1.0119]]))
    assert 3.0844 < math.exp(x) < 4.7568 and math.exp(x) == pytest.approx(3.744, abs=0.01)


def test_the_first_bound_to_cross_decides():
    m = np.column_stack([np.log([0.5, 0.8, 1.25]), np.log([0.9, 1.1, 1.3])])
    ttft_only = crossing([1, 2, 4], m[:, :1])
    itl_only = crossing([1, 2, 4], m[:, 1:])
    assert crossing([1, 2, 4], m) == min(ttft_only, itl_only) == itl_only


def test_a_plateau_at_the_limit_crosses_at_its_highest_load():
    assert math.exp(crossing([1, 2, 3, 4], lm(0.9, 1.0, 1.0, 1.3))) == pytest.approx(3)


def test_no_crossing_inside_the_loads_measured_is_infinite_not_zero():
    assert crossing([1, 2], lm(1.1, 1.4)) == -math.inf
    assert crossing([1, 2], lm(0.5, 1.0)) == math.inf


def test_steps_at_one_load_are_pooled_before_the_fit():
    # two rounds at 2: margins 0.9 and 1.3 (log mean ~ +0.04), crossing just below 2
    x = crossing([1, 2, 2, 4], lm(0.8, 0.9, 1.3, 1.5))
    y2 = (math.log(0.9) + math.log(1.3)) / 2
    lx = -math.log(0.8) / (y2 - math.log(0.8)) * math.log(2)
    assert x == pytest.approx(lx, rel=1e-12)


@pytest.mark.parametrize("q", [0.01, 0.5, 0.9, 0.99, 0.999])
@pytest.mark.parametrize("n, most_gaps, decimals", [(25, 30, 6), (200, 120, 0)])
def test_resampled_quantiles_are_the_kits_percentiles(q, n, most_gaps, decimals):
    """The counts-based quantile equals np.percentile over the pooled values of the same
    requests drawn with repetition, per-request values and per-request gap arrays alike:
    with ties (values rounded), requests without a gap, and pooled values many times the
    requests (the rank is then found in stretches, _Pooled)."""
    rng = np.random.default_rng(3)
    gaps = [np.round(rng.lognormal(3, 0.5, rng.integers(0, most_gaps)), decimals) for _ in range(n)]
    ttft = np.round(rng.lognormal(6, 0.4, n), decimals)
    b = [Bound(name="a", quantile=q, limit=1), Bound(name="b", quantile=q, limit=1)]
    s = _StepSample(StepData(load=1, latencies={"a": ttft, "b": gaps}), b)
    assert n == 25 or len(s.sorted[1].marks) > 10  # many stretches
    idx = rng.integers(0, n, (40, n))
    counts = np.stack([np.bincount(i, minlength=n) for i in idx])
    got = s.quantiles(counts, b)
    for r, i in enumerate(idx):
        assert got[r, 0] == pytest.approx(np.percentile(ttft[i], 100 * q), rel=1e-12)
        assert got[r, 1] == pytest.approx(np.percentile(np.concatenate([gaps[j] for j in i]), 100 * q), rel=1e-12)


# -- one start ---------------------------------------------------------------------------
def step(load: float, margin: float, n: int = 40, seed: int = 0, spread: float = 0.02) -> StepData:
    """A step whose TTFT P90 is exactly margin * 1000 ms, its requests spread about it."""
    v = np.exp(spread * np.random.default_rng(seed).standard_normal(n))
    v *= margin * 1000 / np.percentile(v, 90)
    return StepData(load=load, latencies={"ttft_p90_ms": v})


def test_a_start_that_missed_at_its_lowest_load_is_a_bound_never_zero():
    s = fit_start([step(4, 1.6), step(2, 1.3), step(1, 1.05)], TTFT, n_resamples=99)
    assert s.kind == "below" and s.value == 1.0 and str(s) == "below 1"
    # a failed lowest step (no latencies) is a miss as well
    s = fit_start([step(4, 1.6), StepData(load=0.5, failed=True)], TTFT, n_resamples=99)
    assert s.kind == "below" and s.value == 0.5
    c = combine([s, fit_start([step(4, 1.6), step(1, 1.2)], TTFT, n_resamples=99)])
    assert c.kind == "below" and c.value == 1.0 and c.censored == 2


def test_a_start_that_met_at_its_highest_load_is_at_least_that():
    s = fit_start([step(4, 0.97), step(2, 0.6)], TTFT, n_resamples=99)
    assert s.kind == "at_least" and s.value == 4 and str(s) == "at least 4"


def test_a_resolved_start_has_its_crossing_bracket_and_interval():
    steps = [step(4, 1.5, seed=1), step(2, 1.05, seed=2), step(1.41, 0.95, seed=3), step(1, 0.8, seed=4)]
    s = fit_start(steps, TTFT, n_resamples=999, seed=5)
    exact = math.exp(math.log(1.41) + math.log(1 / 0.95) / math.log(1.05 / 0.95) * math.log(2 / 1.41))
    assert s.kind == "value" and s.value == pytest.approx(exact, rel=1e-9)
    assert s.bracket == (1.41, 2)
    # the bootstrap's interval sits well inside this bracket: monotonicity alone bounds the
    # capacity by the bracket's ends, and the interval reaches them (fit.within_bracket)
    assert (s.low, s.high) == (1.41, 2)
    assert 0 < 1.96 * s.log_se < math.log(2 / 1.41) / 2


@pytest.mark.parametrize("censored", [24, 25, 26])
def test_an_end_is_open_where_its_tail_of_resamples_has_no_crossing(censored):
    """999 resamples, `censored` of them below the lowest load (at its placeholder), the
    rest crossing at twice the lowest load: the 2.5% percentile interpolates between the
    two from 25 on, which is no capacity; the end is open there, whatever it lands on."""
    lo_x, hi_x, point = 0.0, math.log(8), math.log(2.2)
    dist = np.r_[np.full(censored, lo_x - CENSORED_OFFSET), np.full(999 - censored, math.log(2)),
                 [math.log(3)]][:999]
    ci = tuple(np.percentile(dist, [2.5, 97.5]))  # scipy's percentile method: linear, as here
    low, high, se, cens = _start_interval(point, dist, ci, lo_x, hi_x, 0.95)
    assert cens == pytest.approx(censored / 999)
    if censored < 25:
        assert low == pytest.approx(2)
    else:
        assert low is None
        assert se >= (point - lo_x) / stats.norm.ppf(0.975)  # no surer than the way to the lowest load


def test_a_start_open_on_one_side_weighs_no_more_than_its_distance_to_the_loads_edge():
    """combine weighs resolved starts by their log_se: one whose interval runs past the
    lowest load is at least that uncertain, not as sure as its closed side alone says."""
    lo_x, hi_x, point = math.log(1), math.log(4), math.log(1.3)
    dist = np.r_[np.full(100, lo_x - CENSORED_OFFSET), np.full(899, point)]
    ci = tuple(np.percentile(dist, [2.5, 97.5]))
    low, high, se, _ = _start_interval(point, dist, ci, lo_x, hi_x, 0.95)
    assert low is None and high == pytest.approx(1.3)
    assert se == pytest.approx((point - lo_x) / stats.norm.ppf(0.975))


def test_a_wider_bracket_gives_a_wider_interval():
    """Identical requests at each step, the failing step further away: the bootstrap's
    resamples are the same, so each crossing lies at the same fraction of its bracket and
    the interval widens with the bracket (on the log scale, in its proportion)."""
    def at(hi):
        steps = [step(1, 0.8, seed=1), step(2, 0.97, seed=2), step(hi, 1.04, seed=3), step(6, 1.5, seed=4)]
        return fit_start(steps, TTFT, n_resamples=499, seed=9)
    narrow, wide = at(2.2), at(3.0)
    assert narrow.bracket == (2, 2.2) and wide.bracket == (2, 3.0)
    w_narrow, w_wide = math.log(narrow.high / narrow.low), math.log(wide.high / wide.low)
    assert w_wide > w_narrow
    assert w_wide / w_narrow == pytest.approx(math.log(1.5) / math.log(1.1), rel=1e-6)


def test_bad_steps_are_named():
    with pytest.raises(ValueError, match="no latencies for SLO bound ttft_p90_ms"):
        fit_start([StepData(load=1, latencies={"itl_p99_ms": np.ones(5)})], TTFT)
    with pytest.raises(ValueError, match="positive numbers"):
        fit_start([StepData(load=0, latencies={"ttft_p90_ms": np.ones(5)})], TTFT)
    with pytest.raises(ValueError, match="ttft_p90_ms or itl_p99_ms"):
        bounds_from_slo({"goodput": 3})
    with pytest.raises(ValueError, match="at least 2"):
        fit_start([StepData(load=1, latencies={"ttft_p90_ms": np.ones(1)})], TTFT)


# -- over starts -------------------------------------------------------------------------
def resolved(v: float, se: float = 0.0) -> StartCapacity:
    """A start of a refined search: its bracket within 0.1%, so the likelihood alone decides."""
    return StartCapacity(kind="value", value=v, low=v * math.exp(-1.96 * se), high=v * math.exp(1.96 * se),
                         bracket=(v / 1.001, v * 1.001), lowest=0.125, highest=4, log_se=se)


def test_a_start_fitted_from_margins_alone_weighs_as_the_median_start_not_as_exact():
    """A start fitted from its rounds' recorded margins (no requests: no bootstrap, no
    log_se) among bootstrapped ones takes their median se: it pulls the capacity as much
    as a start that uncertain would, not as much as an exact one."""
    margins_only = StartCapacity(kind="value", value=1.2, bracket=(1.1, 1.3), lowest=0.125, highest=4)
    others = [resolved(2.0, 0.2), resolved(2.2, 0.3), resolved(2.4, 0.2)]
    mixed = combine(others + [margins_only])
    as_median = combine(others + [resolved(1.2, 0.2)])
    as_exact = combine(others + [resolved(1.2, 0.0)])
    assert mixed.value == pytest.approx(as_median.value) and mixed.low == pytest.approx(as_median.low)
    assert mixed.value != pytest.approx(as_exact.value, rel=1e-3)


def test_without_censoring_or_within_start_noise_the_interval_is_the_t_interval():
    vals = [1.8, 2.0, 2.1, 1.7]
    c = combine([resolved(v) for v in vals])
    y = np.log(vals)
    h = stats.t.ppf(0.975, 3) * y.std(ddof=1) / 2
    assert math.log(c.value) == pytest.approx(y.mean(), abs=1e-5)
    assert math.log(c.low) == pytest.approx(y.mean() - h, abs=1e-4)
    assert math.log(c.high) == pytest.approx(y.mean() + h, abs=1e-4)
    assert c.spread == pytest.approx(y.std(ddof=0), rel=1e-3)


def test_censored_starts_enter_as_bounds():
    vals = [1.0, 1.1, 0.95]
    base = combine([resolved(v, 0.03) for v in vals])
    below = StartCapacity(kind="below", value=0.9, lowest=0.9, highest=4)
    with_below = combine([resolved(v, 0.03) for v in vals] + [below])
    assert with_below.kind == "value" and with_below.censored == 1 and with_below.starts == 4
    # a start below 0.9 pulls the estimate down, but not to 0: it says only "< 0.9"
    assert 0.85 < with_below.value < base.value
    assert with_below.low > 0.5
    above = StartCapacity(kind="at_least", value=1.2, lowest=0.9, highest=1.2)
    assert combine([resolved(v, 0.03) for v in vals] + [above]).value > base.value
    # the likelihood's maximum: a censored start adds its normal CDF term
    mu, sd = math.log(with_below.value), with_below.spread

    def ll(m, s):
        t = math.hypot(s, 0.03)
        return stats.norm.logpdf(np.log(vals), m, t).sum() + stats.norm.logcdf(math.log(0.9), m, t)
    assert ll(mu, sd) >= max(ll(mu + d, sd * f) for d in (-0.01, 0.01) for f in (0.9, 1.1))


def test_one_start_says_its_spread_was_not_measured():
    c = combine([resolved(2.0, 0.02)])
    assert not c.spread_measured and c.value == 2.0 and c.low < 2.0 < c.high


def test_a_given_spread_fixes_sigma():
    c = combine([resolved(2.0, 0.0), resolved(2.2, 0.0)], spread=0.05)
    h = 1.96 * 0.05 / math.sqrt(2)
    assert math.log(c.high / c.low) / 2 == pytest.approx(h, rel=1e-3)


def test_a_spread_pooled_on_few_degrees_of_freedom_gives_the_pooled_t_interval():
    starts = [resolved(2.0, 0.0), resolved(2.2, 0.0)]
    known = combine(starts, spread=0.05)
    pooled = combine(starts, spread=0.05, spread_df=2)
    h = stats.t.ppf(0.975, 2) * 0.05 / math.sqrt(2)
    assert math.log(pooled.high / pooled.low) / 2 == pytest.approx(h, rel=1e-3)
    assert pooled.low < known.low and pooled.high > known.high and pooled.value == pytest.approx(known.value)


# -- the gain ----------------------------------------------------------------------------
def test_a_gain_whose_baseline_interval_runs_below_the_loads_measured_says_its_end_is_not_bounded():
    best = ConfigCapacity(kind="value", value=4.84, low=3.24, high=7.20, starts=2)
    runner_up = ConfigCapacity(kind="value", value=3.61, low=None, high=4.52, starts=2)
    g = gain(best, runner_up)
    assert g.high is None and not g.resolved
    assert str(g) == f"1.34x [{g.low:.2f}, not bounded]"
    assert best.half_width == pytest.approx(7.20 / 4.84 - 1) and runner_up.half_width is None


def test_the_gain_over_a_baseline_below_its_lowest_load_is_a_lower_bound():
    best = ConfigCapacity(kind="value", value=1.9, low=1.7, high=2.1, starts=3)
    defaults = ConfigCapacity(kind="below", value=0.9, starts=2, censored=2)
    g = gain(best, defaults)
    assert g.kind == "at_least" and g.value == pytest.approx(1.7 / 0.9) and g.resolved
    assert str(g) == "at least 1.89x"
    # the mirror: a baseline at least hi bounds the gain from above
    g = gain(best, ConfigCapacity(kind="at_least", value=4.0, starts=2, censored=2))
    assert g.kind == "at_most" and g.value == pytest.approx(2.1 / 4) and g.resolved
    # both bounds on one side say nothing
    assert gain(ConfigCapacity(kind="below", value=1.0), defaults).kind == "unresolved"


def test_the_gain_of_two_resolved_configs_is_a_ratio_with_its_interval():
    a = ConfigCapacity(kind="value", value=2.0, low=1.8, high=2.3, starts=3)
    b = ConfigCapacity(kind="value", value=1.0, low=0.9, high=1.1, starts=3)
    g = gain(a, b)
    assert g.value == pytest.approx(2.0)
    assert math.log(g.value / g.low) == pytest.approx(math.hypot(math.log(2 / 1.8), math.log(1.1)))
    assert math.log(g.high / g.value) == pytest.approx(math.hypot(math.log(2.3 / 2), math.log(1 / 0.9)))
    assert g.resolved
    assert not gain(a, ConfigCapacity(kind="value", value=1.9, low=1.6, high=2.2)).resolved


# -- a convex margin curve, a coarse bracket, against a fixed-speed ladder -----------------
def convex_margin(x: float, cap: float = 3.65) -> float:
    """TTFT P90 over its limit at load x, a queue's curve: 0.632 + 0.287 / (4.43 - x) for a
    capacity of 3.65 (0.75 at 2x, 1 at 3.65x, 1.3 at 4x: the margins azure_code's
    starts had on the CPU), saturated (10) past 4.43x; other capacities scale the load."""
    u = x * 3.65 / cap
    return 0.632 + 0.287 / (4.43 - u) if u < 4.4 else 10.0


def _convex_start(cap: float, seed: int, *, lo=1.0, hi=16.0, precision=0.05, max_steps=4):
    """One start searched as the kit's bracket searches (capacity.bracket.Bracket) over a
    known convex curve, a queue's (convex_margin), 40 requests a step about its level."""
    from vllm_study.capacity.bracket import Bracket, Step
    rng = np.random.default_rng(seed)
    steps = []

    def measure(x):
        level = 1000 * convex_margin(x, cap)
        ttft = level * np.exp(0.03 * (rng.standard_normal(40) - 1.2816))
        steps.append(StepData(load=x, latencies={"ttft_p90_ms": ttft}))
        return Step(x, bool(np.percentile(ttft, 90) <= 1000), "")
    Bracket("speed", lo, hi, precision, max_steps, probe="lo").run(measure)
    return fit_start(steps, TTFT, n_resamples=499, seed=seed)


def test_a_coarse_bracket_on_a_convex_curve_holds_what_a_fixed_speed_ladder_finds():
    """Three starts of a config whose capacity is 3.65x, searched over [1, 16] in 4 steps
        from lo (1, 16, 4, 2): each brackets [2, 4], where a straight line across the convex
    curve crosses near 2.9x.
    Fixed-speed rounds of the same curve pass up to 3.5x and fail from 3.8x; the interval
    holds that ladder's answer (the bracket's ends bound it) and its value stays the fit's."""
    cap = 3.65
    starts = [_convex_start(cap, seed) for seed in (1, 2, 3)]
    assert all(s.bracket == (2.0, 4.0) for s in starts)
    assert all(s.value < 3.0 for s in starts)          # the interpolation's error, not noise
    ladder = {x: convex_margin(x, cap) <= 1 for x in (2.0, 2.7, 3.5, 3.8, 4.0)}
    passed, failed = max(x for x, ok in ladder.items() if ok), min(x for x, ok in ladder.items() if not ok)
    assert (passed, failed) == (3.5, 3.8)
    c = combine(starts)
    assert c.low <= passed and failed <= c.high, str(c)
    assert c.value < 3.0


def test_a_refined_bracket_is_not_widened():
    """The same curve searched to precision 0.02 with steps enough: the bracket is narrower
    than the bootstrap's interval, and the interval is the bootstrap's alone."""
    s = _convex_start(3.65, 4, lo=1.0, hi=16.0, precision=0.02, max_steps=12)
    a, b = s.bracket
    assert b / a - 1 <= 0.02
    assert s.low < a and b < s.high
    assert s.low <= 3.65 <= s.high
