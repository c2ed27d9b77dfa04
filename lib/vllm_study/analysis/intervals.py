"""Run-level statistics: each point's value with a 95% interval, comparisons between
points, which points cannot be told apart from the best, and the study's noise floor.

The model, per metric: a server start's value is the median of its rounds (on the metric's
scale: with two rounds on the log scale, their geometric mean); a point's
value is the mean of its starts' values; starts of a point scatter around it with a
spread that is common to the run's points (one-way random effects, pooled variance).
Latency and throughput noise is multiplicative (a restart moved TTFT P90 by +25-55% on
the H200), so metrics whose values are all positive are analysed on a log scale and
their intervals are ratios; others (counts that can be 0) on a linear scale.

Pooling the start-to-start spread over the run's points is what makes two starts per
point usable: a point's own two starts give one degree of freedom (t = 12.7), a 12-point
grid gives twelve. A bootstrap over starts was tried first and covered a known median
only 55% of the time with two starts per point (tests/measure/test_unit_statistics.py). With one
start per point nothing measures start-to-start variation: the interval then comes from
round-to-round variation alone, and its method says so.

A point's own values overrule the pooling where they contradict it (MetricData.spread):
- a figure the workload fixes (metrics' `exact`: requests, prompt tokens, the never-
  evicting hit rate, ...) that is the same in every round of a point is exact: a
  zero-width interval, and differences between such points are exact too;
- a measured figure the same in every round of a point's one start has not been seen to
  vary, which is not a measured zero: no interval ("rounds identical; start-to-start
  variation not measured"), and no difference with it is resolved;
- where a point's own spread (its starts', or with one start its rounds') is clearly
  larger than the other points' (a one-sided F test at 1%), the pooled spread does not fit
  it: its interval uses its own spread and degrees of freedom.
A measured point with several identical starts keeps the pooled start spread: another
start may still differ.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd
from scipy import stats as sps

from ..vocab import metrics

Z_LEVEL = 0.975  # two-sided 95%
# a point's own variance above this quantile of F against the other points' pooled one:
# its spread clearly does not share theirs (1%: two starts per point on a 12-point grid
# switch a point of common spread about once in a hundred, so coverage stays nominal)
OWN_SPREAD_LEVEL = 0.99


@dataclass(frozen=True)
class NoiseFloor:
    """How much one metric moves: between server starts of a point, and between rounds
    of a start, pooled over the run's points (sd on the metric's scale; on the log
    scale 0.10 is about 10%)."""
    metric: str
    log: bool
    start_sd: float | None
    start_df: int
    round_sd: float | None
    round_df: int

    def describe(self) -> str:
        def fmt(sd):
            return "n/a" if sd is None else (f"{np.expm1(sd) * 100:.1f}%" if self.log else f"{sd:.3g}")
        return f"start-to-start {fmt(self.start_sd)} (df {self.start_df}), round-to-round {fmt(self.round_sd)} " \
               f"(df {self.round_df})"


def ok_rounds(rounds: pd.DataFrame, group: tuple[str, str] | None = None,
              failed_too: bool = False) -> pd.DataFrame:
    """Rows of rounds that completed: the whole round, or one request group of it
    (e.g. ("class", "long")); summary.csv holds both. failed_too: rounds that failed as
    well (metrics.FAILURES_COUNT; a round that never sent a request has no value there)."""
    if rounds.empty:
        return rounds
    key, value = group or ("all", "")
    sel = rounds["group"] == key
    if "at_capacity" in rounds.columns:
        # a capacity study: a start's figures are those of the round at its capacity (met, so ok;
        # or, where even the lowest load missed, that round, whose capacity is a bound: no value)
        sel &= rounds["at_capacity"].astype(str) == "True"
    else:
        sel &= rounds["round_status"].isin(["ok", "failed"] if failed_too else ["ok"])
    if group:
        sel &= rounds["group_value"].astype(str) == str(value)
    return rounds[sel]


def starts_per_point(rounds: pd.DataFrame) -> int:
    """The most server starts any point of the run was measured from (0: none measured)."""
    ok = ok_rounds(rounds)
    return 0 if ok.empty else int(ok.groupby("point")["start"].nunique().max())


def single_start(rounds: pd.DataFrame) -> bool:
    """No point of the run was measured from two or more server starts: nothing in it
    measured start-to-start spread, so its intervals hold round-to-round spread only."""
    return starts_per_point(rounds) < 2


# Every comparison of two configs or two tools says this where either side was measured
# from one start: on one H100, plain vLLM's starts alone spread 114-148 ms in TTFT P50
# at one point (results/sweep-speed/20261205-h200/FINDINGS.md), beyond a start's rounds.
ONE_START_A_SIDE = ("one start a side: the interval is over rounds of one start and leaves out "
                    "start-to-start spread")


def one_start_note(*starts: int, why: str = "") -> str | None:
    """The note a comparison owes its reader where either side (`starts`: each side's
    count of server starts at the compared point) had fewer than 2: ONE_START_A_SIDE,
    then `why` (what that means for this comparison). None where every side had 2 or more."""
    if not starts:
        raise ValueError("one_start_note needs each side's count of starts")
    if min(starts) >= 2:
        return None
    return ONE_START_A_SIDE + (f"; {why}" if why else "")


SINGLE_START_NOTE = one_start_note(1, why="one server start per point, and a restart alone can move a latency by "
                                          "more: a difference called resolved here may be two starts', not two "
                                          "configs' (replicates: 2 or more measure it)")


def _scale(values: pd.Series) -> tuple[bool, pd.Series]:
    v = values.dropna()
    log = bool(len(v)) and bool((v > 0).all())
    return log, (np.log(values) if log else values)


def _pooled_sd(groups) -> tuple[float | None, int]:
    """Pooled within-group standard deviation and its degrees of freedom."""
    ss, df = 0.0, 0
    for g in groups:
        g = np.asarray(g, dtype=float)
        g = g[np.isfinite(g)]
        if len(g) > 1:
            ss += float(((g - g.mean()) ** 2).sum())
            df += len(g) - 1
    return (float(np.sqrt(ss / df)), df) if df else (None, 0)


def _own_or_pooled(own_groups, pooled_sd: float, pooled_df: int) -> tuple[float, int, bool]:
    """The sd (and df) one point's interval is built from: the pooled one, unless the
    point's own spread is clearly larger than that of the other points (one-sided F test,
    its variance against theirs at OWN_SPREAD_LEVEL); then its own, with its own df.
    Returns (sd, df, own)."""
    own_sd, own_df = _pooled_sd(own_groups)
    rest_df = pooled_df - own_df
    if own_df and rest_df > 0:
        rest_var = (pooled_sd ** 2 * pooled_df - own_sd ** 2 * own_df) / rest_df
        rest_var = max(rest_var, 0.0)  # rounding: the others all constant
        if own_sd ** 2 > rest_var * float(sps.f.ppf(OWN_SPREAD_LEVEL, own_df, rest_df)):
            return own_sd, own_df, True
    return pooled_sd, pooled_df, False


@dataclass
class MetricData:
    """One metric's values, on its scale: start values per point, rounds per start."""
    metric: str
    log: bool
    starts: dict[str, list[float]]          # point -> value of each start (median of its rounds)
    rounds: dict[tuple[str, int], list[float]]  # (point, start) -> rounds

    @classmethod
    def from_rounds(cls, rounds: pd.DataFrame, metric: str,
                    group: tuple[str, str] | None = None) -> "MetricData | None":
        df = ok_rounds(rounds, group, failed_too=metric in metrics.FAILURES_COUNT)
        if df.empty or metric not in df.columns or df[metric].isna().all():
            return None
        log, scaled = _scale(df[metric])
        df = df.assign(_v=scaled).dropna(subset=["_v"])
        by_start = {k: g["_v"].tolist() for k, g in df.groupby(["point", "start"], sort=False)}
        starts: dict[str, list[float]] = {}
        for (point, _), vals in by_start.items():
            starts.setdefault(point, []).append(float(np.median(vals)))
        return cls(metric, log, starts, by_start)

    def noise(self) -> NoiseFloor:
        s_sd, s_df = _pooled_sd(self.starts.values())
        r_sd, r_df = _pooled_sd(self.rounds.values())
        return NoiseFloor(self.metric, self.log, s_sd, s_df, r_sd, r_df)

    def center(self, point: str) -> float:
        return float(np.mean(self.starts[point]))

    def spread(self, point: str, noise: NoiseFloor) -> tuple[float, int, int, str]:
        """The sd a point's value is judged by, its degrees of freedom, how many values
        the value averages (its standard error is sd / sqrt(n)), and the method. In order:
        1. exact by construction and the same in every round: sd 0 (the df is the
           pooled one, so t x 0 stays 0);
        2. several starts somewhere: the start-to-start sd pooled over points, or the
           point's own where its starts clearly scatter more (_own_or_pooled);
        3. one start per point, and the point's rounds all identical: nothing measured
           its spread (sd NaN: no interval, no resolved difference);
        4. one start per point: the round-to-round sd, pooled or the point's own as in 2;
        5. a single round everywhere: NaN."""
        starts = self.starts[point]
        rounds = [v for (p, _), v in self.rounds.items() if p == point]
        values = [x for r in rounds for x in r]
        constant = len(values) > 1 and max(values) == min(values)
        if constant and metrics.get(self.metric).exact:
            return 0.0, noise.start_df or noise.round_df, len(values), \
                "exact: fixed by the workload, the same in every round"
        if noise.start_df:
            sd, df, own = _own_or_pooled([starts], noise.start_sd, noise.start_df)
            return sd, df, len(starts), ("t over this point's own server starts (they scatter clearly more than "
                                         "the other points')" if own else
                                         "t over server starts, spread pooled over points")
        if constant and noise.round_df:
            return float("nan"), 0, len(values), "rounds identical; start-to-start variation not measured"
        if noise.round_df and values:
            sd, df, own = _own_or_pooled(rounds, noise.round_sd, noise.round_df)
            where = "this point's own rounds (they scatter clearly more than the other points')" if own \
                else "rounds"
            return sd, df, len(values), \
                f"t over {where} (one server start per point: start-to-start variation not covered)"
        return float("nan"), 0, len(values), "no spread measured (a single round)"

    def se(self, point: str, noise: NoiseFloor) -> tuple[float, int, str]:
        """Standard error of a point's value, its degrees of freedom, and the method
        (spread: 0 where exact, NaN where nothing measured it)."""
        sd, df, n, method = self.spread(point, noise)
        return sd / np.sqrt(n) if n else float("nan"), df, method

    def back(self, x):
        return np.exp(x) if self.log else x


def t_quantile(df: int) -> float:
    return float(sps.t.ppf(Z_LEVEL, df)) if df else float("nan")


def _half(*parts: tuple[float, int]) -> float:
    """Half-width of a 95% interval from independent (se, df) parts: t over the smaller
    df of the parts with spread (conservative: Welch-Satterthwaite's df is never below
    it) x their combined se. Exact parts (se 0) add nothing; all exact: 0. A part
    nothing measured (se NaN) makes it NaN."""
    spread = [(se, df) for se, df in parts if se != 0]
    if not spread:
        return 0.0
    return t_quantile(min(df for _, df in spread)) * float(np.hypot.reduce([se for se, _ in spread]))


def _interval(data: MetricData, center: float, half: float) -> tuple[float, float]:
    """center -/+ half, back on the metric's scale and cut to where the quantity can lie:
    a count of 0 whose spread is pooled from points that had some gets [0, x], not
    [-x, x]. Cutting never lowers coverage."""
    if not np.isfinite(half):
        return np.nan, np.nan
    lo, hi = metrics.get(data.metric).domain
    return tuple(float(np.clip(data.back(x), lo, hi)) for x in (center - half, center + half))


INTERVAL_COLUMNS = ["point", "metric", "value", "ci_low", "ci_high", "next_start_low", "next_start_high", "starts",
                    "rounds", "scale", "df", "method"]


def point_intervals(rounds: pd.DataFrame, names=None, group: tuple[str, str] | None = None) -> pd.DataFrame:
    """One row per point x metric: value, 95% interval, a 95% prediction interval for one
    more server start, starts, rounds, method."""
    rows = []
    for m in names or metrics.REGISTRY:
        data = MetricData.from_rounds(rounds, m, group)
        if data is None:
            continue
        noise = data.noise()
        for point in data.starts:
            c = data.center(point)
            sd, df, _, method = data.spread(point, noise)
            se, _, _ = data.se(point, noise)
            half = _half((se, df))
            n = len(data.starts[point])
            # one more start: only where start-to-start spread was measured, or the value is exact
            pred = _half((sd * np.sqrt(1 + 1 / n), df)) if noise.start_df or sd == 0 else np.nan
            ci, nxt = _interval(data, c, half), _interval(data, c, pred)
            rows.append({"point": point, "metric": m, "value": float(data.back(c)),
                         "ci_low": ci[0], "ci_high": ci[1], "next_start_low": nxt[0], "next_start_high": nxt[1],
                         "starts": n, "rounds": sum(len(v) for (p, _), v in data.rounds.items() if p == point),
                         "scale": "log" if data.log else "linear", "df": df, "method": method})
    return pd.DataFrame(rows, columns=INTERVAL_COLUMNS)


def relative_width(row) -> float:
    """How wide a point_intervals row's interval is, relative to its value (log scale:
    high/low - 1); infinite where no interval could be computed."""
    if not (np.isfinite(row.ci_low) and np.isfinite(row.ci_high)) or not row.value:
        return float("inf")
    if row.scale == "log":
        return row.ci_high / row.ci_low - 1
    return (row.ci_high - row.ci_low) / abs(row.value)


def noise_floor(rounds: pd.DataFrame, names=None) -> pd.DataFrame:
    rows = []
    for m in names or metrics.REGISTRY:
        data = MetricData.from_rounds(rounds, m)
        if data is not None:
            nf = data.noise()
            rows.append({"metric": m, "scale": "log" if nf.log else "linear", "start_to_start": nf.start_sd,
                         "start_df": nf.start_df, "round_to_round": nf.round_sd, "round_df": nf.round_df,
                         "summary": nf.describe()})
    return pd.DataFrame(rows).set_index("metric") if rows else pd.DataFrame()


@dataclass(frozen=True)
class Difference:
    """a minus b on the metric's scale: on the log scale as a relative change (0.12 =
    a is 12% above b), with its 95% interval; resolved when the interval excludes 0."""
    metric: str
    a: str
    b: str
    relative: bool
    estimate: float
    low: float
    high: float

    @property
    def resolved(self) -> bool:
        return np.isfinite(self.low) and (self.low > 0 or self.high < 0)

    def verdict(self) -> str:
        """better / worse / not resolved, for a compared to b, by the metric's direction."""
        better = metrics.get(self.metric).better
        if not self.resolved or better is None:
            return "not resolved" if not self.resolved else ("higher" if self.estimate > 0 else "lower")
        up = self.estimate > 0
        return "better" if (up and better == "higher") or (not up and better == "lower") else "worse"


def difference(data: MetricData, a: str, b: str, noise: NoiseFloor | None = None) -> Difference:
    """a minus b. Exact where both points are exact (zero width: resolved by any
    difference); NaN, so never resolved, where either's spread was not measured."""
    noise = noise or data.noise()
    d = data.center(a) - data.center(b)
    se_a, df_a, _ = data.se(a, noise)
    se_b, df_b, _ = data.se(b, noise)
    half = _half((se_a, df_a), (se_b, df_b))
    lo, hi = d - half, d + half
    if data.log:  # a ratio: report it as a relative change
        d, lo, hi = np.expm1(d), np.expm1(lo), np.expm1(hi)
    return Difference(data.metric, a, b, data.log, float(d), float(lo), float(hi))


def best_point(data: MetricData) -> str | None:
    better = metrics.get(data.metric).better
    if better is None or not data.starts:
        return None
    centers = {p: data.center(p) for p in data.starts}
    return (max if better == "higher" else min)(centers, key=centers.get)


def versus_best(rounds: pd.DataFrame, metric: str) -> pd.DataFrame:
    """Each point against the best point of the metric: the difference, its interval and
    whether the study tells them apart (tied = not resolved)."""
    data = MetricData.from_rounds(rounds, metric)
    best = best_point(data) if data else None
    if best is None:
        return pd.DataFrame()
    noise = data.noise()
    rows = []
    for p in data.starts:
        d = difference(data, p, best, noise)
        rows.append({"point": p, "best": best, "difference": d.estimate, "low": d.low, "high": d.high,
                     "relative": d.relative, "tied_with_best": p == best or not d.resolved})
    return pd.DataFrame(rows).set_index("point")
