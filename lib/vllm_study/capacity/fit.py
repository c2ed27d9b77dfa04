"""Capacity from margins: how far each search step was from each SLO bound, fitted over
the start's steps, with its interval; censored starts as bounds, never 0; the
capacity of a config over its starts; the gain of one config over another.

How the kit calls it (self-contained: numpy, scipy and pydantic only):

    bounds = bounds_from_slo({"ttft_p90_ms": 5000, "itl_p99_ms": 150})
    steps = [StepData(load=1.51, latencies={"ttft_p90_ms": ttft_ms,      # one value per request
                                            "itl_p99_ms": gaps_ms}),     # a gap array per request
             ...]                                                        # every step of one start
    start = fit_start(steps, bounds, seed=0)        # StartCapacity: a value, "below L" or "at least H"
    config = combine([start_1, start_2, ...])       # ConfigCapacity over the config's starts
    g = gain(config, baseline_config)               # Gain: a ratio, "at least", "at most"

A step's loads are in the search's unit (a trace's speed, req/s or requests in flight);
its latencies per bound are the measured values of the step's requests (TTFT: one per
request; ITL: each request's token gaps, pooled as the round pools them). A step that
failed (errors, a dead server) is StepData(load=..., failed=True): a miss.

Everything is on a log scale: loads and latencies scale multiplicatively, so a margin
of 1.05 and a 5% load step mean the same thing at every load.
"""
from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
from pydantic import BaseModel, Field
from scipy import optimize, stats

# A failed step has no latencies to take a margin of: it enters the fit as a clear miss
# (margin 10 in every bound), so the fitted crossing stays below it.
FAILED_LOG_MARGIN = math.log(10.0)
# A censored bootstrap resample has no crossing: it enters the resamples as a value this far
# (in log load) beyond the measured loads, so it sorts below / above every resolved crossing;
# an interval end that lands out there is reported as a bound (None), never as a number.
CENSORED_OFFSET = 10.0


# -- inputs --------------------------------------------------------------------------------
class Bound(BaseModel):
    name: str                               # ttft_p90_ms: the latencies' key in StepData
    quantile: float = Field(gt=0, lt=1)     # 0.9
    limit: float = Field(gt=0)              # 5000 (ms)


def bounds_from_slo(slo: dict[str, float]) -> list[Bound]:
    """{"ttft_p90_ms": 5000} -> [Bound(ttft_p90_ms, 0.9, 5000)]: a percentile bound per key."""
    out = []
    for name, limit in slo.items():
        m = re.fullmatch(r"[a-z_]+?_p(\d+(?:\.\d+)?)_ms", name)
        if not m:
            raise ValueError(f"SLO bound {name!r}: a margin needs a percentile bound named like "
                             f"ttft_p90_ms or itl_p99_ms")
        out.append(Bound(name=name, quantile=float(m.group(1)) / 100, limit=limit))
    return out


@dataclass
class StepData:
    load: float
    latencies: dict[str, np.ndarray | Sequence[np.ndarray]] = field(default_factory=dict)
    failed: bool = False


# -- the fit -------------------------------------------------------------------------------
def _cir(logx: np.ndarray, w: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Centred isotonic regression (Oron & Flournoy 2017, as dose-finding designs use it):
    the weighted non-decreasing fit of y on x (steps sorted by load, equal loads pooled
    first), then each block the fit pooled into one value becomes one knot at its weighted
    mean load. A plain isotonic fit is a staircase whose flat treads put the crossing at
    a tread's edge; the knots at block centres interpolate through them instead. Called
    only where y is not monotone already (a monotone y is its own fit)."""
    r = optimize.isotonic_regression(y, weights=w, increasing=True)
    b = r.blocks
    cx = np.add.reduceat(logx * w, b[:-1]) / np.add.reduceat(w, b[:-1])
    return cx, r.x[b[:-1]]


def _bound_crossing(cx: np.ndarray, cy: np.ndarray) -> float:
    """Log load where one bound's fitted log margin crosses 0 (margin 1): -inf when it is
    above 0 at the lowest load, +inf when at or below 0 at the highest. The curve is
    linear between knots and flat beyond the outer ones. A step meets a bound at margin
    <= 1 (the kit's judge), so the crossing is the highest load whose fit is <= 0: a
    plateau at exactly 0 crosses at its high end."""
    if cy[0] > 0:
        return -math.inf
    if cy[-1] <= 0:
        return math.inf
    j = int(np.argmax(cy > 0))
    i = j - 1
    return float(cx[i] + (0 - cy[i]) / (cy[j] - cy[i]) * (cx[j] - cx[i]))


def crossing(loads: Sequence[float], log_margins: np.ndarray, weights: Sequence[float] | None = None) -> float:
    """The log load where the fitted margin (the max over bounds of each bound's monotone
    fit) crosses 1, from per-step log margins (steps x bounds). -inf: above 1 already at
    the lowest load; +inf: at or below 1 at the highest. Each bound's fit is
    non-decreasing, so the max over bounds first crosses 1 where the earliest bound does."""
    logx = np.log(np.asarray(loads, float))
    w = np.ones(len(logx)) if weights is None else np.asarray(weights, float)
    pool = _Pool(logx, w)
    return float(pool.crossings(np.asarray(log_margins, float).reshape(1, len(logx), -1))[0])


class _Pool:
    """Steps sorted by load, those measured at one load pooled into one (their weighted
    mean log margin): the isotonic fit takes a sequence, and two steps at one load have no
    order. Built once per start; every bootstrap resample reuses it."""

    def __init__(self, logx: np.ndarray, w: np.ndarray):
        self.x, inv = np.unique(logx, return_inverse=True)
        self.w = np.bincount(inv, weights=w)
        self.matrix = np.zeros((len(self.x), len(logx)))     # pooled = matrix @ steps
        self.matrix[inv, np.arange(len(logx))] = w / self.w[inv]

    def crossings(self, log_margins: np.ndarray) -> np.ndarray:
        """resamples x steps x bounds -> each resample's crossing (log load, or -inf / +inf)."""
        y = np.einsum("us,rsb->rub", self.matrix, log_margins)
        out = np.full(y.shape[0], np.inf)
        for b in range(y.shape[2]):
            yb = y[:, :, b]
            mono = np.all(np.diff(yb, axis=1) >= 0, axis=1)
            cb = np.empty(len(yb))
            cb[mono] = _monotone_crossings(self.x, yb[mono])
            for r in np.flatnonzero(~mono):   # the isotonic fit, one resample at a time (scipy's takes one)
                cb[r] = _bound_crossing(*_cir(self.x, self.w, yb[r]))
            out = np.minimum(out, cb)
        return out


def _monotone_crossings(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """_bound_crossing for many curves that are non-decreasing already (their own fit)."""
    out = np.full(len(y), np.inf)
    out[y[:, 0] > 0] = -np.inf
    mid = (y[:, 0] <= 0) & (y[:, -1] > 0)
    if mid.any():
        ym = y[mid]
        j = np.argmax(ym > 0, axis=1)
        r = np.arange(len(ym))
        y0, y1 = ym[r, j - 1], ym[r, j]
        out[mid] = x[j - 1] + (0 - y0) / (y1 - y0) * (x[j] - x[j - 1])
    return out


class _Pooled:
    """One bound's pooled values, sorted, with their requests, and where the rank of any
    resample's quantile lies: a resample is a count per request, and the value at rank t
    of the pooled values repeated that often is the first sorted value whose running count
    exceeds t. A running count over all N values for each of 999 resamples (N is every
    token gap of a step: 10^5 and more) takes seconds per step and gigabytes, so it is
    taken in two passes: counts @ `before` (a matrix product) gives the running count at
    `marks`, K evenly spaced positions, which bracket each resample's rank; then the
    running count within the one bracketed stretch of N/K values. Exact: the counts are
    small integers, which a float64 product sums without rounding."""

    def __init__(self, vals: np.ndarray, owner: np.ndarray, n: int):
        self.vals, self.owner = vals, owner
        N = len(vals)
        # a stretch costs a gather per resample and value, a mark a multiply-add per
        # resample and request (about 30 times cheaper): K balances the two
        K = int(np.clip(round(math.sqrt(30 * N / max(n, 1))), 1, N))
        self.marks = np.unique(np.linspace(0, N, K + 1).round().astype(int))
        # before[j, i]: request j's values at sorted positions below marks[i]
        per_stretch = [np.bincount(owner[a:b], minlength=n) for a, b in zip(self.marks[:-1], self.marks[1:])]
        self.before = np.concatenate([np.zeros((n, 1)), np.cumsum(np.stack(per_stretch, 1), axis=1)], axis=1)
        self.width = int(np.diff(self.marks).max())

    def index(self, counts: np.ndarray, at_marks: np.ndarray, t: np.ndarray) -> np.ndarray:
        """Per resample, how many sorted positions have a running count <= t (the position
        of the value at rank t), at most N - 1."""
        N, r, last = len(self.vals), np.arange(len(t)), len(self.marks) - 2
        s = np.minimum((at_marks[:, 1:] <= t[:, None]).sum(axis=1), last)  # the stretch where the count passes t
        start, end = self.marks[s], self.marks[s + 1]
        pos = start[:, None] + np.arange(self.width)
        ok = pos < end[:, None]
        run = at_marks[r, s][:, None] + np.cumsum(counts[r[:, None], self.owner[np.minimum(pos, N - 1)]] * ok, axis=1)
        return np.minimum(start + ((run <= t[:, None]) & ok).sum(axis=1), N - 1)


class _StepSample:
    """One step's latencies per bound, sorted once, so the quantile of any resample of its
    requests is a cumulative count: no copy of the latencies per resample."""

    def __init__(self, step: StepData, bounds: list[Bound]):
        self.failed = step.failed
        self.n = 0
        self.sorted: list[_Pooled] = []   # per bound
        if step.failed:
            return
        pooled = []
        for b in bounds:
            if b.name not in step.latencies:
                raise ValueError(f"step at load {step.load:g} has no latencies for SLO bound {b.name}: "
                                 f"give StepData.latencies[{b.name!r}] (its requests' values) or failed=True")
            vals, owner, n = _flatten(step.latencies[b.name], f"{b.name} at load {step.load:g}")
            if self.n and n != self.n:
                raise ValueError(f"step at load {step.load:g}: {b.name} has {n} requests, another bound "
                                 f"{self.n}; every bound's latencies come from the step's same requests")
            self.n = n
            o = np.argsort(vals, kind="stable")
            pooled.append((vals[o], owner[o]))
        self.sorted = [_Pooled(v, o, self.n) for v, o in pooled]
        if self.n < 2:
            raise ValueError(f"step at load {step.load:g} has {self.n} request(s) with latencies: a "
                             f"margin's interval needs at least 2 (a step with none answered is failed=True)")

    def quantiles(self, counts: np.ndarray, bounds: list[Bound]) -> np.ndarray:
        """Each bound's quantile over requests drawn `counts` times (resamples x requests),
        as np.percentile's default (linear) computes it over the pooled values."""
        out = np.empty((counts.shape[0], len(bounds)))
        as_float = counts.astype(float)
        for k, (pooled, b) in enumerate(zip(self.sorted, bounds)):
            at_marks = as_float @ pooled.before                # pooled values below each mark
            h = (at_marks[:, -1] - 1) * b.quantile
            lo = np.floor(h)
            i0 = pooled.index(counts, at_marks, lo)            # the value at rank floor(h)
            i1 = pooled.index(counts, at_marks, lo + 1)        # at rank floor(h) + 1
            out[:, k] = pooled.vals[i0] + (h - lo) * (pooled.vals[i1] - pooled.vals[i0])
        return out


def _flatten(v, what: str) -> tuple[np.ndarray, np.ndarray, int]:
    """Per-request values (one each, or an array each) -> pooled values, their request, and
    the number of requests (one with an empty array, e.g. no token gaps, still counts)."""
    if isinstance(v, np.ndarray) and v.dtype != object:
        if v.ndim != 1:
            raise ValueError(f"{what}: one value per request (1-D), or one array per request; got shape {v.shape}")
        vals, owner = v.astype(float), np.arange(len(v))
        parts = v
    else:
        parts = [np.atleast_1d(np.asarray(p, float)) for p in v]
        vals = np.concatenate(parts) if parts else np.zeros(0)
        owner = np.repeat(np.arange(len(parts)), [len(p) for p in parts])
    if not np.all(np.isfinite(vals)) or np.any(vals <= 0):
        raise ValueError(f"{what}: latencies must be positive and finite (ms); drop failed requests "
                         f"or mark the step failed=True")
    return vals, owner, len(parts)


# -- one start -----------------------------------------------------------------------------
class StartCapacity(BaseModel):
    """One start's capacity: a value with its 95% interval and bracket, or a bound."""
    kind: Literal["value", "below", "at_least"]
    value: float            # the crossing; for "below" the lowest load measured, for "at_least" the highest
    low: float | None = None    # 95% interval; None: beyond the loads measured (the end is a bound)
    high: float | None = None
    bracket: tuple[float, float] | None = None   # loads measured either side of the crossing (fitted met, missed)
    lowest: float               # the loads measured
    highest: float
    log_se: float | None = None     # the bootstrap's spread of log capacity (within this start)
    censored_resamples: float = 0.0  # share of resamples with no crossing
    interpolated: bool = True   # the value interpolates between the bracket's steps (False: the
    #                             highest load that met, a record with no margins to fit)

    def __str__(self) -> str:
        if self.kind == "below":
            return f"below {self.value:.3g}"
        if self.kind == "at_least":
            return f"at least {self.value:.3g}"
        lo = f"{self.low:.3g}" if self.low is not None else f"<{self.lowest:.3g}"
        hi = f"{self.high:.3g}" if self.high is not None else f">{self.highest:.3g}"
        return f"{self.value:.3g} [{lo}, {hi}]"


def fit_start(steps: Sequence[StepData], bounds: list[Bound], *, n_resamples: int = 999,
              confidence: float = 0.95, seed: int | None = 0) -> StartCapacity:
    """A start's capacity from all its steps (see crossing), with a percentile bootstrap
    interval: scipy.stats.bootstrap draws each step's requests again (one sample per step,
    paired=False: the steps are separate rounds), and each resample is refitted. Percentile,
    not BCa: BCa's jackknife refits once per request left out and its acceleration is
    undefined where resamples are censored."""
    if not steps:
        raise ValueError("fit_start needs the start's steps (at least one measured load)")
    if not bounds:
        raise ValueError("fit_start needs the SLO's bounds (bounds_from_slo({...}))")
    for s in steps:
        if not (s.load > 0 and math.isfinite(s.load)):
            raise ValueError(f"step load {s.load!r}: loads are positive numbers (the search's unit)")
    samples = [_StepSample(s, bounds) for s in steps]
    loads = np.array([s.load for s in steps], float)
    live = [k for k, s in enumerate(samples) if not s.failed]
    # a failed step weighs as much as the average measured step
    w_fail = float(np.mean([samples[k].n for k in live])) if live else 1.0
    weights = np.array([w_fail if s.failed else s.n for s in samples])
    limits = np.log([b.limit for b in bounds])

    def log_margins(counts_by_live: list[np.ndarray]) -> np.ndarray:
        """resamples x steps x bounds"""
        r = counts_by_live[0].shape[0] if counts_by_live else 1
        m = np.full((r, len(samples), len(bounds)), FAILED_LOG_MARGIN)
        for k, c in zip(live, counts_by_live):
            m[:, k, :] = np.log(samples[k].quantiles(c, bounds)) - limits
        return m

    pool = _Pool(np.log(loads), weights)
    point = float(pool.crossings(log_margins([np.ones((1, samples[k].n)) for k in live]))[0])
    lo_x, hi_x = math.log(loads.min()), math.log(loads.max())
    base = dict(lowest=float(loads.min()), highest=float(loads.max()))
    if point == -math.inf:
        return StartCapacity(kind="below", value=base["lowest"], **base)
    if point == math.inf:
        return StartCapacity(kind="at_least", value=base["highest"], **base)
    below, above = loads[np.log(loads) <= point], loads[np.log(loads) > point]
    bracket = (float(below.max()), float(above.min()))
    def statistic(*idx, axis=-1):
        idx = [np.asarray(i) for i in idx]
        if idx[0].ndim == 1:
            idx = [i[None, :] for i in idx]
        counts = []
        for k, i in zip(live, idx):
            n, r = samples[k].n, i.shape[0]
            rows = np.repeat(np.arange(r), i.shape[1])
            counts.append(np.bincount(rows * n + i.ravel().astype(int), minlength=r * n).reshape(r, n))
        out = pool.crossings(log_margins(counts))
        out[out == -math.inf] = lo_x - CENSORED_OFFSET
        out[out == math.inf] = hi_x + CENSORED_OFFSET
        return out

    data = tuple(np.arange(samples[k].n) for k in live)
    res = stats.bootstrap(data, statistic, n_resamples=n_resamples, vectorized=True, paired=False,
                          confidence_level=confidence, method="percentile", rng=seed)
    low, high, se, cens = _start_interval(point, res.bootstrap_distribution, res.confidence_interval,
                                          lo_x, hi_x, confidence)
    low, high = within_bracket(low, high, [bracket])
    return StartCapacity(kind="value", value=math.exp(point), low=low, high=high, bracket=bracket,
                         log_se=se, censored_resamples=cens, **base)


def _start_interval(point: float, dist: np.ndarray, ci: tuple[float, float], lo_x: float, hi_x: float,
                    confidence: float) -> tuple[float | None, float | None, float, float]:
    """A start's interval from its bootstrap (log load; a resample with no crossing inside
    the loads sits CENSORED_OFFSET beyond them): low, high (None where open), the log-scale
    standard error combine weighs it by, and the share of resamples censored.
    An end is open where its tail's share of resamples has no crossing inside the loads:
    the percentile there interpolates towards the placeholder, not towards a capacity.
    An open side's half-width reaches past the loads measured at least, so the start is
    no surer than that distance says."""
    below, above = float(np.mean(dist < lo_x - 1)), float(np.mean(dist > hi_x + 1))
    a, b = ci
    tail = (1 - confidence) / 2
    low = math.exp(a) if below < tail and a >= lo_x else None
    high = math.exp(b) if above < tail and b <= hi_x else None
    z = stats.norm.ppf(0.5 + confidence / 2)
    se = max(point - a if low else point - lo_x, b - point if high else hi_x - point) / z
    return low, high, se, below + above


def within_bracket(low: float | None, high: float | None,
                   brackets: Sequence[tuple[float, float]]) -> tuple[float | None, float | None]:
    """An interval widened to the (median) bracket: never narrower than what monotonicity
    alone allows. The crossing interpolates log margin linearly between the loads either
    side of it, and nothing measured says how the margin bends in between: a latency
    curve is convex in load (a queue's wait grows as 1 / (1 - utilisation)), so a straight
    line across a coarse bracket crosses 1 too early. On the CPU, azure_code's margins
    read 0.73-0.77 at 2x and 1.13-1.59 at 4x in three starts; the line gave 2.72x while
    fixed-speed rounds put the capacity in [3.5, 3.8]x, and a bootstrap over requests,
    which only moves the two margins, held none of that. A bend between two steps is
    where no fit through the steps can see it, so the interval reaches the bracket's
    ends, where monotonicity puts the capacity, rather than a modelled curvature; the
    search is not made to refine past `max_steps` instead, since that budget is the
    study's and records already measured must read honestly too. A search refined until
    its bracket is narrower than the bootstrap's interval (`capacity.precision` and
    enough `max_steps`) is not widened at all; one stopped coarse by its step budget
    says so by its width. Brackets of several starts: their medians bound the median
    start, the config's capacity (the order statistics of capacities each within its
    own bracket lie between those of the brackets' ends). An open end stays open."""
    if not brackets:
        return low, high
    a = float(np.median([b[0] for b in brackets]))
    b = float(np.median([b[1] for b in brackets]))
    return (None if low is None else min(low, a)), (None if high is None else max(high, b))


# -- over a config's starts ----------------------------------------------------------------
class ConfigCapacity(BaseModel):
    """A config's capacity over its starts: the median start's capacity exp(mu) with its
    95% interval, or a bound when no start was resolved."""
    kind: Literal["value", "below", "at_least", "unresolved"]
    value: float | None = None     # exp(mu); for "below" / "at_least" the bound
    low: float | None = None       # 95% interval; None: the end lies beyond every load measured
    high: float | None = None
    starts: int = 0
    censored: int = 0              # starts that entered as bounds
    spread: float | None = None    # start-to-start sigma of log capacity (fitted, or given)
    spread_measured: bool = True   # False: one start and no spread given (a value's interval is within-start only)
    bracket_bound: bool = False    # an end is its starts' bracket's (within_bracket): more starts do not narrow it

    @property
    def half_width(self) -> float | None:
        """The 95% interval's farther end from the value, as a fraction of it; None for a
        bound or an interval with an end beyond the loads measured."""
        if self.kind != "value" or self.low is None or self.high is None:
            return None
        return max(self.high / self.value - 1, 1 - self.low / self.value)

    def __str__(self) -> str:
        if self.kind == "below":
            return f"below {self.value:.3g}"
        if self.kind == "at_least":
            return f"at least {self.value:.3g}"
        if self.kind == "unresolved":
            return "unresolved (its starts disagree: some below the lowest load, some at or above the highest)"
        lo = f"{self.low:.3g}" if self.low is not None else "below the loads measured"
        hi = f"{self.high:.3g}" if self.high is not None else "above the loads measured"
        return f"{self.value:.3g} [{lo}, {hi}]"


def _loglik(mu: float, sigma: float, y, se, lo_c, lo_se, hi_c, hi_se) -> float:
    """log capacity of start i ~ Normal(mu, sigma^2 + se_i^2): a resolved start adds its
    density; a start below L adds P(capacity < L), one at least H adds P(capacity >= H)."""
    out = stats.norm.logpdf(y, mu, np.sqrt(sigma ** 2 + se ** 2)).sum()
    if len(lo_c):
        out += stats.norm.logcdf(lo_c, mu, np.sqrt(sigma ** 2 + lo_se ** 2)).sum()
    if len(hi_c):
        out += stats.norm.logsf(hi_c, mu, np.sqrt(sigma ** 2 + hi_se ** 2)).sum()
    return float(out)


def combine(starts: Sequence[StartCapacity], *, spread: float | None = None, spread_df: int | None = None,
            confidence: float = 0.95) -> ConfigCapacity:
    """The config's capacity from its starts by an interval-censored likelihood: log
    capacity of a start ~ Normal(mu, sigma^2 + se_i^2), sigma the start-to-start spread,
    se_i the start's own bootstrap spread (a start without one: the others' median); a
    start below L enters as P(< L), one at least H as P(>= H), each with the resolved
    starts' median se (where it lies in its bracket is unknown). mu and sigma by maximum
    likelihood (scipy.optimize); mu's interval by profile likelihood, its cut calibrated
    so that with no censoring and no se it is the t-interval on n - 1 df (the likelihood
    ratio is then n log(1 + T^2/(n-1)) exactly): two starts give a wide interval, as they
    should. `spread` (sigma pooled over the run's configs, say) fixes sigma: the cut is
    then t(spread_df)^2, the pooled t-interval's (a spread estimated on few degrees of
    freedom is itself uncertain), or chi2(1)'s where spread_df is None (a spread known
    from elsewhere)."""
    if not starts:
        raise ValueError("combine needs at least one start's capacity")
    n = len(starts)
    res = [s for s in starts if s.kind == "value"]
    below = [s for s in starts if s.kind == "below"]
    above = [s for s in starts if s.kind == "at_least"]
    measured = n > 1 or spread is not None
    if not res:
        if not above:
            return ConfigCapacity(kind="below", value=max(s.value for s in below), starts=n, censored=n,
                                  spread_measured=measured)
        if not below:
            return ConfigCapacity(kind="at_least", value=min(s.value for s in above), starts=n, censored=n,
                                  spread_measured=measured)
        return ConfigCapacity(kind="unresolved", starts=n, censored=n, spread_measured=measured)
    known = [s.log_se for s in res if s.log_se is not None]
    # the median start's se stands in where a resolved start has none (fitted from its
    # rounds' margins alone: no requests to resample), never 0 as if it were exact
    med_se = float(np.median(known)) if known else 0.0
    y = np.log([s.value for s in res])
    se = np.array([s.log_se if s.log_se is not None else med_se for s in res])
    lo_c = np.log([s.value for s in below])
    hi_c = np.log([s.value for s in above])
    args = (y, se, lo_c, np.full(len(lo_c), med_se), hi_c, np.full(len(hi_c), med_se))
    if not measured:    # one start: nothing measures the spread between starts
        s = res[0]
        return ConfigCapacity(kind="value", value=s.value, low=s.low, high=s.high, starts=1,
                              spread=None, spread_measured=False,
                              bracket_bound=bool(s.interpolated and s.bracket and (s.low, s.high) != (None, None)
                                                 and (s.low == s.bracket[0] or s.high == s.bracket[1])))

    floor_sigma = 1e-3   # 0.1%: starts that tie exactly still leave a finite likelihood

    def best_sigma(mu: float) -> tuple[float, float]:
        if spread is not None:
            return spread, _loglik(mu, spread, *args)
        r = optimize.minimize_scalar(lambda ls: -_loglik(mu, math.exp(ls), *args),
                                     bounds=(math.log(floor_sigma), math.log(3.0)), method="bounded")
        return math.exp(r.x), -r.fun

    all_x = np.concatenate([y, lo_c, hi_c])
    span = (float(all_x.min()) - 3.0, float(all_x.max()) + 3.0)
    r = optimize.minimize_scalar(lambda m: -best_sigma(m)[1], bounds=span, method="bounded",
                                 options={"xatol": 1e-6})
    mu, (sigma, lmax) = float(r.x), best_sigma(float(r.x))
    if spread is None:
        t = stats.t.ppf(0.5 + confidence / 2, n - 1)
        cut = n * math.log1p(t ** 2 / (n - 1))
    elif spread_df is not None:
        cut = stats.t.ppf(0.5 + confidence / 2, spread_df) ** 2
    else:
        cut = stats.chi2.ppf(confidence, 1)

    def excess(m: float) -> float:
        return 2 * (lmax - best_sigma(m)[1]) - cut

    ends = []
    for edge in span:
        ends.append(optimize.brentq(excess, edge, mu, xtol=1e-6) if excess(edge) > 0 else None)
    lowest = float(min(math.log(s.lowest) for s in starts))
    highest = float(max(math.log(s.highest) for s in starts))
    low = math.exp(ends[0]) if ends[0] is not None and ends[0] >= lowest else None
    high = math.exp(ends[1]) if ends[1] is not None and ends[1] <= highest else None
    # the likelihood's interval holds noise (requests, restarts); the interpolation's error is
    # the same in every start that brackets alike, so more starts do not shrink it
    likelihood = (low, high)
    low, high = within_bracket(low, high, [s.bracket for s in res if s.interpolated and s.bracket])
    return ConfigCapacity(kind="value", value=math.exp(mu), low=low, high=high, starts=n,
                          censored=len(below) + len(above), spread=sigma, bracket_bound=(low, high) != likelihood)


# -- a config against a baseline -----------------------------------------------------------
class Gain(BaseModel):
    """config / baseline capacity: a ratio with its 95% interval, or a bound."""
    kind: Literal["value", "at_least", "at_most", "unresolved"]
    value: float | None = None     # the ratio; for at_least / at_most the bound
    low: float | None = None       # None: no bound on that side
    high: float | None = None

    @property
    def resolved(self) -> bool:
        """The interval (or the bound) excludes 1: the config is told apart from the baseline."""
        if self.kind == "at_least":
            return self.value > 1
        if self.kind == "at_most":
            return self.value < 1
        if self.kind == "value":
            return (self.low is not None and self.low > 1) or (self.high is not None and self.high < 1)
        return False

    def __str__(self) -> str:
        if self.kind == "at_least":
            return f"at least {self.value:.2f}x"
        if self.kind == "at_most":
            return f"at most {self.value:.2f}x"
        if self.kind == "unresolved":
            return "unresolved (both are bounds on the same side)"
        # an end is None where a capacity's interval runs past the loads measured: the
        # ratio is not bounded on that side
        lo = f"{self.low:.2f}" if self.low is not None else "not bounded"
        hi = f"{self.high:.2f}" if self.high is not None else "not bounded"
        return f"{self.value:.2f}x [{lo}, {hi}]"


def _ends(c: ConfigCapacity) -> tuple[float | None, float | None]:
    """The lowest and highest the config's capacity can be, as far as it was measured."""
    if c.kind == "value":
        return c.low, c.high
    if c.kind == "below":
        return None, c.value
    if c.kind == "at_least":
        return c.value, None
    return None, None


def gain(config: ConfigCapacity, baseline: ConfigCapacity) -> Gain:
    """config / baseline. Both resolved: the ratio of the values, its interval combining
    the two configs' log-scale half-widths in quadrature (independent starts), each side
    with its own half (the intervals are not symmetric). A bound where either is
    censored: e.g. the baseline below L gives at least (config's low end) / L."""
    if config.kind == "value" and baseline.kind == "value":
        d = math.log(config.value / baseline.value)
        out = {}
        for side, (a, b) in {"low": (config.low, baseline.high), "high": (config.high, baseline.low)}.items():
            if a is None or b is None:
                out[side] = None
                continue
            h = math.hypot(math.log(config.value / a), math.log(b / baseline.value))
            out[side] = math.exp(d - h if side == "low" else d + h)
        if out["low"] is None and out["high"] is None:
            return Gain(kind="unresolved", value=math.exp(d))
        return Gain(kind="value", value=math.exp(d), **out)
    c_lo, c_hi = _ends(config)
    b_lo, b_hi = _ends(baseline)
    # one of them is a bound: the ratio is bounded on the side both ends are known
    if c_lo is not None and b_hi is not None and config.kind != "below" and baseline.kind != "at_least":
        return Gain(kind="at_least", value=c_lo / b_hi, low=c_lo / b_hi)
    if c_hi is not None and b_lo is not None and config.kind != "at_least" and baseline.kind != "below":
        return Gain(kind="at_most", value=c_hi / b_lo, high=c_hi / b_lo)
    return Gain(kind="unresolved")
