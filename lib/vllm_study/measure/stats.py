"""Per-round figures from per-request results, and a point's figures across its rounds
and server starts (median, range, each start's median).

Round figures use the metric registry's names (metrics.py says what each one is).
Intervals, comparisons and the noise floor are computed over a whole run, in
analysis.py.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import numpy as np

from ..vocab.metrics import FAILURES_COUNT, GROUP_METRICS, PERCENTILES, REQUEST_ITL, request_itl_figure, request_itl_ms
from ..records.results import Estimate, GroupRecord, RoundRecord

GROUP_KEYS = ("class", "turn", "step", "prefix")  # tags the workloads and load models set


def _dist(name: str, xs_s: list[float]) -> dict:
    xs = np.asarray(xs_s, dtype=float) * 1000.0
    keys = ["mean", "std", *(f"p{p}" for p in PERCENTILES)]
    if xs.size == 0:
        return {f"{name}_{k}_ms": None for k in keys}
    out = {f"{name}_mean_ms": float(xs.mean()), f"{name}_std_ms": float(xs.std())}
    out.update({f"{name}_p{p}_ms": float(np.percentile(xs, p)) for p in PERCENTILES})
    return out


def tpot_s(r: dict) -> float | None:
    """(E2E - TTFT) / (output tokens - 1); None below two output tokens."""
    n = r["output_tokens"]
    return (r["e2e_s"] - r["ttft_s"]) / (n - 1) if n and n > 1 else None


def request_value_ms(r: dict, bound: str) -> float | None:
    """One request's own figure for an SLO bound name (ttft_p99_ms -> its TTFT; itl_p99_ms
    -> the P99 of its own gaps; stall_p90_ms -> its longest gap; itl_mean_p90_ms -> its mean
    gap; tpot_* -> its TPOT; e2e_* -> its E2E), in ms."""
    figure = request_itl_figure(bound)
    if figure:
        return request_itl_ms(r["itl_s"], figure)
    lat, stat, _ = bound.split("_")
    if lat == "itl":
        gaps = r["itl_s"]
        if not gaps:
            return None
        v = float(np.mean(gaps)) if stat == "mean" else float(np.percentile(gaps, int(stat[1:])))
    elif lat == "tpot":
        v = tpot_s(r)
    else:
        v = r[f"{lat}_s"]
    return None if v is None else v * 1000


def _meets(r: dict, slo: dict[str, float]) -> bool:
    """A request meets the SLO when its own figure is within every bound."""
    for bound, limit in slo.items():
        v = request_value_ms(r, bound)
        if v is not None and v > limit:
            return False
    return True


def round_metrics(results: list[dict], duration_s: float | None, slo=None) -> dict:
    """A round's figures; `results` are client.RequestResult.to_dict() rows and
    duration_s its first send to last finish (None for a subset, e.g. one class)."""
    ok = [r for r in results if r["error"] is None]
    out = {"requests": len(results), "completed": len(ok), "failed": len(results) - len(ok),
           "duration_s": duration_s}
    out |= _dist("ttft", [r["ttft_s"] for r in ok])
    out |= _dist("itl", [g for r in ok for g in r["itl_s"]])
    for figure in REQUEST_ITL:   # per request, then percentiles over requests (metrics.REQUEST_ITL)
        d = _dist(figure, [REQUEST_ITL[figure][2](r["itl_s"]) for r in ok if r["itl_s"]])
        out |= {f"{figure}_p{p}_ms": d[f"{figure}_p{p}_ms"] for p in PERCENTILES}
    out |= _dist("tpot", [t for t in map(tpot_s, ok) if t is not None])
    out |= _dist("e2e", [r["e2e_s"] for r in ok])
    due = [r for r in results if r.get("due_time") is not None]
    if due:  # open loop: from the schedule, and how late the sends were
        sched = [r for r in ok if r.get("due_time") is not None]
        late = [r["send_time"] - r["due_time"] for r in sched]
        for name, key in (("ttft_sched", "ttft_s"), ("e2e_sched", "e2e_s")):  # (no std: the registry has none)
            d = _dist(name, [r[key] + lag for r, lag in zip(sched, late)])
            out |= {k: v for k, v in d.items() if "_std_" not in k}
        lat = _dist("send_lateness", late)
        out |= {f"send_lateness_{s}_ms": lat[f"send_lateness_{s}_ms"] for s in ("p50", "p99")}
        out["send_lateness_max_ms"] = max(late) * 1000 if late else None
        span = max(r["due_time"] for r in due) - min(r["due_time"] for r in due)
        out["offered_rate"] = (len(due) - 1) / span if span > 0 else None
    out_tokens = sum(r["output_tokens"] or 0 for r in ok)
    in_tokens = sum(r["prompt_tokens"] or 0 for r in ok)
    out["output_tokens"], out["prompt_tokens"] = out_tokens, in_tokens
    per_s = (lambda x: x / duration_s) if duration_s else (lambda x: None)
    out["request_throughput"] = per_s(len(ok))
    out["output_throughput"] = per_s(out_tokens)
    out["total_token_throughput"] = per_s(in_tokens + out_tokens)
    if slo:
        good = sum(1 for r in ok if _meets(r, slo))
        out["goodput"] = per_s(good)
        out["slo_attainment"] = good / len(results) if results else None
    return out


def errors(results: list[dict]) -> dict[str, int]:
    return dict(Counter(r["error"] for r in results if r["error"]))


def group_records(results: list[dict]) -> list[GroupRecord]:
    """Per request class (long/short), turn, ladder step or prefix: the same figures
    for the requests that carry that tag."""
    out = []
    for key in GROUP_KEYS:
        values = sorted({r["tags"][key] for r in results if key in r.get("tags", {})})
        for v in values:
            sub = [r for r in results if r.get("tags", {}).get(key) == v]
            m = round_metrics(sub, None)
            out.append(GroupRecord(key=key, value=f"{v:g}" if isinstance(v, float) else str(v),
                                   metrics={k: m[k] for k in GROUP_METRICS}))
    return out


# -- a point's figures across its rounds and starts ---------------------------------
def estimate(by_start: Sequence[Sequence[float | None]]) -> Estimate | None:
    """Median, range and each start's median over a point's rounds (grouped by start).
    Intervals need the whole run (the start-to-start spread is pooled over points):
    analysis.py computes them."""
    groups = [[float(x) for x in g if x is not None and np.isfinite(x)] for g in by_start]
    groups = [g for g in groups if g]
    if not groups:
        return None
    pooled = np.concatenate(groups)
    return Estimate(median=float(np.median(pooled)), min=float(pooled.min()), max=float(pooled.max()),
                    rounds=len(pooled), starts=len(groups), start_medians=[float(np.median(g)) for g in groups])


def _by_start(rounds: list[RoundRecord], value) -> list[list[float]]:
    starts: dict[int, list[float]] = {}
    for r in rounds:
        v = value(r)
        if v is not None:
            starts.setdefault(r.start, []).append(v)
    return [starts[k] for k in sorted(starts)]


def point_estimates(rounds: list[RoundRecord]) -> dict[str, Estimate]:
    """Every metric of a point's ok rounds; metrics.FAILURES_COUNT of its failed rounds too."""
    ok = [r for r in rounds if r.status == "ok"]
    names = sorted({k for r in rounds for k, v in r.metrics.items() if v is not None})
    out = {m: estimate(_by_start(rounds if m in FAILURES_COUNT else ok, lambda r: r.metrics.get(m)))
           for m in names}
    return {m: e for m, e in out.items() if e is not None}


def group_estimates(rounds: list[RoundRecord]) -> dict[str, dict[str, Estimate]]:
    """Per group label ("class=long") and metric."""
    ok = [r for r in rounds if r.status == "ok"]
    out = {}
    for key, value in sorted({(g.key, g.value) for r in ok for g in r.groups}):
        def pick(r, m):
            g = next((g for g in r.groups if g.key == key and g.value == value), None)
            return g.metrics.get(m) if g else None
        ests = {m: estimate(_by_start(ok, lambda r: pick(r, m))) for m in GROUP_METRICS}
        out[f"{key}={value}"] = {m: e for m, e in ests.items() if e is not None}
    return out
