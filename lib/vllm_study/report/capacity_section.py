"""The report's capacity section: each point's capacity within the SLO (censored where
the bracket ended at its bottom or top), the answer in words, and the cost per million
requests."""
from __future__ import annotations

import numpy as np
import pandas as pd

from ..analysis import intervals as analysis
from ..vocab import metrics
from .run import Run, status_label


# -- capacity studies -------------------------------------------------------------
def is_capacity_study(r: Run) -> bool:
    return r.study.capacity is not None


def _trace_info(r: Run) -> dict | None:
    """A replayed trace's record (source, window, real rate), from the first start that has one."""
    for s in r.summaries:
        for st in r.folder.point(s.point).starts():
            if st.trace:
                return st.trace
    return None


def capacity_answer(r: Run) -> str | None:
    """The capacity study's answer in words: the best config's capacity with its interval
    (and as a multiple of the trace's real rate), the baseline's (vLLM's defaults where
    the study names them so), and the difference, called an effect only when resolved."""
    from ..analysis import decision
    if not is_capacity_study(r):
        return None
    bounds = ", ".join(f"{metrics.get(k).label} <= {v:g} ms" for k, v in r.study.capacity.slo.items())
    rec = decision.recommend(r.rounds, r.intervals, {})
    if rec.point is None:
        return f"No capacity was measured: {rec.reason}."
    if _all_below(_completed_capacities(r, rec.point)):  # the best is below the floor: so is every point
        return (f"Capacity below {_load_words(r, floor(r))} at every point: the SLO ({bounds}) was "
                f"missed at every load measured; {_lower(r)}.")
    m = metrics.get("capacity_rps")
    trace = _trace_info(r)
    times = f" ({rec.value / trace['rate']:.2f} x the trace's real rate)" if trace and trace.get("rate") else ""
    sustains = metrics.with_interval(r.interval(rec.point, "capacity_rps"), m)
    above = _all_above(_completed_capacities(r, rec.point))
    if above:  # met at hi in every start: a lower bound, no capacity found
        lines = [f"{rec.point} sustains at least {_load_words(r, r.study.capacity.hi)} within the SLO ({bounds}): "
                 "it met the SLO at the highest load measured; raise capacity.hi to find its capacity."]
    else:
        lines = [f"{rec.point} sustains {sustains} req/s{times} within the SLO ({bounds})."]
    censored = None if above else _censored(r, rec.point)
    if censored:
        lines.append(censored)
    base = r.baseline
    below = _baseline_below(r, base) if base and base != rec.point else None
    if below:
        lines.append(below + _gain_over_below(r, rec.point, base))
    elif base and base != rec.point and r.interval(base, "capacity_rps"):
        data = analysis.MetricData.from_rounds(r.rounds, "capacity_rps")
        d = analysis.difference(data, rec.point, base)
        change = f"{d.estimate:+.0%} [{d.low:+.0%}, {d.high:+.0%}]" if d.relative else \
            f"{d.estimate:+.2f} [{d.low:+.2f}, {d.high:+.2f}] req/s"
        lines.append(f"The baseline {base} sustains {metrics.with_interval(r.interval(base, 'capacity_rps'), m)} "
                     "req/s: "
                     f"{change}, " + ("a resolved gain." if d.resolved and d.estimate > 0 else
                                      "a resolved loss." if d.resolved else "not resolved by this study."))
    elif base == rec.point:
        lines.append(f"That is the baseline ({base}) itself.")
    if rec.tied:
        lines.append("Not told apart from it by this study: " + ", ".join(rec.tied) + ".")
    at = [f"{metrics.get(k).label} {metrics.with_interval(r.interval(rec.point, k), metrics.get(k))} ms"
          for k in ("ttft_sched_p90_ms", "ttft_p90_ms", "itl_p99_ms", "tpot_p50_ms") if r.interval(rec.point, k)]
    if at:
        lines.append(("At the highest load: " if above else "At its capacity: ") + "; ".join(at) + ".")
    cost = cost_per_million(r, rec.point)
    if cost:
        lines.append(f"Cost at capacity: {cost} per million output tokens "
                     f"(at {r.study.gpu_hour_price:g} a GPU-hour).")
    return "\n".join(lines)


def cost_per_million(r: Run, point: str) -> str | None:
    """price x GPUs / output tokens per hour at capacity, x 1e6, with the interval that
    the output throughput's interval maps to (a higher throughput is a lower cost)."""
    price = r.study.gpu_hour_price
    iv = r.interval(point, "output_throughput")
    if not price or not iv or not iv["value"]:
        return None
    gpus = r.study.engine_args.tensor_parallel_size or 1
    per = lambda tok_s: price * gpus / (tok_s * 3600) * 1e6  # noqa: E731
    if np.isfinite(iv["ci_low"]) and iv["ci_low"] > 0:
        return f"{per(iv['value']):.3g} [{per(iv['ci_high']):.3g}, {per(iv['ci_low']):.3g}]"
    return f"{per(iv['value']):.3g}"


def _completed_capacities(r: Run, point: str) -> list:
    """The capacity searches of the point's starts that completed."""
    return [st.capacity for st in r.folder.point(point).starts() if st.capacity and st.status == "ok"]


def _censored(r: Run, point: str) -> str | None:
    starts = _completed_capacities(r, point)
    above = sum(1 for c in starts if c.censored == "above")
    below = sum(1 for c in starts if c.censored == "below")
    cap = r.study.capacity
    if above:
        return (f"{above} of {len(starts)} starts met the SLO at the search's highest load ({cap.hi:g}): "
                "the capacity is at least that; raise capacity.hi to find it.")
    if below:
        return (f"{below} of {len(starts)} starts missed the SLO at the lowest load ({floor(r, point):g}): "
                f"their capacity is below it, not measured; {_lower(r, point)}.")
    return None


def floor(r: Run, point: str | None = None) -> float:
    """The lowest load the capacity search could go to: the starts' recorded floor (of the
    point, or of every point), or lo for runs searched before the search halved below lo."""
    caps = [st.capacity for p in ([point] if point else [s.point for s in r.summaries])
            for st in r.folder.point(p).starts() if st.capacity]
    return min((c.floor if c.floor is not None else r.study.capacity.lo for c in caps),
               default=r.study.capacity.lo)


def _lower(r: Run, point: str | None = None) -> str:
    """The setting to lower to measure a capacity below the floor."""
    return "lower capacity.floor" if floor(r, point) < r.study.capacity.lo else "lower capacity.lo"


def _lowest_load(r: Run, lo: float | None = None) -> tuple[str, float | None]:
    """The search's lowest load (or `lo`) in words, and as requests/s where the load fixes the rate."""
    lo, over = r.study.capacity.lo if lo is None else lo, r.study.capacity.over
    trace = _trace_info(r)
    if over == "speed" and trace and trace.get("rate"):
        return f"speed {lo:g} ({lo * trace['rate']:.2f} req/s)", lo * trace["rate"]
    if over == "rate":
        return f"{lo:g} req/s", lo
    return f"{over} {lo:g}", None


def _load_words(r: Run, load: float) -> str:
    """A load of the search as the user reads it: '10.17 req/s (12 x the trace's real
    rate)', '2.00 req/s', or 'concurrency 4' where no rate fixes it."""
    over, trace = r.study.capacity.over, _trace_info(r)
    if over == "speed" and trace and trace.get("rate"):
        return f"{load * trace['rate']:.2f} req/s ({load:g} x the trace's real rate)"
    return f"{load:.2f} req/s" if over == "rate" else f"{over} {load:g}"


def below_everywhere(r: Run, point: str) -> bool:
    """A capacity study's point whose every completed start missed the SLO at the lowest
    load: its capacity is a bound below that load, and there is nothing to run."""
    return is_capacity_study(r) and _all_below(_completed_capacities(r, point))


def _all_above(completed: list) -> bool:
    """Every completed start of a point met the SLO at the search's highest load: its
    capacity is at least that load, not that load."""
    return bool(completed) and all(c.censored == "above" for c in completed)


def _baseline_below(r: Run, point: str) -> str | None:
    """Where every start of a point missed the SLO at the search's lowest load (its floor), say so with
    why each missed: its capacity is not 0 but unmeasured below the bracket."""
    starts = _completed_capacities(r, point)
    if not _all_below(starts):
        return None
    lo = floor(r, point)
    why = "; ".join(sorted({s["why"] for c in starts for s in c.steps if s["load"] == lo and s.get("why")}))
    words, _ = _lowest_load(r, lo)
    return (f"The baseline {point} met the SLO at no load tried: each of its {len(starts)} starts missed at the "
            f"lowest, {words}: {why}.")


def _gain_over_below(r: Run, best: str, base: str) -> str:
    """The gain over a baseline below the bracket is a lower bound: the best point's
    interval low less the lowest load's rate."""
    words, lo_rps = _lowest_load(r, floor(r, base))
    lower = _lower(r, base)
    iv = r.interval(best, "capacity_rps")
    if lo_rps is None or not iv or not np.isfinite(iv["ci_low"]):
        return f" Its capacity is below {words}; {lower} to measure it."
    more = iv["ci_low"] - lo_rps
    if more <= 0:
        return f" Its capacity is below {lo_rps:.2f} req/s; the gain is not resolved ({lower} to measure it)."
    return (f" Its capacity is below {lo_rps:.2f} req/s, so {best} sustains at least {more:+.2f} req/s more "
            f"({iv['ci_low'] / lo_rps:.1f} x or more: its interval's low end over that rate), a resolved gain.")


def _all_below(completed: list) -> bool:
    """Every completed start of a point (_completed_capacities) missed the SLO at the
    search's lowest load (its floor): its capacity is unmeasured below it (recorded as 0,
    which it is not)."""
    return bool(completed) and all(c.censored == "below" for c in completed)


def lowest_load_rps(r: Run) -> float | None:
    """The capacity search's lowest load (its floor) as requests/s, where the load fixes the rate."""
    return _lowest_load(r, floor(r))[1] if is_capacity_study(r) else None


def below_lowest_load(r: Run, point: str | None = None) -> str:
    """'below 3.08' (req/s: the floor), or the load in the search's own unit where no rate fixes it."""
    words, lo_rps = _lowest_load(r, floor(r, point))
    return f"below {lo_rps:.2f}" if lo_rps else f"below {words}"


def capacity_cell(r: Run, point: str, completed: list | None = None) -> str:
    """A point's capacity in req/s [95% interval] for a table, or 'below ...' where every
    start missed at the lowest load, 'at least ...' where every start met at the highest
    (`completed`: its _completed_capacities, if read)."""
    completed = _completed_capacities(r, point) if completed is None else completed
    if _all_below(completed):
        return below_lowest_load(r, point)
    if _all_above(completed):
        words, hi_rps = _lowest_load(r, r.study.capacity.hi)
        return f"at least {hi_rps:.2f}" if hi_rps else f"at least {words}"
    return metrics.with_interval(r.interval(point, "capacity_rps"), metrics.get("capacity_rps"))


def search_trials(r: Run) -> pd.DataFrame | None:
    """A search's trials, one row per server start; in a capacity search, a trial that
    missed the SLO missed it at the lowest load and shows that bound."""
    from ..search import search_report
    return search_report.trials_table(r, below=below_lowest_load(r) if is_capacity_study(r) else None)


def capacity_table(r: Run) -> pd.DataFrame | None:
    """Per point: capacity [95% interval] in req/s and in the search's unit, each start's
    bracket and steps, and the latencies at capacity."""
    if not is_capacity_study(r):
        return None
    over = r.study.capacity.over
    rows = []
    for s in r.summaries:
        starts = [st for st in r.folder.point(s.point).starts() if st.capacity]
        brackets = "; ".join(f"s{st.start}: [{st.capacity.bracket[0]:.3g}, "
                             f"{'...' if st.capacity.bracket[1] is None else format(st.capacity.bracket[1], '.3g')}"
                             f"] in {len(st.capacity.steps)} steps" + ("" if st.status == "ok" else " (failed)")
                             for st in starts)
        completed = [st.capacity for st in starts if st.status == "ok"]
        below = _all_below(completed)
        row = {"point": s.point, "status": status_label(s),
               "capacity (req/s)": capacity_cell(r, s.point, completed),
               f"capacity ({over})": f"below {floor(r, s.point):g}" if below else
               f"at least {r.study.capacity.hi:g}" if _all_above(completed) else
               metrics.with_interval(r.interval(s.point, "capacity_load"), metrics.get("capacity_load")),
               f"{over} bracket per start": brackets}
        for k in ("ttft_sched_p90_ms", "itl_p99_ms", "output_throughput", "prefix_cache_hit_rate"):
            # below lo there is no capacity to be at: its round is the lowest load's, which missed
            row[f"{metrics.get(k).title} at capacity"] = "-" if below else \
                metrics.with_interval(r.interval(s.point, k), metrics.get(k))
        if r.study.gpu_hour_price:
            row["cost per 1M output tokens"] = cost_per_million(r, s.point) or ""
        rows.append(row)
    return pd.DataFrame(rows).set_index("point") if rows else None
