"""Statistics, in one place: per-round figures from per-request results, and per-point
estimates (median, 95% interval, range) across rounds and server starts.

Round figures use the metric registry's names (metrics.py says what each one is).
Per point, the interval is a hierarchical bootstrap of the median: resample server
starts with replacement, then rounds within each drawn start, take the median of the
pooled draw; 2,000 times; the 2.5th and 97.5th percentiles. It respects the nesting
(rounds of one start share that start's state), so start-to-start variation widens
the interval as it should; with a single start it covers round-to-round variation
only, and says so in its method. Seeded: a report re-renders to the same numbers.
"""
from __future__ import annotations

import zlib
from collections import Counter
from collections.abc import Sequence

import numpy as np

from .metrics import GROUP_METRICS, PERCENTILES
from .results import Estimate, GroupRecord, RoundRecord

BOOTSTRAP = 2000
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


def _meets(r: dict, slo) -> bool:
    if slo.ttft_ms and r["ttft_s"] * 1000 > slo.ttft_ms:
        return False
    t = tpot_s(r)
    return not (slo.tpot_ms and t is not None and t * 1000 > slo.tpot_ms)


def round_metrics(results: list[dict], duration_s: float | None, slo=None) -> dict:
    """A round's figures; `results` are client.RequestResult.to_dict() rows and
    duration_s its first send to last finish (None for a subset, e.g. one class)."""
    ok = [r for r in results if r["error"] is None]
    out = {"requests": len(results), "completed": len(ok), "failed": len(results) - len(ok),
           "duration_s": duration_s}
    out |= _dist("ttft", [r["ttft_s"] for r in ok])
    out |= _dist("itl", [g for r in ok for g in r["itl_s"]])
    out |= _dist("tpot", [t for t in map(tpot_s, ok) if t is not None])
    out |= _dist("e2e", [r["e2e_s"] for r in ok])
    out_tokens = sum(r["output_tokens"] or 0 for r in ok)
    in_tokens = sum(r["prompt_tokens"] or 0 for r in ok)
    out["output_tokens"], out["prompt_tokens"] = out_tokens, in_tokens
    per_s = (lambda x: x / duration_s) if duration_s else (lambda x: None)
    out["request_throughput"] = per_s(len(ok))
    out["output_throughput"] = per_s(out_tokens)
    out["total_token_throughput"] = per_s(in_tokens + out_tokens)
    if slo is not None and (slo.ttft_ms or slo.tpot_ms):
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


# -- estimates across rounds and starts ------------------------------------------
def _seed(*parts) -> int:
    return zlib.crc32("/".join(map(str, parts)).encode())


def bootstrap_medians(by_start: Sequence[Sequence[float]], n: int = BOOTSTRAP, seed: int = 0) -> np.ndarray:
    """n bootstrap replicates of the median: starts drawn with replacement, then each
    drawn start's rounds drawn with replacement (as many as it has)."""
    groups = [np.asarray(g, dtype=float) for g in by_start if len(g)]
    rng = np.random.default_rng(seed)
    counts = np.array([len(g) for g in groups])
    width = counts.max()
    table = np.full((len(groups), width), np.nan)
    for i, g in enumerate(groups):
        table[i, :len(g)] = g
    pick = rng.integers(0, len(groups), size=(n, len(groups)))           # which start in each slot
    k = counts[pick]                                                     # its number of rounds
    draw = np.floor(rng.random((n, len(groups), width)) * k[..., None]).astype(int)
    vals = table[pick[..., None], draw]
    vals[np.arange(width)[None, None, :] >= k[..., None]] = np.nan       # a start gives its own count
    return np.nanmedian(vals.reshape(n, -1), axis=1)


def estimate(by_start: Sequence[Sequence[float]], seed: int = 0) -> Estimate | None:
    """Median over all rounds, with its 95% hierarchical-bootstrap interval and range."""
    groups = [[float(x) for x in g if x is not None and np.isfinite(x)] for g in by_start]
    groups = [g for g in groups if g]
    if not groups:
        return None
    pooled = np.concatenate(groups)
    boot = bootstrap_medians(groups, seed=seed)
    lo, hi = np.percentile(boot, [2.5, 97.5])
    method = "hierarchical bootstrap, 95%" if len(groups) > 1 else \
        "bootstrap over rounds, 95% (one server start: start-to-start variation not covered)"
    return Estimate(median=float(np.median(pooled)), ci_low=float(lo), ci_high=float(hi),
                    min=float(pooled.min()), max=float(pooled.max()), rounds=len(pooled),
                    starts=len(groups), method=method)


def _by_start(rounds: list[RoundRecord], value) -> list[list[float]]:
    starts: dict[int, list[float]] = {}
    for r in rounds:
        v = value(r)
        if v is not None:
            starts.setdefault(r.start, []).append(v)
    return [starts[k] for k in sorted(starts)]


def point_estimates(rounds: list[RoundRecord], point: str = "") -> dict[str, Estimate]:
    """Every metric of a point's ok rounds (seeded by point and metric)."""
    ok = [r for r in rounds if r.status == "ok"]
    names = sorted({k for r in ok for k, v in r.metrics.items() if v is not None})
    out = {}
    for m in names:
        e = estimate(_by_start(ok, lambda r: r.metrics.get(m)), seed=_seed(point, m))
        if e is not None:
            out[m] = e
    return out


def group_estimates(rounds: list[RoundRecord], point: str = "") -> dict[str, dict[str, Estimate]]:
    """Per group label ("class=long") and metric."""
    ok = [r for r in rounds if r.status == "ok"]
    labels = sorted({(g.key, g.value) for r in ok for g in r.groups})
    out = {}
    for key, value in labels:
        def pick(r, m):
            g = next((g for g in r.groups if g.key == key and g.value == value), None)
            return g.metrics.get(m) if g else None
        label = f"{key}={value}"
        ests = {m: estimate(_by_start(ok, lambda r: pick(r, m)), seed=_seed(point, label, m))
                for m in GROUP_METRICS}
        out[label] = {m: e for m, e in ests.items() if e is not None}
    return out

