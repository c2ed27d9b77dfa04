"""The same trace windows replayed from a cold cache and primed with their history:
per window, vLLM's measured prefix-cache hit rate against the cache model's and the
never-evicting bounds, and TTFT cold against primed with intervals.

Two runs of one study but for trace.prime (none and history), each with trace.windows,
so that round k of both replays the same window:

    python benchmarks/primed_vs_cold.py COLD_RUN PRIMED_RUN [--json OUT]

Intervals: the ratio primed / cold of a round's TTFT quantile, 95% BCa bootstrap
(scipy.stats.bootstrap) over the window's requests, paired: both rounds send the same
requests, so a resample draws request i's TTFT from both. The two rounds come from two
server starts, so the interval holds the request-to-request spread only, not the
start-to-start spread: it says whether the rounds differ, not by how much every start
would.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
from scipy import stats as sps

from vllm_study.analysis.intervals import one_start_note
from vllm_study.records.results import RunFolder, read_requests, read_rounds
from vllm_study.define.study_file import load_study
from vllm_study.workload import prefix_cache_model as pcm, windows

MODEL_TOLERANCE = 0.03  # the prediction's agreement asked of a primed window


def _start_dirs(run: RunFolder) -> list[Path]:
    return sorted(p for pid in run.point_ids() for p in run.point(pid).path.glob("s*") if p.is_dir())


def _rounds(run: RunFolder) -> dict[int, tuple]:
    """window (1-based) -> (round record, {request index in the window: TTFT ms} of its
    successful requests)."""
    out = {}
    for d in _start_dirs(run):
        by_round = read_requests(d) or {}
        for rec in read_rounds(d / "rounds.jsonl"):
            if rec.status != "ok" or rec.window is None:
                continue
            ttft = {r["index"]: r["ttft_s"] * 1000 for r in by_round.get(rec.round, ())
                    if r["start"] == rec.start and r["error"] is None}
            out[rec.window] = (rec, ttft)
    return out


def _ratio(cold: np.ndarray, primed: np.ndarray, q: float, seed: int) -> tuple[float, float, float]:
    stat = lambda c, p, axis=-1: np.quantile(p, q, axis=axis) / np.quantile(c, q, axis=axis)  # noqa: E731
    ci = sps.bootstrap((cold, primed), stat, paired=True, n_resamples=4000, method="BCa",
                       rng=np.random.default_rng(seed)).confidence_interval
    return float(stat(cold, primed)), float(ci.low), float(ci.high)


def _bounds(whole, window: windows.Window, max_model_len: int, block_size: int) -> tuple[float, float]:
    """The never-evicting hit rate of the window's requests the server took (those within
    max_model_len), at the server's block size: alone, and with every earlier request of
    the trace (that the server could take) seen first."""
    kept, _ = window.trace(whole).fit(max_model_len)
    before = [r for r in whole.requests[:window.start] if r.input_tokens + 1 <= max_model_len]
    return tuple(pcm.simulate(kept.requests, block_tokens=whole.block_tokens, kv_tokens=None, block_size=block_size,
                              history=h).hit_rate for h in ((), before))


def compare(cold_path: Path, primed_path: Path, seed: int = 0) -> dict:
    cold_run, primed_run = RunFolder(cold_path), RunFolder(primed_path)
    study = load_study(primed_run.study_path)
    whole, plan = windows.for_study(study.workload.trace, study.workload.seed)
    start = json.loads((_start_dirs(primed_run)[0] / "start.json").read_text())
    max_model_len, block_size = start["trace"]["max_model_len"], int(start["launch"]["cache_config"]["block_size"])
    cold, primed = _rounds(cold_run), _rounds(primed_run)
    rows = []
    for w in sorted(set(cold) & set(primed)):
        (c_rec, c_by), (p_rec, p_by) = cold[w], primed[w]
        both = sorted(set(c_by) & set(p_by))  # the requests that completed in both rounds
        c_ttft, p_ttft = np.array([c_by[i] for i in both]), np.array([p_by[i] for i in both])
        c, p = c_rec.metrics, p_rec.metrics
        if (c_rec.window_first, c_rec.window_last) != (p_rec.window_first, p_rec.window_last):
            raise SystemExit(f"window {w} is not the same requests in both runs: "
                             f"{c_rec.window_first}-{c_rec.window_last} against "
                             f"{p_rec.window_first}-{p_rec.window_last}; compare runs of one study and seed")
        alone, with_history = _bounds(whole, plan.windows[w - 1], max_model_len, block_size)
        row = {"window": w, "first": p_rec.window_first, "last": p_rec.window_last,
               "hit_cold": c["prefix_cache_hit_rate"], "hit_primed": p["prefix_cache_hit_rate"],
               "model_primed": p.get("model_prefix_hit_rate"), "bound_alone": alone,
               "bound_with_history": with_history, "block_size": block_size, "max_model_len": max_model_len,
               "prime_s": p.get("prime_s"), "prime_prompt_tokens": p.get("prime_prompt_tokens"),
               "requests": len(both)}
        row["model_gap"] = (None if row["model_primed"] is None
                            else row["hit_primed"] - row["model_primed"])
        for q in (0.5, 0.9):
            name = f"ttft_p{q * 100:g}"
            r, lo, hi = _ratio(c_ttft, p_ttft, q, seed)
            row |= {f"{name}_cold_ms": float(np.quantile(c_ttft, q)),
                    f"{name}_primed_ms": float(np.quantile(p_ttft, q)),
                    f"{name}_ratio": r, f"{name}_lo": lo, f"{name}_hi": hi}
        rows.append(row)
    return {"cold": str(cold_path), "primed": str(primed_path), "windows": rows}


def show(result: dict) -> None:
    print(f"cold:   {result['cold']}\nprimed: {result['primed']}\n")
    r0 = result["windows"][0]
    print(f"prefix-cache hit rate (share of prompt tokens of the requests within max_model_len "
          f"{r0['max_model_len']}; the never-evicting bounds at the server's {r0['block_size']}-token blocks)")
    print(f"{'window':>6} {'requests':>17} {'cold':>7} {'primed':>7} {'model':>7} {'gap':>7} "
          f"{'bound alone':>12} {'bound w/ history':>17} {'priming':>18}")
    for r in result["windows"]:
        gap = "" if r["model_gap"] is None else f"{r['model_gap']:+.4f}"
        print(f"{r['window']:>6} {r['first'] + 1:>8}-{r['last'] + 1:<8} {r['hit_cold']:>7.4f} {r['hit_primed']:>7.4f} "
              f"{r['model_primed']:>7.4f} {gap:>7} {r['bound_alone']:>12.4f} {r['bound_with_history']:>17.4f} "
              f"{r['prime_s']:>5.0f} s {r['prime_prompt_tokens'] / 1e6:>5.2f}M tok")
    gaps = [abs(r["model_gap"]) for r in result["windows"] if r["model_gap"] is not None]
    if gaps:
        print(f"model within {MODEL_TOLERANCE} of vLLM's measured rate on every primed window: "
              f"{'yes' if max(gaps) <= MODEL_TOLERANCE else 'no'} (largest gap {max(gaps):.4f})")
    # a window's two rounds: one of a cold run's starts, one of a primed run's
    note = one_start_note(1, 1, why="it says whether the two rounds differ, not by how much every start would")
    print(f"\nTTFT, primed over cold (95% BCa bootstrap over the window's requests, paired; {note})")
    for r in result["windows"]:
        for q in ("p50", "p90"):
            print(f"  window {r['window']} TTFT {q.upper()}: cold {r[f'ttft_{q}_cold_ms']:7.0f} ms, "
                  f"primed {r[f'ttft_{q}_primed_ms']:7.0f} ms: {100 * (r[f'ttft_{q}_ratio'] - 1):+6.1f}% "
                  f"[{100 * (r[f'ttft_{q}_lo'] - 1):+.1f}%, {100 * (r[f'ttft_{q}_hi'] - 1):+.1f}%] "
                  f"({r['requests']} requests)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("cold", type=Path)
    ap.add_argument("primed", type=Path)
    ap.add_argument("--json", type=Path, help="write the figures here too")
    a = ap.parse_args()
    result = compare(a.cold, a.primed)
    show(result)
    if a.json:
        a.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
