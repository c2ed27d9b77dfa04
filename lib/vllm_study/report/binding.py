"""Did each knob bind? The report's evidence per axis: KV-cache pressure, long prefills
against the chunk budget, and the Prefix Reuse Budget's deferrals."""
from __future__ import annotations

import pandas as pd

from ..analysis import intervals
from ..vocab import axes
from ..vocab.axes import SCHEDULER_AXIS
from .run import Run


# -- did each knob bind? ----------------------------------------------------------
KV_BOUND = 0.9          # KV usage peak at or above this share: memory was in short supply
EVICTION_GAP = 0.05     # a hit rate this far below the study's best: prefixes were evicted


def _per_point(r: Run, metric: str, how: str) -> pd.Series:
    """One metric aggregated over each point's measured rounds (whole rounds only)."""
    df = intervals.ok_rounds(r.rounds)
    if df.empty or metric not in df.columns or df[metric].isna().all():
        return pd.Series(dtype=float)
    return df.groupby("point")[metric].agg(how).dropna()


# (column, metric, aggregate over rounds, format). Each column names its aggregate: the
# per-point tables show a metric's value (medians of starts' rounds, averaged) with its interval,
# so a maximum here (the largest any round reached) may lie above that interval.
BINDING = [("KV peak (max over rounds)", "kv_usage_peak", "max", ".1%"),
           ("preemptions (sum over rounds)", "preemptions", "sum", ".0f"),
           ("prefills > chunk (median)", "long_prefills", "median", ".0f"),
           ("running peak (max over rounds)", "running_peak", "max", ".0f"),
           ("hit rate (median)", "prefix_cache_hit_rate", "median", ".3f"),
           ("hit if no eviction (median)", "expected_prefix_hit_rate", "median", ".3f")]


def binding_table(r: Run) -> pd.DataFrame:
    """Per point, vLLM's own evidence of which limits it ran into: KV cache peak (the
    maximum over rounds) and preemptions (summed over rounds) for memory, prefills longer
    than the chunk (chunk size), the running requests' peak (maximum over rounds) against
    max_num_seqs, measured vs never-evicting hit rate (medians over rounds). Each column
    names its aggregate."""
    if not r.measured:
        return pd.DataFrame({"note": ["(nothing measured)"]})
    t = pd.DataFrame(index=pd.Index([s.point for s in r.measured], name="point"))
    for col, metric, how, fmt in BINDING:
        v = _per_point(r, metric, how)
        if not v.empty:
            t[col] = [format(v[p], fmt) if p in v else "" for p in t.index]
    t["max seqs"] = [s.effective.max_num_seqs if s.effective else "" for s in r.measured]
    return t


def binding_notes(r: Run) -> list[str]:
    """One sentence per grid axis: did it bind anywhere, and on what evidence. An axis
    that never bound is named: the study cannot show its effect."""
    notes = []
    kv, pre = _per_point(r, "kv_usage_peak", "max"), _per_point(r, "preemptions", "sum")
    longp = _per_point(r, "long_prefills", "median")
    for axis in r.axes:
        binds = axes.get(axis).binds
        if binds == "kv":
            if kv.empty:
                notes.append(f"{axis}: no KV usage was sampled, so the study cannot say whether it bound")
                continue
            # every point runs the same requests: a hit rate well below the best one's means
            # cached prefixes were evicted for lack of room
            hits = _per_point(r, "prefix_cache_hit_rate", "median")
            evicted = set(hits[hits < hits.max() - EVICTION_GAP].index) if not hits.empty else set()
            bound = sorted(set(kv[kv >= KV_BOUND].index) | set(pre[pre > 0].index) | evicted)
            if bound:
                notes.append(f"{axis} bound at {len(bound)} of {len(kv)} points (KV peak, maximum over rounds, "
                             f">= {KV_BOUND:.0%}, preemptions, or a median prefix-cache hit rate {EVICTION_GAP:.2f} "
                             f"or more below the study's best: evictions): {', '.join(bound)}")
            else:
                notes.append(f"{axis} never bound: KV peak (maximum over rounds) at most {kv.max():.1%} at "
                             "every point and no preemption; this study cannot show its effect")
        elif binds == "chunk":
            notes.append(_chunk_binding(r, axis, longp))
        elif binds == "seqs":
            running = _per_point(r, "running_peak", "max")
            caps = {s.point: s.effective.max_num_seqs for s in r.measured if s.effective}
            bound = sorted(p for p, v in running.items() if p in caps and v >= caps[p])
            notes.append(f"{axis} bound (running requests, maximum over rounds, reached it) at: "
                         f"{', '.join(bound)}" if bound else
                         f"{axis} never bound: running requests stayed below max_num_seqs at every point")
        elif binds == "scheduler":
            budget = _scheduler_evidence(r)
            if budget and not budget["bound"]:  # where it deferred somewhere, the axis-effects cell says where
                notes.append(scheduler_binding(r))
    return notes


def _chunk_binding(r: Run, axis: str, longp: pd.Series) -> str:
    """The chunk size binds where a prompt needs more than one step to prefill. Exact
    where the server took the kit's histogram bound (the counted edge is the chunk
    itself); otherwise vLLM's default buckets count prefills above a bound below the chunk,
    and the note says so instead of claiming more."""
    if longp.empty:
        return f"{axis}: the server did not report prefill lengths, so the study cannot say whether it bound"
    edge = _per_point(r, "long_prefill_edge_tokens", "max")
    mbt = {s.point: (s.effective.max_num_batched_tokens if s.effective else None) for s in r.measured}
    exact = {p for p in longp.index if p in edge and mbt.get(p) and edge[p] >= mbt[p]}
    bound = sorted(p for p in exact if longp[p] > 0)
    unknown = sorted(p for p in longp.index if p not in exact and longp[p] > 0)
    parts = []
    if bound:
        parts.append(f"{axis} bound at {len(bound)} of {len(longp)} points (prefills longer than the chunk, "
                     f"split over steps): {', '.join(bound)}")
    if unknown:
        at = ", ".join(f"{p} (above {edge[p]:.0f})" if p in edge else f"{p} (bound not recorded)"
                       for p in unknown)
        parts.append(f"{axis}: this vLLM counts prefill lengths only in coarse buckets (no "
                     f"--custom-histogram-buckets), so prefills were counted above a bound below the chunk, "
                     f"and whether the chunk split them is not known at: {at}")
    if not parts:
        return f"{axis} never bound: no prefill was longer than the chunk; this study cannot show its effect"
    return "; ".join(parts)


# -- the scheduler axis: did the budget bind, and an axis's effect per request group ----
def scheduler_axis(r: Run) -> str | None:
    """min_reuse_ratio where the study sweeps the Prefix Reuse Budget (several values of
    scheduler.min_reuse_ratio make it an axis of the points' values, beside the grid)."""
    return SCHEDULER_AXIS if SCHEDULER_AXIS in r.axes else None


def same_value(a, b) -> bool:
    return a == b or str(a) == str(b)


def _budget_points(r: Run, axis: str) -> list[str]:
    """Measured points that ran with the budget (min_reuse_ratio not off)."""
    return [s.point for s in r.measured if axis in s.values and not same_value(s.values[axis], "off")]


def _scheduler_evidence(r: Run) -> dict | None:
    """The budget's points, split by its counters over every measured round: bound (a
    request deferred in some round), never (no request deferred in any round), unknown
    (no counter recorded); None where the study has no scheduler axis or no budget point
    was measured."""
    axis = scheduler_axis(r)
    points = _budget_points(r, axis) if axis else []
    if not points:
        return None
    deferred = _per_point(r, "pb_deferred", "max")
    return {"axis": axis, "points": points, "bound": sorted(p for p in points if p in deferred and deferred[p] > 0),
            "never": sorted(p for p in points if p in deferred and deferred[p] <= 0),
            "unknown": sorted(p for p in points if p not in deferred)}


def scheduler_binding(r: Run) -> str | None:
    """One sentence: where the budget bound (deferred a request in some round) and where
    it never did (none in any round: there the study cannot show its effect)."""
    ev = _scheduler_evidence(r)
    if ev is None:
        return None
    axis, n = ev["axis"], len(ev["points"])
    if not ev["bound"] and not ev["never"]:
        return (f"{axis}: the budget's counters were not recorded at its {n} point(s), so the study cannot say "
                "whether it bound")
    if not ev["bound"]:
        return (f"{axis} never bound: the budget deferred no request in any round at any of its {n} point(s) "
                f"({', '.join(ev['never'])}); this study cannot show its effect")
    parts = [f"{axis} bound at {len(ev['bound'])} of {n} budget point(s) (requests deferred in a round): "
             + ", ".join(ev["bound"])]
    if ev["never"]:
        parts.append("it never bound (no request deferred in any round; no effect to show there) at: "
                     + ", ".join(ev["never"]))
    if ev["unknown"]:
        parts.append("the budget's counters were not recorded at: " + ", ".join(ev["unknown"]))
    return "; ".join(parts)


DEFERRAL_COUNTS = (("deferred", "pb_deferred"), ("let in by the age bound", "pb_admitted_by_age"),
                   ("let in while idle", "pb_admitted_idle"))
DEFERRAL_TIMES = (("defer P50 (ms)", "pb_defer_ms_p50"), ("defer P99 (ms)", "pb_defer_ms_p99"))


def _median_range(v: pd.Series, fmt: str) -> str:
    return f"{format(v.median(), fmt)} ({format(v.min(), fmt)} to {format(v.max(), fmt)})"


def _column(rounds: pd.DataFrame, col: str) -> pd.Series:
    """A column's recorded values (none where the rounds lack it)."""
    return rounds[col].dropna() if col in rounds.columns else pd.Series(dtype=float)


def deferral_table(r: Run) -> pd.DataFrame | None:
    """Per point with the budget: requests deferred per round, and how many of those the
    age bound and the idle rule let in, as the median over its measured rounds with the
    range (min to max); the hold times likewise; whether it bound (never: it deferred no
    request in any round). None without a scheduler axis."""
    ev = _scheduler_evidence(r)
    if ev is None:
        return None
    axis, df = ev["axis"], intervals.ok_rounds(r.rounds)
    rows = []
    for p in ev["points"]:
        g = df[df["point"] == p]
        row = {"point": p, axis: axes.get(axis).fmt(next(s.values[axis] for s in r.measured if s.point == p)),
               "rounds": len(_column(g, "pb_deferred"))}
        for label, col in DEFERRAL_COUNTS:
            v = _column(g, col)
            row[f"{label} per round"] = _median_range(v, "g") if len(v) else "not recorded"
        for label, col in DEFERRAL_TIMES:
            v = _column(g, col)
            row[label] = _median_range(v, ".0f") if len(v) else ""
        row["bound"] = "yes" if p in ev["bound"] else "never" if p in ev["never"] else "not known"  # in no round
        rows.append(row)
    return pd.DataFrame(rows).set_index("point")
