"""Per-round statistics from per-request results, and per-point medians across rounds.

Names follow vLLM's benchmarks: TTFT (first token), ITL (every gap between streamed
content chunks, pooled over a round's requests; = TBT), TPOT ((E2E - TTFT) / (output
tokens - 1) per request), E2E. GuideLLM and AIPerf call TPOT "ITL"; LLMPerf's ITL
includes TTFT. Times are reported in milliseconds.
"""
from __future__ import annotations

from collections import Counter

import numpy as np
import pandas as pd

PERCENTILES = (50, 90, 99)
LATENCIES = ("ttft", "itl", "tpot", "e2e")


def _dist(name: str, xs_s: list[float]) -> dict:
    xs = np.asarray(xs_s, dtype=float) * 1000.0
    if xs.size == 0:
        return {f"{name}_{k}_ms": None for k in ("mean", "std", *(f"p{p}" for p in PERCENTILES))}
    out = {f"{name}_mean_ms": float(xs.mean()), f"{name}_std_ms": float(xs.std())}
    out.update({f"{name}_p{p}_ms": float(np.percentile(xs, p)) for p in PERCENTILES})
    return out


def tpot_s(r: dict) -> float | None:
    """(E2E - TTFT) / (output tokens - 1); None below two output tokens."""
    n = r["output_tokens"]
    return (r["e2e_s"] - r["ttft_s"]) / (n - 1) if n and n > 1 else None


def round_stats(results: list[dict], duration_s: float, slo_ttft_ms: float | None = None,
                slo_tpot_ms: float | None = None) -> dict:
    """Statistics of one round; `results` are RequestResult.to_dict() rows."""
    ok = [r for r in results if r["error"] is None]
    tpot = [t for t in map(tpot_s, ok) if t is not None]
    out = {"requests": len(results), "completed": len(ok), "failed": len(results) - len(ok),
           "errors": dict(Counter(r["error"] for r in results if r["error"])),
           "duration_s": duration_s}
    out |= _dist("ttft", [r["ttft_s"] for r in ok])
    out |= _dist("itl", [g for r in ok for g in r["itl_s"]])
    out |= _dist("tpot", tpot)
    out |= _dist("e2e", [r["e2e_s"] for r in ok])
    out_tokens = sum(r["output_tokens"] or 0 for r in ok)
    in_tokens = sum(r["prompt_tokens"] or 0 for r in ok)
    out["output_tokens"] = out_tokens
    out["prompt_tokens"] = in_tokens
    out["request_throughput"] = len(ok) / duration_s if duration_s else None
    out["output_throughput"] = out_tokens / duration_s if duration_s else None
    out["total_token_throughput"] = (in_tokens + out_tokens) / duration_s if duration_s else None
    if slo_ttft_ms or slo_tpot_ms:
        def meets(r):
            t = r["ttft_s"] * 1000 <= slo_ttft_ms if slo_ttft_ms else True
            if slo_tpot_ms and tpot_s(r) is not None:
                t = t and tpot_s(r) * 1000 <= slo_tpot_ms
            return t
        good = sum(1 for r in ok if meets(r))
        out["goodput"] = good / duration_s if duration_s else None
        out["slo_attainment"] = good / len(results) if results else None
    return out


def point_medians(rounds: list[dict]) -> dict:
    """Median of every numeric metric across rounds, with min and max beside it."""
    df = pd.DataFrame(rounds).drop(columns=["round"], errors="ignore")
    # all-None columns (GPU fields on a CPU) stay, as None: absent, not forgotten
    df = df[[c for c in df if df[c].isna().all() or pd.api.types.is_numeric_dtype(df[c])]]
    out = {}
    for col in df.columns:
        s = df[col].dropna()
        if s.empty:
            out[col] = None
            continue
        out[col] = float(s.median())
        out[f"{col}__min"] = float(s.min())
        out[f"{col}__max"] = float(s.max())
    return out


GROUP_KEYS = ("class", "turn", "step")  # tags the workloads and load models set
GROUP_METRICS = ("ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p90_ms",
                 "itl_p99_ms", "tpot_p50_ms", "e2e_p50_ms")


def group_stats(results: list[dict]) -> dict:
    """Per-class (long/short), per-turn and per-ladder-step figures of one round, as flat
    keys like 'ttft_p90_ms[class=long]' so they go through medians and summary.csv as
    any other metric."""
    out = {}
    for key in GROUP_KEYS:
        values = sorted({r["tags"][key] for r in results if key in r.get("tags", {})})
        for v in values:
            sub = [r for r in results if r.get("tags", {}).get(key) == v]
            s = round_stats(sub, duration_s=0)
            label = f"{key}={v:g}" if isinstance(v, float) else f"{key}={v}"
            out[f"requests[{label}]"] = s["requests"]
            out[f"failed[{label}]"] = s["failed"]
            out |= {f"{m}[{label}]": s[m] for m in GROUP_METRICS}
    return out
