"""The report's capacity section: each point's capacity within the SLO (censored where
the bracket ended at its bottom or top), the answer in words, and the cost per million
requests."""
from __future__ import annotations

import numpy as np
import pandas as pd

from ..vocab import metrics
from .run import Run, status_label


# -- capacity studies -------------------------------------------------------------
def is_capacity_study(r: Run) -> bool:
    return r.study.capacity is not None


def trace_info(r: Run) -> dict | None:
    """A replayed trace's record (source, window, real rate), from the first start that has one."""
    for s in r.summaries:
        for st in r.folder.point(s.point).starts():
            if st.trace:
                return st.trace
    return None


def capacity_answer(r: Run) -> str | None:
    """The capacity study's answer in words: the best config's capacity with its interval
    (and as a multiple of the trace's real rate), the baseline's (vLLM's defaults where
    the study names them so), and the gain over it as a ratio with its interval (a lower
    bound where the baseline's capacity is below the lowest load), called resolved only
    where the interval excludes 1; last, the statistic it was judged by."""
    if not is_capacity_study(r):
        return None
    bounds = ", ".join(f"{metrics.get(k).label} <= {v:g} ms" for k, v in r.study.capacity.slo.items())
    rec = r.recommendation({})
    best = rec.point
    pc = r.capacity(best) if best else None
    words = confirmation_words(r)
    confirmed = words + "\n" if words else ""
    if pc is None:
        below = [p for p in (s.point for s in r.summaries) if r.capacity(p) is not None]
        if below and all(r.capacity(p).config.kind == "below" for p in below):  # every point below its floor
            return (f"Capacity below {_load_words(r, floor(r))} at every point: the SLO ({bounds}) was "
                    f"missed at every load measured; {_lower(r)}.\n{confirmed}{statistic_sentence(r)}")
        return f"No capacity was measured: {rec.reason}." + (f"\n{confirmed.strip()}" if confirmed else "")
    if pc.config.kind == "below":  # the best is below the floor: so is every point
        return (f"Capacity below {_load_words(r, floor(r))} at every point: the SLO ({bounds}) was "
                f"missed at every load measured; {_lower(r)}.\n{confirmed}{statistic_sentence(r)}")
    trace = trace_info(r)
    c = pc.config
    value_rps = pc.rps(c.value)
    times = f" ({c.value:.2f} x the trace's real rate)" if r.study.capacity.over == "speed" and trace \
        and trace.get("rate") and c.kind == "value" else ""
    above = c.kind == "at_least"
    if above:  # met at hi in every start: a lower bound, no capacity found
        lines = [f"{best} sustains at least {_load_words(r, c.value)} within the SLO ({bounds}): "
                 "it met the SLO at the highest load measured; raise capacity.hi to find its capacity."]
    elif c.kind == "unresolved":
        lines = [f"{best}'s capacity is not resolved: {pc.cell()}."]
    else:
        unit = "req/s" if value_rps is not None else f"({r.study.capacity.over})"
        lines = [f"{best} sustains {pc.cell()} {unit}{times} within the SLO ({bounds})."]
    censored = None if above else _censored(r, best)
    if censored:
        lines.append(censored)
    base = r.baseline
    if base and base != best and r.capacity(base) is not None:
        lines.append(_baseline_words(r, best, base))
    elif base == best:
        lines.append(f"That is the baseline ({base}) itself.")
    tied = rec.tied
    if tied:
        lines.append("Not told apart from it by this study: " + ", ".join(tied) + ".")
    at = [f"{metrics.get(k).label} {metrics.with_interval(r.interval(best, k), metrics.get(k))} ms"
          for k in ("ttft_sched_p90_ms", "ttft_p90_ms", "itl_p99_ms", "tpot_p50_ms") if r.interval(best, k)]
    if at:
        lines.append(("At the highest load: " if above else "At its capacity: ") + "; ".join(at) + ".")
    cost = cost_per_million(r, best)
    if cost:
        lines.append(f"Cost at capacity: {cost} per million output tokens "
                     f"(at {r.study.gpu_hour_price:g} a GPU-hour).")
    if confirmed:
        lines.append(confirmed.strip())
    lines.append(statistic_sentence(r))
    return "\n".join(lines)


def confirmation_words(r: Run) -> str | None:
    """Which comparisons confirmation until resolved resolved, and why it stopped
    (analysis/confirmation.py); None for a run without its record."""
    from ..analysis import confirmation as confirming
    from ..records import confirmation
    rec = confirmation.read(r.folder.path)
    return confirming.stop_words(rec, confirming.current(r.folder, r.study, rec)) if rec else None


def best_capacity(r: Run) -> str | None:
    """The point with the highest capacity (capacity.estimate's estimate, or its bound
    where it met the SLO at the highest load) among those whose every planned start
    completed, as decision.recommend ranks them; None where every capacity is below its
    lowest load."""
    return r.recommendation({}).point


def statistic_sentence(r: Run) -> str:
    """Which statistic the run's capacities were judged by (capacity.estimate)."""
    from ..capacity import estimate
    used: list[str] = []
    for s in r.summaries:
        pc = r.capacity(s.point)
        used += pc.statistics if pc else []
    keys = list(dict.fromkeys(used)) or ["highest met"]
    how = "; ".join(estimate.STATISTICS[k] + (f" ({used.count(k)} of {len(used)} starts)" if len(keys) > 1
                                                   else "") for k in keys)
    pooled = next((pc.pooled_df for pc in r.capacities.values() if pc and pc.pooled_df), None)
    spread = f", {estimate.POOLED.format(df=pooled)}" if pooled else ""
    # one start and nothing pooled: the interval is the start's bootstrap alone (capacity.fit.combine)
    alone = [pid for pid, pc in r.capacities.items()
             if pc and pc.config.kind == "value" and not pc.config.spread_measured]
    within = (f" {', '.join(alone)}: one start, so {'its interval is' if len(alone) == 1 else 'their intervals are'}"
              " within that start (no start-to-start spread measured)." if alone else "")
    return f"Capacity: {how}; {estimate.COMBINED}{spread}.{within}"


def _gain_words(g) -> str:
    if g.kind == "at_least":
        return f"at least {g.value:.2f} x"
    if g.kind == "at_most":
        return f"at most {g.value:.2f} x"
    if g.kind == "unresolved" and g.value is None:
        return "an unresolved multiple of"
    lo = f"{g.low:.2f}" if g.low is not None else "open"
    hi = f"{g.high:.2f}" if g.high is not None else "open"
    return f"{g.value:.2f} x [{lo}, {hi}]"


def _baseline_words(r: Run, best: str, base: str) -> str:
    """The baseline's capacity and the best's gain over it (capacity.estimate.told_apart)."""
    from ..capacity.estimate import one_start_words, told_apart
    pb, pc = r.capacity(base), r.capacity(best)
    t = told_apart(pc, pb)
    g = t.gain
    verdict = ("a resolved gain" if t.resolved and (g.kind == "at_least" or (g.value or 0) > 1) else
               "a resolved loss" if t.resolved else
               f"not resolved yet ({one_start_words(t.unmeasured)})" if g.resolved else "not resolved by this study")
    if g.kind == "unresolved" and g.value is None:
        said = ("the gain is not resolved (both met the SLO at the highest load measured: raise capacity.hi "
                "to tell them apart)." if pc.config.kind == pb.config.kind == "at_least" else
                f"the gain is not resolved ({best}'s interval reaches below every load measured, "
                "and the baseline's capacity is a bound).")
        return _baseline_below(r, base) + f" Its capacity is {pb.cell()} req/s: " + said \
            if pb.config.kind == "below" else f"The baseline {base} sustains {pb.cell()}: " + said
    said = f"{best} sustains {_gain_words(g)} the baseline's capacity{_bound_why(g, pc, pb)}, {verdict}."
    if pb.config.kind == "below":
        return _baseline_below(r, base) + f" Its capacity is {pb.cell()} req/s: " + said
    unit = "req/s" if pb.rps_per_load else f"({r.study.capacity.over})"
    return f"The baseline {base} sustains {pb.cell()} {unit}: " + said


def _bound_why(g, pc, pb) -> str:
    """Why a gain is a lower bound: the best met the SLO at the highest load, the
    baseline missed it at the lowest, or both."""
    if g.kind != "at_least":
        return ""
    why = [w for w, censored in (("the best met the SLO at the highest load", pc.config.kind == "at_least"),
                                 ("the baseline's capacity is below the lowest load", pb.config.kind == "below"))
           if censored]
    return f" (a lower bound: {' and '.join(why)})" if why else " (a lower bound)"


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


def completed_capacities(r: Run, point: str) -> list:
    """The capacity searches of the point's starts that completed."""
    return [st.capacity for st in r.folder.point(point).starts() if st.capacity and st.status == "ok"]


def _censored(r: Run, point: str) -> str | None:
    starts = completed_capacities(r, point)
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
    trace = trace_info(r)
    if over == "speed" and trace and trace.get("rate"):
        return f"speed {lo:g} ({lo * trace['rate']:.2f} req/s)", lo * trace["rate"]
    if over == "rate":
        return f"{lo:g} req/s", lo
    return f"{over} {lo:g}", None


def _load_words(r: Run, load: float) -> str:
    """A load of the search as the user reads it: '10.17 req/s (12 x the trace's real
    rate)', '2.00 req/s', or 'concurrency 4' where no rate fixes it."""
    over, trace = r.study.capacity.over, trace_info(r)
    if over == "speed" and trace and trace.get("rate"):
        return f"{load * trace['rate']:.2f} req/s ({load:g} x the trace's real rate)"
    return f"{load:.2f} req/s" if over == "rate" else f"{over} {load:g}"


def below_everywhere(r: Run, point: str) -> bool:
    """A capacity study's point whose capacity is a bound below its lowest load (every
    completed start missed there): there is nothing to run."""
    pc = r.capacity(point) if is_capacity_study(r) else None
    return pc is not None and pc.config.kind == "below"


def _baseline_below(r: Run, point: str) -> str | None:
    """Where every start of a point missed the SLO at the search's lowest load (its floor), say so with
    why each missed: its capacity is not 0 but unmeasured below the bracket."""
    starts = completed_capacities(r, point)
    if not _all_below(starts):
        return None
    lo = floor(r, point)
    why = "; ".join(sorted({s["why"] for c in starts for s in c.steps if s["load"] == lo and s.get("why")}))
    words, _ = _lowest_load(r, lo)
    return (f"The baseline {point} met the SLO at no load tried: each of its {len(starts)} starts missed at the "
            f"lowest, {words}: {why}.")


def _all_below(completed: list) -> bool:
    """Every completed start of a point (completed_capacities) missed the SLO at the
    search's lowest load (its floor): its capacity is a bound below it, never 0."""
    return bool(completed) and all(c.censored == "below" for c in completed)


def lowest_load_rps(r: Run) -> float | None:
    """The capacity search's lowest load (its floor) as requests/s, where the load fixes the rate."""
    return _lowest_load(r, floor(r))[1] if is_capacity_study(r) else None


def below_lowest_load(r: Run, point: str | None = None) -> str:
    """'below 3.08' (req/s: the floor), or the load in the search's own unit where no rate fixes it."""
    words, lo_rps = _lowest_load(r, floor(r, point))
    return f"< {lo_rps:.2f}" if lo_rps else f"< {words}"


def capacity_cell(r: Run, point: str, unit: str = "rps") -> str:
    """A point's capacity for a table: '5.39 [4.80, 6.05]' (req/s, or `unit` "load": the
    search's own), '< 0.77' where its starts missed even at their lowest load, '≥ 9.25'
    where they met at the highest (capacity.estimate); '-' where none completed."""
    pc = r.capacity(point)
    return pc.cell(unit) if pc else "-"


def search_trials(r: Run) -> pd.DataFrame | None:
    """A search's trials, one row per server start; in a capacity search, a trial that
    missed the SLO missed it at the lowest load and shows that bound."""
    from ..search import search_report
    return search_report.trials_table(r, below=below_lowest_load(r) if is_capacity_study(r) else None)


def capacity_column(r: Run) -> str:
    """The capacity table's lead column: req/s where the load fixes a rate, else the search's unit."""
    return "capacity (req/s)" if lowest_load_rps(r) is not None else f"capacity ({r.study.capacity.over})"


def below_lowest_load_words(r: Run, point: str | None = None) -> str:
    """below_lowest_load with its unit: '< 3.08 req/s', or '< concurrency 2'."""
    below = below_lowest_load(r, point)
    return f"{below} req/s" if lowest_load_rps(r) is not None else below


def bracket_words(c) -> str:
    """One start's bracket and steps: '[1.26, 1.59] in 4 steps'; censored, a bound, never a
    bracket from 0: '< 0.8 in 1 step' (missed at the floor), '>= 2 in 2 steps' (met at hi);
    a search its start's failure stopped gives none: 'no capacity: stopped after 1 step'."""
    n = len(c.steps)
    if c.stopped:
        return f"no capacity: stopped after {n} step{'' if n == 1 else 's'}"
    lo, hi = c.bracket
    below = c.censored == "below" or (lo == 0 and hi is not None)  # records before `censored`: met nowhere
    where = f"< {hi:.3g}" if below else f">= {lo:.3g}" if hi is None else f"[{lo:.3g}, {hi:.3g}]"
    return f"{where} in {n} step{'' if n == 1 else 's'}"


def at_capacity_metrics(r: Run) -> list[str]:
    """The figures the capacity table gives at each point's capacity: the SLO's own
    metrics first (slo_metrics), then throughput and the hit rate."""
    return list(dict.fromkeys(slo_metrics(r) + ["ttft_sched_p90_ms", "itl_p99_ms", "output_throughput",
                                                "prefix_cache_hit_rate"]))


def capacity_table(r: Run) -> pd.DataFrame | None:
    """Per point: capacity [95% interval] in req/s and in the search's unit, each start's
    bracket and steps, the SLO bound that decided it, the load its figures at capacity were
    measured at (each point's own: they compare configs at different loads), and those
    figures, the SLO's metrics first; with trace.windows, the hit rate per window."""
    if not is_capacity_study(r):
        return None
    over = r.study.capacity.over
    rate = lowest_load_rps(r) is not None   # a concurrency search fixes no rate: no req/s column
    wins = windows(r)
    rows = []
    for s in r.summaries:
        starts = [st for st in r.folder.point(s.point).starts() if st.capacity]
        brackets = "; ".join(f"s{st.start}: {bracket_words(st.capacity)}" + ("" if st.status == "ok" else " (failed)")
                             for st in starts)
        pc = r.capacity(s.point)
        below = pc is not None and pc.config.kind == "below"
        row = {"point": s.point, "status": status_label(s)}
        if rate:
            row["capacity (req/s)"] = capacity_cell(r, s.point)
        row |= {f"capacity ({over})": capacity_cell(r, s.point, "load"), f"{over} bracket per start": brackets,
                "binding SLO bound": binding_bound(r, s.point), "measured at": measured_at_words(r, s.point)}
        for k in at_capacity_metrics(r):
            # below lo there is no capacity to be at: its round is the lowest load's, which missed
            if k == "prefix_cache_hit_rate" and wins:   # each window's: they differ by design
                for w in wins:
                    row[f"{metrics.get(k).title} at capacity, window {w}"] = "-" if below else \
                        window_at_capacity(r, s.point, k, w)
                continue
            row[f"{metrics.get(k).title} at capacity"] = "-" if below else \
                metrics.with_interval(r.interval(s.point, k), metrics.get(k))
        if r.study.gpu_hour_price:
            row["cost per 1M output tokens"] = cost_per_million(r, s.point) or ""
        rows.append(row)
    return pd.DataFrame(rows).set_index("point") if rows else None


# -- what decides a capacity, and where its figures were measured ---------------------
def slo_metrics(r: Run) -> list[str]:
    """The metrics the SLO bounds, as they were judged: a capacity search judges a TTFT or
    E2E bound of a round sent on a schedule from the requests' scheduled arrivals
    (capacity.bracket.FROM_SCHEDULE), and that figure is shown where the run has it; the
    report's SLO verdicts (decision.slo_table) read the bound's own metric."""
    from ..capacity.bracket import FROM_SCHEDULE
    if not is_capacity_study(r):
        return list(r.slo)
    out = []
    for k in r.study.capacity.slo:
        head, _, rest = k.partition("_")
        sched = f"{FROM_SCHEDULE[head]}_{rest}" if head in FROM_SCHEDULE else None
        out.append(sched if sched and any(r.interval(s.point, sched) for s in r.summaries) else k)
    return out


def _step_bound(step: dict) -> str | None:
    """The SLO bound a missed step missed by most: the largest margin over 1 where the
    step kept its margins, else the first bound its reason names ('itl_p99_ms 258 > 150')."""
    margins = step.get("margins") or {}
    over = {k: v for k, v in margins.items() if v is not None and v > 1}
    if over:
        return max(over, key=over.get)
    word = (step.get("why") or "").split(" ", 1)[0]
    return word if word in metrics.REGISTRY else None


def binding_bound(r: Run, point: str) -> str:
    """The SLO bound that decides the point's capacity: the one its starts missed at the
    lowest load they missed (the bracket's top, or the floor); where a start never missed,
    the bound nearest its limit at the highest load ('closest'); '-' where no step says."""
    found, closest = [], []
    for c in completed_capacities(r, point):
        missed = [s for s in c.steps if not s.get("met")]
        if missed:
            b = _step_bound(min(missed, key=lambda s: s["load"]))
            found += [b] if b else []
        elif c.steps and c.steps[-1].get("margins"):
            top = max(c.steps, key=lambda s: s["load"])["margins"]
            closest.append(max(top, key=top.get))
    names = found or closest
    if not names:
        return "-"
    name = max(set(names), key=names.count)
    label = metrics.get(name).label if name in metrics.REGISTRY else name
    return label if found else f"{label} (closest; never missed)"


def load_label(r: Run, load: float) -> str:
    """A load of the search, short: '1.26x' (speed), '3.1 req/s', 'c=8'."""
    over = r.study.capacity.over
    return f"{load:.3g}x" if over == "speed" else f"{load:.3g} req/s" if over == "rate" else f"c={load:g}"


def measured_at(r: Run, point: str) -> list[float]:
    """The loads the point's figures 'at capacity' were measured at, one per completed
    start: its capacity step's, or the floor's where it missed even there."""
    out = []
    for c in completed_capacities(r, point):
        at = next((s["load"] for s in c.steps if s.get("round") == c.at_round), c.load)
        if at is not None:
            out.append(at)
    return out


def measured_at_words(r: Run, point: str) -> str:
    """measured_at in words: '1.26x', '0.8x to 1.01x' where starts differ; '-' where none."""
    loads = measured_at(r, point)
    if not loads:
        return "-"
    lo, hi = min(loads), max(loads)
    return load_label(r, lo) if np.isclose(lo, hi) else f"{load_label(r, lo)} to {load_label(r, hi)}"


def windows(r: Run) -> list[int]:
    """The trace windows the run's rounds replayed (trace.windows), [] for a run without."""
    df = r.rounds
    if df.empty or "window" not in df.columns or not df["window"].notna().any():
        return []
    return sorted(int(w) for w in df["window"].dropna().unique())


def window_at_capacity(r: Run, point: str, metric: str, window: int) -> str:
    """A windowed capacity study's figure of one window at capacity: each start's capacity
    step measured every window at its load (one round a window), and the step was judged on
    their requests pooled; the value [95% interval] of that window's rounds across starts."""
    from ..analysis import intervals
    df = r.rounds
    sel = (df["point"] == point) & (df["at_capacity"].astype(str) == "True")
    one = df.copy()
    one["at_capacity"] = sel & (df["window"] == window)
    iv = intervals.point_intervals(one[one["point"] == point], [metric])
    row = iv[(iv["point"] == point) & (iv["metric"] == metric)] if not iv.empty else iv
    return metrics.with_interval(row.iloc[0].to_dict(), metrics.get(metric)) if len(row) else "-"
