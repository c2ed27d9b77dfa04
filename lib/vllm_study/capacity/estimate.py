"""A point's capacity from its starts' steps: each start's steps turned into what
capacity.fit needs and fitted, the starts combined, and one point's gain over another.
Every capacity the report, compare, export, confirmation and the search state comes from
here (records/point_capacity.py reads a run folder into it), so a censored start is a
bound everywhere and never a 0.

Each start is judged by the best statistic its records allow (STATISTICS):
- "fit": its steps' requests were kept: each step's margin per SLO bound, fitted over the
  start's steps (capacity.fit.fit_start), with a bootstrap interval over the steps' requests;
- "margins": no requests, but every step's round recorded the bounds' figures: the same
  fit through those margins, with no within-start interval;
- "highest met": neither: the highest load that met the SLO (the bracket's record).
The starts are then combined by capacity.fit.combine (with none censored and no
within-start spread its interval is the t-interval over starts).
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import numpy as np

from ..vocab import metrics
from . import fit
from .bracket import CapacityRecord, bound_key, margins

STATISTICS = {
    "fit": "isotonic fit of each step's SLO margins, intervals by bootstrap over requests",
    "margins": "isotonic fit of each step's SLO margins as its round recorded them (its requests were not kept: "
               "no within-start interval)",
    "highest met": "the highest load that met the SLO (its steps recorded no SLO figures to fit)",
}
COMBINED = "starts combined by an interval-censored likelihood"
POOLED = "the start-to-start spread pooled over the run's points ({df} degrees of freedom)"
# Pooling from 2 df: two configs of two starts each (t = 4.30) already beat each one's own
# spread on 1 df (t = 12.7); on 1 df it would be one point's own spread lent to the rest.
POOL_MIN_DF = 2
# Resamples per start: 999 gives the 95% interval's ends to about a percent; a report over
# a run fits every start once (cached per start folder).
RESAMPLES = 999


@dataclass
class PointCapacity:
    """A point's capacity in the search's unit (`config`, its starts), its statistic, and
    the factor that turns a load into requests/s (None: the load fixes no rate)."""
    point: str
    config: fit.ConfigCapacity
    starts: list[fit.StartCapacity]
    statistics: list[str]            # per start: a key of STATISTICS
    rps_per_load: float | None
    pooled_df: int | None = None     # the start-to-start spread pooled over points on these df (None: its own)

    @property
    def statistic(self) -> str:
        """The sentence saying how this capacity was judged."""
        used = list(dict.fromkeys(self.statistics))
        return "; ".join(STATISTICS[k] + (f" ({self.statistics.count(k)} of {len(self.statistics)} starts)"
                                          if len(used) > 1 else "") for k in used) + f"; {COMBINED}" + \
            (f", {POOLED.format(df=self.pooled_df)}" if self.pooled_df else "")

    def rps(self, load: float | None) -> float | None:
        return None if load is None or self.rps_per_load is None else load * self.rps_per_load

    def cell(self, unit: str = "rps") -> str:
        """'5.39 [4.80, 6.05]', '< 0.77', '≥ 9.25', or 'unresolved ...': in req/s (where
        the load fixes a rate) or the search's own unit ("load")."""
        c = self.config
        f = (lambda v: f"{v:.2f}") if unit == "rps" and self.rps_per_load else (lambda v: f"{v:.3g}")  # noqa: E731
        scale = self.rps if unit == "rps" and self.rps_per_load else (lambda v: v)  # noqa: E731
        if c.kind == "below":
            return f"< {f(scale(c.value))}"
        if c.kind == "at_least":
            return f"≥ {f(scale(c.value))}"
        if c.kind == "unresolved":
            return "unresolved (some starts below the lowest load, some at or above the highest)"
        lo = f(scale(c.low)) if c.low is not None else f"< {f(scale(self.lowest))}"
        hi = f(scale(c.high)) if c.high is not None else f"> {f(scale(self.highest))}"
        return f"{f(scale(c.value))} [{lo}, {hi}]"

    @property
    def lowest(self) -> float:
        return min(s.lowest for s in self.starts)

    @property
    def highest(self) -> float:
        return max(s.highest for s in self.starts)

class StepRound(Protocol):
    """One round of a capacity step, as a run folder records it (records.results.RoundRecord)."""
    round: int
    status: str
    metrics: dict


def request_ms(r: dict, bound: str, sched: bool) -> np.ndarray | float | None:
    """One request's values for an SLO bound, in ms, as the round pools them: its TTFT
    (or E2E), from its scheduled arrival where the round judged from the schedule; its
    token gaps for ITL; its longest or mean gap for a per-request bound (stall_p90_ms); its TPOT."""
    figure = metrics.request_itl_figure(bound)
    if figure:
        return metrics.request_itl_ms(r.get("itl_s") or [], figure)
    lat = bound.split("_", 1)[0]
    lag = (r["send_time"] - r["due_time"]) if sched and r.get("due_time") is not None else 0.0
    if lat == "itl":
        return np.asarray(r.get("itl_s") or [], float) * 1000
    if lat == "tpot":
        n = r.get("output_tokens")
        return (r["e2e_s"] - r["ttft_s"]) / (n - 1) * 1000 if n and n > 1 else None
    v = r.get(f"{lat}_s")
    return None if v is None else (v + lag) * 1000


def step_from_requests(step: dict, reqs: list[dict], bounds: list[fit.Bound], values: dict) -> fit.StepData | None:
    """One step's requests as fit.StepData; a step with a failed request is a miss, as
    the round's verdict (bracket.meets_slo) makes it. None: a bound's values are missing."""
    if not reqs or any(r.get("error") for r in reqs):
        return fit.StepData(load=step["load"], failed=True)
    lat: dict[str, list] = {}
    for b in bounds:
        sched = bound_key(b.name, values) != b.name
        vals = [request_ms(r, b.name, sched) for r in reqs]
        if metrics.request_itl_figure(b.name):   # one value per request with a gap, none without
            vals = [np.zeros(0) if v is None else np.atleast_1d(v) for v in vals]
        if b.name.startswith("itl") or metrics.request_itl_figure(b.name):
            if sum(1 for v in vals if len(v)) < 2:
                return None
            lat[b.name] = vals
        else:
            if any(v is None for v in vals):
                return None
            lat[b.name] = np.asarray(vals, float)
    if any(np.any(np.concatenate([np.atleast_1d(x) for x in v] or [np.zeros(0)]) <= 0) for v in lat.values()):
        return None   # a zero latency has no log margin: the rounds' figures are used instead
    return fit.StepData(load=step["load"], latencies=lat)


def censored_start(rec: CapacityRecord, floor: float) -> fit.StartCapacity:
    loads = [s["load"] for s in rec.steps] or [floor]
    lowest, highest = min(loads), max(loads)
    if rec.censored == "below":
        return fit.StartCapacity(kind="below", value=rec.bracket[1] or lowest, lowest=lowest, highest=highest)
    return fit.StartCapacity(kind="at_least", value=rec.bracket[0], lowest=lowest, highest=highest)


def legacy_start(rec: CapacityRecord, floor: float) -> fit.StartCapacity:
    """The bracket's record as a start's capacity: the highest load that met, or a bound."""
    if rec.censored:
        return censored_start(rec, floor)
    loads = [s["load"] for s in rec.steps] or [rec.load]
    return fit.StartCapacity(kind="value", value=rec.load, bracket=(rec.bracket[0], rec.bracket[1]),
                             lowest=min(loads), highest=max(loads), interpolated=False)


def start_capacity(rec: CapacityRecord, per_step: Sequence[Sequence[StepRound]],
                   by_round: dict[int, list[dict]] | None, slo: dict[str, float], floor: float,
                   seed: int = 0) -> tuple[fit.StartCapacity, str]:
    """One start's capacity and the STATISTICS key it was judged by. `per_step`: each step's
    rounds (one, or with trace.windows one a window, their requests pooled as the step's
    verdict pooled them; a step with a failed round is a miss, as its verdict was);
    `by_round`: the start's requests by round, None where they were not kept."""
    legacy = legacy_start(rec, floor)
    try:
        bounds = fit.bounds_from_slo(slo)
    except ValueError:   # a bound with no percentile (a mean): nothing to fit a margin of
        return legacy, "highest met"
    if not rec.steps:
        return legacy, "highest met"
    if by_round is not None:
        steps = []
        for s, rs in zip(rec.steps, per_step):
            if not rs or any(r.status != "ok" for r in rs):
                steps.append(fit.StepData(load=s["load"], failed=True))
                continue
            reqs = [q for r in rs for q in by_round.get(r.round, [])]
            d = step_from_requests(s, reqs, bounds, rs[0].metrics)
            if d is None:
                break
            steps.append(d)
        else:
            if any(not d.failed for d in steps):
                return fit.fit_start(steps, bounds, n_resamples=RESAMPLES, seed=seed), "fit"
    # the rounds' own figures: one margin per bound and step, no resampling
    loads, rows = [], []
    for s, rs in zip(rec.steps, per_step):
        m = s.get("margins") or (margins(rs[0].metrics, slo) if rs else {})
        failed = not rs or any(r.status != "ok" or bool(r.metrics.get("failed")) or not r.metrics.get("completed")
                               for r in rs)
        if not failed and set(m) != set(slo):
            return legacy, "highest met"
        loads.append(s["load"])
        rows.append([fit.FAILED_LOG_MARGIN] * len(bounds) if failed else [math.log(m[b.name]) for b in bounds])
    x = fit.crossing(loads, np.array(rows))
    lowest, highest = min(loads), max(loads)
    if x == -math.inf:
        return fit.StartCapacity(kind="below", value=lowest, lowest=lowest, highest=highest), "margins"
    if x == math.inf:
        return fit.StartCapacity(kind="at_least", value=highest, lowest=lowest, highest=highest), "margins"
    below = [v for v in loads if math.log(v) <= x]
    above = [v for v in loads if math.log(v) > x]
    return fit.StartCapacity(kind="value", value=math.exp(x), bracket=(max(below), min(above)),
                             lowest=lowest, highest=highest), "margins"


class Spread(NamedTuple):
    """The start-to-start spread of log capacity over a run's points: `raw`, the resolved
    starts' sd about their point's mean, pooled on `df` degrees of freedom; `within`, the
    starts' own bootstrap sd (root mean square), which a restart that replays the same
    requests need not move; `corrected`, what the raw spread leaves beyond it (None where
    nothing is left: the starts differ no more than the bootstrap's noise)."""
    raw: float | None
    within: float | None
    df: int

    @property
    def corrected(self) -> float | None:
        if self.raw is None:
            return None
        var = self.raw ** 2 - (self.within or 0.0) ** 2
        return math.sqrt(var) if var > 0 else None


def start_spread(points: list[list[fit.StartCapacity]]) -> Spread:
    ss, df, within = 0.0, 0, []
    for caps in points:
        ys = [math.log(c.value) for c in caps if c.kind == "value"]
        if len(ys) >= 2:
            ss += float(np.sum((np.array(ys) - np.mean(ys)) ** 2))
            df += len(ys) - 1
            within += [c.log_se ** 2 for c in caps if c.kind == "value" and c.log_se is not None]
    return Spread(math.sqrt(ss / df) if df else None, math.sqrt(float(np.mean(within))) if within else None, df)


def pooled_spread(points: list[list[fit.StartCapacity]]) -> tuple[float, int] | None:
    """The start-to-start spread of log capacity pooled over points (as analysis pools a
    metric's start-to-start noise): the resolved starts' variance about their point's mean,
    less the starts' own bootstrap variance, on sum(n - 1) degrees of freedom (start_spread;
    floored at 0.1% where nothing is left). None below POOL_MIN_DF of them: each point's
    own starts then give its spread (a t-interval's width on n - 1 df). The intervals on it
    are pooled t-intervals (fit.combine's spread_df), as a two-sample t-test's on n1 + n2 - 2 df."""
    sp = start_spread(points)
    if sp.df < POOL_MIN_DF:
        return None
    return max(sp.corrected or 0.0, 1e-3), sp.df

def combine(per_point: dict[str, tuple[list[fit.StartCapacity], list[str], float | None]]
            ) -> dict[str, PointCapacity | None]:
    """Each point's capacity over its starts (point id -> the starts' capacities, their
    STATISTICS keys, requests/s per unit of load); None for a point with none. The
    start-to-start spread is pooled over the points (pooled_spread) where they measure it
    on POOL_MIN_DF degrees of freedom or more."""
    spread, df = pooled_spread([caps for caps, _, _ in per_point.values()]) or (None, None)
    return {pid: PointCapacity(pid, fit.combine(caps, spread=spread, spread_df=df), caps, stats_, per, df)
            if caps else None for pid, (caps, stats_, per) in per_point.items()}


def gain(point: PointCapacity, baseline: PointCapacity) -> fit.Gain:
    """point / baseline capacity (capacity.fit.gain): a ratio with its interval, a bound
    where either is censored. Both are in the same search's unit."""
    return fit.gain(point.config, baseline.config)


class Apart(NamedTuple):
    """a's gain over b, and which of the two measured no start-to-start spread (one start,
    nothing pooled: capacity.fit.combine)."""
    gain: fit.Gain
    unmeasured: list[str]

    @property
    def resolved(self) -> bool:
        """The gain's interval (or bound) excludes 1 and both spreads are measured: on one
        H200 a restart moved capacity by about 9%, which one start's interval cannot hold."""
        return self.gain.resolved and not self.unmeasured


def told_apart(a: PointCapacity, b: PointCapacity) -> Apart:
    """a's gain over b as the report, confirmation, compare and the recommendation judge it."""
    return Apart(gain(a, b), [pc.point for pc in (a, b) if not pc.config.spread_measured])


def one_start_words(points: list[str]) -> str:
    return f"{' and '.join(points)} {'has' if len(points) == 1 else 'have'} one start, so no start-to-start spread"
