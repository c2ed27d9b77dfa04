"""Windows spread across a whole trace, and how each compares with the trace.

A study's `trace.windows: K` (with `workload.seed`) will cut K windows from across the
whole trace instead of its head, and rounds will rotate through them. The kit will call:

    whole = windows.whole_trace("mooncake_conversation")       # the full published trace
    plan = windows.plan_windows(whole, 3, seed=0, requests=200, prime="history",
                                kv_tokens=None)                # errors before any server starts
    for note in plan.notes: print(note)                        # history that runs off the start
    w = plan.windows[round_index % len(plan.windows)]
    workload_trace = w.trace(whole)                            # what TraceWorkload replays, timed from 0
    priming = whole.requests[w.history_start:w.start]          # sent first, prefill-only
    windows.summary(whole, plan)                               # the report's table, one row a window

Stratified by time: the trace's span is cut into K equal strata, and window k lies wholly
inside stratum k, at a position drawn with `seed` (each possible window of the stratum
equally likely), so the windows cover the whole trace and never overlap.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import numpy as np
import pandas as pd

from . import prefix_cache_model as pcm
from .trace_workload import fitted_workload
from ..define.params import TraceSpec
from ..define.traces import SHIPPED, DATA, Trace, TraceError, read_history, read_trace, read_whole

QUANTILES = (0.5, 0.9, 0.99)


def whole_trace(name: str) -> Trace:
    """A shipped trace in full (its shipped window is its first rows)."""
    if name not in SHIPPED:
        raise TraceError(f"{name!r} is not a shipped trace; the whole traces are {', '.join(SHIPPED)}")
    s = SHIPPED[name]
    spec = TraceSpec(file=str(DATA / s.original), format=s.format)  # no window: every request
    return replace(read_trace(spec), source=f"{s.original} ({s.format}, whole trace)")


@dataclass(frozen=True)
class Window:
    index: int                   # 0-based, in time order
    start: int                   # the window's requests are whole.requests[start:stop]
    stop: int
    stratum_s: tuple[float, float]
    history_start: int           # priming sends whole.requests[history_start:start]

    def trace(self, whole: Trace) -> Trace:
        """The window as the kit replays it: its requests timed from the first."""
        reqs = whole.requests[self.start:self.stop]
        t0 = reqs[0].t_s
        return Trace([replace(r, t_s=r.t_s - t0) for r in reqs], whole.block_tokens,
                     f"{whole.source}, window {self.index + 1}: requests {self.start + 1}-{self.stop} "
                     f"({t0:.1f} s to {reqs[-1].t_s:.1f} s)")


@dataclass(frozen=True)
class Plan:
    windows: list[Window]
    notes: list[str] = field(default_factory=list)  # statements, not errors: short history


def _strata(whole: Trace, k: int) -> list[tuple[int, int, float, float]]:
    """(first, stop, lo_s, hi_s) of K equal time strata; the last includes the last arrival."""
    t = np.array([r.t_s for r in whole.requests])
    edges = np.linspace(0.0, whole.duration_s, k + 1)
    idx = np.searchsorted(t, edges[:-1], side="left").tolist() + [len(t)]
    return [(idx[i], idx[i + 1], float(edges[i]), float(edges[i + 1])) for i in range(k)]


def plan_windows(whole: Trace, count: int, *, seed: int, requests: int | None = None,
                 duration_s: float | None = None, prime: str = "none", kv_tokens: int | None = None,
                 block_size: int = pcm.DEFAULT_BLOCK_SIZE) -> Plan:
    """`count` windows across `whole`, each `requests` long or `duration_s` long, one per
    time stratum at a seeded position. prime "history": each window's history is the
    traffic before it that a cache of kv_tokens holds (None: all of it)."""
    label = whole.source
    n, span = len(whole.requests), whole.duration_s
    if (requests is None) == (duration_s is None):
        raise TraceError(f"{label}: give the windows' length as trace.requests or trace.duration_s, one of them")
    if count < 1:
        raise TraceError(f"{label}: trace.windows is {count}; give at least 1")
    if prime not in ("none", "history"):
        raise TraceError(f"{label}: trace.prime is {prime!r}; it is history or none")
    if prime == "history" and whole.block_tokens is None:
        raise TraceError(f"{label}: trace.prime: history needs prefix ids (the cache's contents), and this trace "
                         "has none (Azure and BurstGPT rows carry lengths only); set trace.prime: none")
    if requests is not None and requests > n:
        raise TraceError(f"{label}: a window of trace.requests {requests} is longer than the trace "
                         f"({n} requests); lower trace.requests")
    if duration_s is not None and duration_s > span:
        raise TraceError(f"{label}: a window of trace.duration_s {duration_s:g} s is longer than the trace "
                         f"({span:.1f} s); lower trace.duration_s")
    strata = _strata(whole, count)
    room = [(b - a) if requests is not None else (hi - lo) for a, b, lo, hi in strata]
    need = requests if requests is not None else duration_s
    if min(room) < need:
        most = max((k for k in range(1, count) if min(
            (b - a) if requests is not None else (hi - lo) for a, b, lo, hi in _strata(whole, k)) >= need),
            default=0)
        worst = int(np.argmin(room))
        unit = "requests" if requests is not None else "s"
        raise TraceError(f"{label}: trace.windows {count} cuts the trace into {count} strata of "
                         f"{span / count:.1f} s, and stratum {worst + 1} holds {room[worst]:g} {unit}, fewer than "
                         f"a window's {need:g}; the trace holds at most {most} such windows: lower trace.windows "
                         f"or the window's length")
    rng = np.random.default_rng(seed)
    t = [r.t_s for r in whole.requests]
    windows, notes = [], []
    for k, (a, b, lo, hi) in enumerate(strata):
        if requests is not None:
            start = a + int(rng.integers(0, b - a - requests + 1))
            stop = start + requests
        else:
            t0 = lo + float(rng.uniform(0.0, hi - lo - duration_s))
            start = int(np.searchsorted(t, t0, side="left"))
            stop = int(np.searchsorted(t, t0 + duration_s, side="left"))
            if stop == start:
                raise TraceError(f"{label}: window {k + 1} ({t0:.1f} s to {t0 + duration_s:.1f} s) holds no "
                                 f"request; widen trace.duration_s")
        h, full = (pcm.history_start(whole.requests, start, block_tokens=whole.block_tokens,
                                     kv_tokens=kv_tokens, block_size=block_size)
                   if prime == "history" else (start, True))
        windows.append(Window(k, start, stop, (lo, hi), h))
        if not full:
            held = sum(r.input_tokens for r in whole.requests[:start])
            size = f"the {kv_tokens:,}-token cache" if kv_tokens is not None else "a cache that never evicts"
            notes.append(f"window {k + 1} (from {t[start]:.1f} s): its history runs off the trace's start: "
                         f"{t[start]:.1f} s, {start} requests, {held:,} prompt tokens of history, less than "
                         f"{size} would hold; its cache starts part cold")
    return Plan(windows, notes)


def _row(name: str, reqs, whole: Trace, start: int, stop: int) -> dict:
    ins = np.array([r.input_tokens for r in reqs])
    outs = np.array([r.output_tokens for r in reqs])
    span = reqs[-1].t_s - reqs[0].t_s
    row = {"window": name, "start_s": reqs[0].t_s, "end_s": reqs[-1].t_s, "requests": len(reqs),
           "rate_rps": (len(reqs) - 1) / span if span > 0 else math.inf}
    for q in QUANTILES:
        row[f"input_p{q * 100:g}"] = float(np.quantile(ins, q))
    for q in QUANTILES:
        row[f"output_p{q * 100:g}"] = float(np.quantile(outs, q))
    if whole.block_tokens is not None:
        for hist, col in ((False, "reuse_alone"), (True, "reuse_with_history")):
            hit, total = pcm.bound_hit_tokens(whole, start, stop, with_history=hist)
            row[col] = hit / total
    return row


def summary(whole: Trace, plan: Plan) -> pd.DataFrame:
    """One row for the whole trace, then one per window: arrival rate (arrivals less one
    over the span), input and output length quantiles, and the never-evicting reuse at
    the trace's block size, within the window alone and with all its earlier traffic.
    These describe the windows themselves (the whole population of their requests),
    not estimates: no interval."""
    rows = [_row("whole trace", whole.requests, whole, 0, len(whole.requests))]
    for w in plan.windows:
        rows.append(_row(f"window {w.index + 1}", whole.requests[w.start:w.stop], whole, w.start, w.stop))
    return pd.DataFrame(rows).set_index("window")


# ---------------------------------------------------------------- a study's windows

@dataclass
class WindowSet:
    """A start's windows: the whole trace, the plan, and one TraceWorkload a window (each
    fit to the server's max_model_len). Round r replays window r % K."""
    whole: Trace
    plan: Plan
    workloads: list

    def pick(self, round_index: int) -> int:
        return round_index % len(self.plan.windows)

    def expected_hit_rate(self) -> float | None:
        """The never-evicting bound's mean over the windows (each round records its own)."""
        rates = [wl.expected_hit_rate() for wl in self.workloads]
        return sum(rates) / len(rates) if None not in rates else None


def for_study(spec: TraceSpec, seed: int, *, kv_tokens: int | None = None,
              block_size: int = pcm.DEFAULT_BLOCK_SIZE) -> tuple[Trace, Plan]:
    """The whole trace and the study's windows of it (spec.windows of them, seeded by
    workload.seed)."""
    whole = read_whole(spec)  # a shipped name's full original, else the whole file
    return whole, plan_windows(whole, spec.windows, seed=seed, requests=spec.requests, duration_s=spec.duration_s,
                               prime=spec.prime, kv_tokens=kv_tokens, block_size=block_size)


def build(tokenizer, w, max_model_len: int | None) -> tuple[WindowSet, dict]:
    """A start's windows of params.Workload `w` (trace.windows), each fit to the server's
    max_model_len and built as a TraceWorkload, and the start's trace record: the windows
    summed, each listed (first and last: 0-based indices into the whole trace)."""
    whole, plan = for_study(w.trace, w.seed)
    loads, rows = [], []
    for x in plan.windows:
        wl, fitted = fitted_workload(tokenizer, w, x.trace(whole), max_model_len)
        loads.append(wl)
        rows.append({"window": x.index + 1, "first": x.start, "last": x.stop - 1, **fitted})
    gaps, span = sum(r["requests"] - 1 for r in rows), sum(r["duration_s"] for r in rows)
    record = {"source": f"{whole.source}, {len(rows)} windows", "format": w.trace.format, "start_s": 0.0,
              "requests": sum(r["requests"] for r in rows),
              "dropped_over_max_model_len": sum(r["dropped_over_max_model_len"] for r in rows),
              "max_model_len": max_model_len, "skipped": whole.skipped, "inexact": sum(r["inexact"] for r in rows),
              "prompt_floor": loads[0].prompt_floor,
              # the windows' arrivals pooled: their gaps over their spans
              "rate": gaps / span if span > 0 else math.inf, "duration_s": span, "windows": rows}
    return WindowSet(whole, plan, loads), record


def _history_block_tokens(whole: Trace, starts: list[int]) -> dict[int, int]:
    """For each start, the tokens of the distinct prefix blocks before it (trace blocks,
    counted whole): the most a cache could hold of that history."""
    seen, out, todo = set(), {}, sorted(set(starts))
    j = 0
    for s in todo:
        for r in whole.requests[j:s]:
            seen.update(r.prefix or ())
        j = s
        out[s] = len(seen) * (whole.block_tokens or 0)
    return out


def history_tokens(spec: TraceSpec, seed: int) -> list[int]:
    """Per window the study replays (one without trace.windows), the tokens of the
    distinct prefix blocks before it in the file: the most priming can prefill for it,
    whatever the KV cache holds (the dry run's priming estimate)."""
    if spec.windows:
        whole, plan = for_study(spec, seed)
        starts = [x.start for x in plan.windows]
        history = _history_block_tokens(whole, starts)
        return [history[s] for s in starts]
    rows = read_history(spec)
    return [len({b for r in rows for b in (r.prefix or ())}) * (_block_tokens_of(spec) or 0)]


def _block_tokens_of(spec: TraceSpec) -> int | None:
    return read_trace(spec).block_tokens


def study_statements(study, max_model_lens, kv_tokens: int | None = None) -> list[str]:
    """What the dry run and the sweep say of a study's trace windows before any server
    starts: each window, what of it a server of each max_model_len leaves out, its
    history (prime: history), how a capacity search samples them. Raises TraceError
    where the windows cannot be cut, or a window has no request a server can take.
    kv_tokens: the server's KV size where known; before a start it is not (a GPU's
    depends on what the model leaves free), so each window's history is stated with
    the most a cache could hold of it, and plan_windows' notes (at a never-evicting
    cache, every window's history "runs off the start") are left to the start's record."""
    spec, w = study.workload.trace, study.workload
    whole, plan = for_study(spec, w.seed, kv_tokens=kv_tokens)
    k = len(plan.windows)
    lines = [f"workload.trace.windows {k}: {whole.source}, {len(whole.requests)} requests over "
             f"{whole.duration_s:.1f} s, cut into {k} time strata of {whole.duration_s / k:.1f} s with one window "
             f"each (seed {w.seed}); measured round r replays window r % {k}; warm-up draws on window 1"]
    history = _history_block_tokens(whole, [x.start for x in plan.windows]) if spec.prime == "history" else {}
    for x in plan.windows:
        t = x.trace(whole)
        line = (f"window {x.index + 1}: requests {x.start + 1}-{x.stop} of the trace ({whole.requests[x.start].t_s:.1f}"
                f" s to {whole.requests[x.stop - 1].t_s:.1f} s, {t.rate:.2f} req/s)")
        for mml in sorted(m for m in set(max_model_lens) if m):
            _, dropped = t.fit(mml)  # a window none of whose requests fits: TraceError
            if dropped:
                line += f"; {dropped} of its {len(t.requests)} requests are longer than max_model_len={mml}, left out"
        if spec.prime == "history":
            line += (f"; history before it: {x.start} requests, "
                     f"{sum(r.input_tokens for r in whole.requests[:x.start]):,} prompt tokens, about "
                     f"{history[x.start]:,} tokens of distinct prefix blocks: a server whose KV cache holds more "
                     "starts this window part cold (its start's record says so at the server's size)")
        lines.append(line)
    if kv_tokens is not None:
        lines += plan.notes
    if spec.prime == "history":  # the estimate counts it from a KV size it models (define/timing.py)
        lines.append("priming: each round of a server with prefix caching first sends about its KV cache's size in "
                     "history, prefill-only (one H200, Qwen2.5-7B, 2.1M tokens: 58 s a round); a server without "
                     "caching is not primed")
    if study.capacity:
        lines.append(f"capacity: each step of the bracket measures all {k} windows at its load, one round each "
                     f"({k} rounds a step), and judges their requests pooled (docs/capacity.md)")
    elif study.rounds % k:
        lines.append(f"rounds {study.rounds} is not a multiple of trace.windows {k}: windows 1 to "
                     f"{study.rounds % k} get one round more than the others")
    return lines
