"""From a study to a decision: which points meet the SLO (with what certainty), which
one to run, what the runner-up trades, and the Pareto fronts of throughput against
per-user speed and against TTFT.

Every verdict is taken on intervals (intervals.py), so a point is said to meet a bound
only when its whole 95% interval does, and two points are told apart only when the
interval of their difference excludes zero.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from .intervals import MetricData, difference, t_quantile
from ..capacity.estimate import PointCapacity, told_apart
from ..vocab import metrics


def slo_table(intervals: pd.DataFrame, slo: dict[str, float], incomplete=(), failed=None) -> pd.DataFrame:
    """Per point and SLO bound: the value [interval] and 'meets' (the interval lies
    within the bound), 'misses' (it lies outside) or 'not resolved'; plus the overall
    verdict (meets every bound / misses one / not resolved). A value with no interval
    (nothing measured its spread: one round) misses where it lies outside the bound and
    is not resolved where it lies within: one measurement cannot show it meets.
    A point in `incomplete` (not every planned round ran) never meets it: the rounds it
    lacks were not measured; nor does one in `failed` (point: its failed requests, from
    failed_requests): its latencies are those of the requests that completed. A bound
    whose metric a point did not record (a run made before the kit recorded stall_p90_ms)
    is 'not measured' there, and the point does not meet the SLO either."""
    rows = {}
    points = list(dict.fromkeys(intervals["point"])) if "point" in intervals else []
    for metric, bound in slo.items():
        m = metrics.get(metric)
        sub = intervals[intervals["metric"] == metric]
        label = f"{m.label} <= {bound:g}" if m.better != "higher" else f"{m.label} >= {bound:g}"
        for p in points:
            rows.setdefault(p, {})[label] = "not measured"
        for row in sub.itertuples():
            if np.isfinite(row.ci_low):
                lo, hi = row.ci_low, row.ci_high
                ok_lo, ok_hi = (hi <= bound, lo <= bound) if m.better != "higher" else (lo >= bound, hi >= bound)
            else:
                ok_lo, ok_hi = False, (row.value <= bound if m.better != "higher" else row.value >= bound)
            verdict = "meets" if ok_lo else ("misses" if not ok_hi else "not resolved")
            rows.setdefault(row.point, {})[label] = verdict
    t = pd.DataFrame.from_dict(rows, orient="index")
    if t.empty:
        return t
    short = set(incomplete) | set(failed or {})
    t["SLO"] = ["misses" if (r == "misses").any() else "meets" if (r == "meets").all() and p not in short
                else "not resolved" for p, r in t.iterrows()]
    return t.rename_axis("point")


def failed_requests(rounds: pd.DataFrame) -> dict[str, int]:
    """Points with requests that failed (an error, a timeout) in their rounds, with how
    many: their latency figures cover only the requests that completed."""
    if rounds.empty or "failed" not in rounds.columns:
        return {}
    whole = rounds[rounds["group"] == "all"] if "group" in rounds.columns else rounds
    n = whole.groupby("point", sort=False)["failed"].sum()
    return {str(p): int(k) for p, k in n.items() if k > 0}


NOT_COMPLETE = ("no point completed every planned start and round: finish the run with "
                "`python -m vllm_study sweep --resume <run>` (add --retry-failed to run failed starts again)")


@dataclass
class Recommendation:
    point: str | None
    metric: str                  # what "best" was judged on: goodput under the SLO, else throughput
    value: float | None
    low: float | None
    high: float | None
    tied: list[str]              # points the study cannot tell apart from it
    runner_up: str | None
    trade: str                   # what the runner-up gives and takes, in words
    reason: str                  # why this point (or why none)
    left_out: list[str] = field(default_factory=list)  # "point (status)": not every planned round completed
    shown: str | None = None     # a capacity as the tables show it: '5.39 [4.80, 6.05]', or a bound '≥ 9.25'

    def text(self) -> str:
        out = self._text()
        if self.left_out:
            out += ("\nLeft out, as not every planned start and round of theirs completed (see the failures "
                    "table): " + ", ".join(self.left_out) + ".")
        return out

    def _text(self) -> str:
        if self.point is None:
            return self.reason
        m = metrics.get(self.metric)
        figure = self.shown or f"{m.format(self.value)} [{m.format(self.low)}, {m.format(self.high)}]"
        lines = [f"Run {self.point}: {m.label} {figure} {m.unit}".rstrip() + f" ({self.reason})."]
        if self.tied:
            lines.append("Not told apart from it by this study: " + ", ".join(self.tied) + ".")
        if self.runner_up:
            lines.append(f"Runner-up {self.runner_up}: {self.trade}.")
        return "\n".join(lines)


def recommend(rounds: pd.DataFrame, intervals: pd.DataFrame, slo: dict[str, float],
              capacities: dict[str, PointCapacity | None] | None = None,
              goodput_counts: bool = True) -> Recommendation:
    """The point with the highest goodput among those that meet (or may meet) the SLO;
    without an SLO, the highest output throughput; in a capacity study (`capacities`:
    report.Run.capacities, capacity.estimate's estimate per point), the highest
    capacity (by_capacity). Only points whose every planned start and round completed are
    candidates (a point whose server died mid-run has figures from fewer rounds, or none at
    its load). Under open-loop load, output throughput is not a ranking: the arrival rate
    fixes it until a point saturates. Ties are the points whose difference from the best
    is not resolved. `goodput_counts` False: the rounds' goodput was counted under another
    SLO (the study's, where `slo` is given at report time), so it ranks nothing here."""
    measured = set(intervals["metric"]) if not intervals.empty else set()
    left_out = _incomplete(rounds)
    if capacities or "capacity_rps" in measured:
        if not capacities:
            raise ValueError("a capacity study is ranked by capacity.estimate's estimates, not by the rounds' "
                             "per-start figures: pass capacities=run.capacities (report.Run)")
        return by_capacity(rounds, capacities, left_out)
    metric = "goodput" if slo and goodput_counts and "goodput" in measured else "output_throughput"
    data = MetricData.from_rounds(rounds, metric)
    none = lambda reason: Recommendation(None, metric, None, None, None, [], None, "", reason,  # noqa: E731
                                         [f"{p} ({st})" for p, st in left_out.items()])
    if data is None:
        return none("nothing was measured")
    candidates = [p for p in data.starts if p not in left_out]
    if not candidates:
        return none(NOT_COMPLETE)
    if metric == "output_throughput" and _open_loop(rounds):
        return none("no recommendation by output tokens/s: under open-loop load (requests arrive at a set rate) "
                    "the arrival rate fixes it until a point saturates. Rank by goodput with an `slo:`, or "
                    "search each point's capacity within the SLO with `capacity:`")
    what = {"goodput": "goodput"}.get(metric, "output throughput")
    failing = failed_requests(rounds)
    reason = f"the highest {what}; no SLO is set"
    if slo:
        verdicts = slo_table(intervals, slo, left_out, failing)
        meets = [p for p in candidates if p in verdicts.index and verdicts.at[p, "SLO"] == "meets"]
        maybe = [p for p in candidates if p in verdicts.index and verdicts.at[p, "SLO"] == "not resolved"]
        if metric != "goodput":
            what += (" (goodput was counted under the study's own SLO, not this one)" if "goodput" in measured
                     else " (goodput was not measured under this SLO)")
        if meets:
            candidates, reason = meets, f"the highest {what} among the points whose intervals meet every SLO bound"
        elif maybe:
            candidates, reason = maybe, (f"the highest {what} among the points that may meet the SLO: none meets "
                                         "it with certainty")
        else:
            return Recommendation(None, metric, None, None, None, [], None, "",
                                  "no point meets the SLO: relax a bound, lower the load, or widen the grid")
    centers = {p: data.center(p) for p in candidates}
    best = max(centers, key=centers.get)
    if best in failing:
        reason += (f"; {failing[best]} of its requests failed (an error or a timeout): its latencies are those "
                   "of the requests that completed")
    noise = data.noise()
    se, df, _ = data.se(best, noise)
    half = t_quantile(df) * se
    tied, others = [], []
    for p in candidates:
        if p == best:
            continue
        d = difference(data, p, best, noise)
        (others if d.resolved else tied).append((centers[p], p))
    rest = sorted(tied + others, reverse=True)
    runner = rest[0][1] if rest else None
    return Recommendation(best, metric, float(data.back(centers[best])),
                          float(data.back(centers[best] - half)) if np.isfinite(half) else None,
                          float(data.back(centers[best] + half)) if np.isfinite(half) else None,
                          [p for _, p in sorted(tied, reverse=True)], runner,
                          trade(rounds, runner, best) if runner else "", reason,
                          [f"{p} ({st})" for p, st in left_out.items()])


def _rank(pc: PointCapacity) -> tuple[int, float]:
    """A capacity's place: an estimate (or a bound at least it: met at the highest load)
    by its value; then a bound below the lowest load, by that bound, below every estimate;
    last one whose starts disagree (some below the lowest load, some at the highest)."""
    c = pc.config
    return (2, c.value) if c.kind in ("value", "at_least") else (1, c.value) if c.kind == "below" else (0, 0.0)


def by_capacity(rounds: pd.DataFrame, capacities: dict[str, PointCapacity | None],
                left_out: dict[str, str]) -> Recommendation:
    """recommend in a capacity study: the highest of capacity.estimate's estimates
    (each start's SLO margins fitted, starts combined with the censored ones as bounds),
    the same figure the capacity table, compare and export state. Ties are the points
    whose gain over the best is not resolved (capacity.estimate.told_apart); a point whose capacity
    is below its lowest load is never a tie, and nothing is recommended when every one is."""
    gone = [f"{p} ({st})" for p, st in left_out.items()]
    found = {p: pc for p, pc in capacities.items() if pc is not None and p not in left_out}
    metric = "capacity_rps"
    if not found:
        return Recommendation(None, metric, None, None, None, [], None, "",
                              NOT_COMPLETE if left_out else "nothing was measured", gone)
    ranked = sorted(found, key=lambda p: _rank(found[p]), reverse=True)
    top = found[ranked[0]]
    c = top.config
    if c.kind == "below":
        return Recommendation(None, metric, None, None, None, [], None, "",
                              "every point's capacity is below its lowest load: the SLO was missed at every load "
                              "measured; lower capacity.lo (or capacity.floor)", gone)
    if c.kind == "unresolved":
        return Recommendation(None, metric, None, None, None, [], None, "",
                              "no point's capacity is resolved: each one's starts disagree (some below the lowest "
                              "load, some at or above the highest); run more starts", gone)
    unit = "rps" if top.rps_per_load else "load"
    scale = top.rps if top.rps_per_load else (lambda v: v)  # noqa: E731
    if not top.rps_per_load:  # the load fixes no rate: the capacity is in the search's own unit
        metric = "capacity_load"
    low, high = (c.low, c.high) if c.kind == "value" else (c.value, None)
    tied = [p for p in ranked[1:] if found[p].config.kind != "below" and not told_apart(top, found[p]).resolved]
    runner = ranked[1] if len(ranked) > 1 else None
    reason = "the highest capacity within the SLO" + (
        "; a lower bound: it met the SLO at the highest load measured" if c.kind == "at_least" else "")
    return Recommendation(ranked[0], metric, scale(c.value), None if low is None else scale(low),
                          None if high is None else scale(high), tied, runner,
                          trade(rounds, runner, ranked[0], capacities) if runner else "", reason, gone,
                          shown=top.cell(unit))


def _incomplete(rounds: pd.DataFrame) -> dict[str, str]:
    """Points whose summary status is not ok (partial, failed, running), with it."""
    if rounds.empty or "point_status" not in rounds.columns:
        return {}
    status = rounds.groupby("point", sort=False)["point_status"].first()
    return {p: str(st) for p, st in status.items() if st != "ok"}


def _open_loop(rounds: pd.DataFrame) -> bool:
    """Rounds sent on a schedule (Poisson, a ladder, a trace) carry the rate they offered."""
    return "offered_rate" in rounds.columns and bool(rounds["offered_rate"].notna().any())


TRADE_METRICS = ("capacity_rps", "goodput", "output_throughput", "ttft_p90_ms", "itl_p90_ms", "tpot_p50_ms")


def trade(rounds: pd.DataFrame, a: str, b: str, capacities: dict[str, PointCapacity | None] | None = None) -> str:
    """What point a gives and takes against point b: resolved differences only. With
    `capacities`, the capacity is a's gain over b (capacity.estimate.told_apart), not the
    difference of the rounds' per-start figures."""
    parts = []
    pa, pb = (capacities or {}).get(a), (capacities or {}).get(b)
    if pa is not None and pb is not None:
        t = told_apart(pa, pb)
        if t.resolved:
            g = t.gain
            up = g.kind == "at_least" or (g.kind == "value" and g.value > 1)
            parts.append(f"capacity {g} ({'better' if up else 'worse'})")
    for name in TRADE_METRICS:
        if capacities and name == "capacity_rps":
            continue
        data = MetricData.from_rounds(rounds, name)
        if data is None or a not in data.starts or b not in data.starts:
            continue
        d = difference(data, a, b)
        if d.resolved:
            change = f"{d.estimate:+.0%}" if d.relative else f"{d.estimate:+.3g}"
            parts.append(f"{metrics.get(name).label} {change} ({d.verdict()})")
    return "; ".join(parts) if parts else "no difference this study resolves"


def pareto(points: pd.DataFrame, x: str, y: str, x_better: str = "higher", y_better: str = "higher") -> pd.Series:
    """True for the points no other point dominates. A point is dominated when another
    is at least as good on both axes and strictly better on one; points with identical
    values are ties and all stay on the front (vllm bench sweep keeps dominated ties)."""
    sx = points[x] * (1 if x_better == "higher" else -1)
    sy = points[y] * (1 if y_better == "higher" else -1)
    on = []
    for i in points.index:
        dominated = ((sx >= sx[i]) & (sy >= sy[i]) & ((sx > sx[i]) | (sy > sy[i]))).any()
        on.append(not dominated)
    return pd.Series(on, index=points.index)


def pareto_table(intervals: pd.DataFrame, n_gpus: int = 1) -> pd.DataFrame:
    """Per point: output tokens/s per GPU, per-user speed (1000 / TPOT P50: tokens/s a
    single request sees), TTFT P90, and whether it is on each front."""
    wide = intervals.pivot_table(index="point", columns="metric", values="value")
    need = {"output_throughput", "tpot_p50_ms", "ttft_p90_ms"}
    if wide.empty or not need <= set(wide.columns):
        return pd.DataFrame()
    t = pd.DataFrame({"output tok/s per GPU": wide["output_throughput"] / n_gpus,
                      "per-user tok/s": 1000.0 / wide["tpot_p50_ms"], "TTFT P90 (ms)": wide["ttft_p90_ms"]})
    t["front: speed"] = pareto(t, "per-user tok/s", "output tok/s per GPU")
    t["front: TTFT"] = pareto(t, "TTFT P90 (ms)", "output tok/s per GPU", x_better="lower")
    return t
