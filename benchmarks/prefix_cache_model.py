"""What prefix caching can buy on the Mooncake conversation trace, from its prefix ids:
the never-evicting reuse of the head and of the whole hour, windows across the hour
alone and with their history, and vLLM's cache modelled at this H200's KV size.

    PYTHONPATH=lib python benchmarks/prefix_cache_model.py [--windows 20] [--seed 0]

The server's size: vLLM reported 2,064,624 tokens of KV for Qwen2.5-7B at
gpu_memory_utilization 0.9 on one H200 (block 16). The timed model's TTFT and TPOT are
what that H200 measured on this trace near real time (results/20261201T153023Z-h200-
mooncake-capacity-158c29e: TTFT mean 1.4-1.9 s, TPOT mean 14-27 ms at 0.5-1.1 x).
Takes about 10 minutes on two busy cores (the curve replays the whole hour once per size).
"""
from __future__ import annotations

import argparse
import time
from dataclasses import replace

import numpy as np

from vllm_study.workload import prefix_cache_model as pcm
from vllm_study.workload import windows

H200_KV_TOKENS = 2_064_624


def pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def spread(xs) -> str:
    """Range and median across windows (each window's own rate: the windows are the sample)."""
    xs = np.asarray(xs)
    return f"{pct(xs.min())}-{pct(xs.max())} (median {pct(float(np.median(xs)))}, {len(xs)} windows)"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--windows", type=int, default=20)
    ap.add_argument("--requests", type=int, default=60, help="requests per window")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kv-tokens", type=int, default=H200_KV_TOKENS)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--ttft", type=float, default=1.5, help="seconds, for the timed model")
    ap.add_argument("--tpot", type=float, default=0.02, help="seconds per output token, for the timed model")
    ap.add_argument("--sizes", type=float, nargs="*", default=[0.25, 0.5, 1, 2, 4, 8],
                    help="cache sizes for the curve, in multiples of --kv-tokens (and never evicting)")
    args = ap.parse_args(argv)
    t_start = time.monotonic()
    whole = windows.whole_trace("mooncake_conversation")
    n, kv, bs = len(whole.requests), args.kv_tokens, args.block_size
    timed = pcm.Timing(args.ttft, args.tpot)
    print(f"{whole.source}: {n} requests over {whole.duration_s:.0f} s; KV {kv:,} tokens, block {bs}\n")

    print("Never-evicting reuse (the kit's bound, 512-token trace blocks), share of prompt tokens:")
    head, _ = pcm.bound_hit_tokens(whole, 0, 40, with_history=False)
    print(f"  first 40 requests: {pct(head / sum(r.input_tokens for r in whole.requests[:40]))}")
    print(f"  whole hour:        {pct(whole.expected_hit_rate())}")
    m = pcm.simulate(whole.requests, block_tokens=whole.block_tokens, kv_tokens=None, block_size=bs)
    print(f"  whole hour, vLLM's cache never evicting (block {bs}, full blocks only): {pct(m.hit_rate)}")

    plan = windows.plan_windows(whole, args.windows, seed=args.seed, requests=args.requests, prime="history",
                                kv_tokens=kv, block_size=bs)
    table = windows.summary(whole, plan)
    alone, hist = table["reuse_alone"].iloc[1:], table["reuse_with_history"].iloc[1:]
    print(f"\n{args.windows} windows of {args.requests} requests across the hour (seed {args.seed}), "
          "never-evicting reuse:")
    print(f"  alone:        {spread(alone)}")
    print(f"  with history: {spread(hist)}")
    for note in plan.notes:
        print(f"  note: {note}")

    seq, tim, no_out, depth = [], [], [], []
    for w in plan.windows:
        hist_reqs = whole.requests[w.history_start:w.start]
        reqs = whole.requests[w.start:w.stop]
        seq.append(pcm.simulate(reqs, block_tokens=whole.block_tokens, kv_tokens=kv, block_size=bs,
                                history=hist_reqs).hit_rate)
        no_out.append(pcm.simulate([replace(r, output_tokens=1) for r in reqs], block_tokens=whole.block_tokens,
                                   kv_tokens=kv, block_size=bs, history=hist_reqs).hit_rate)
        r = pcm.simulate(reqs, block_tokens=whole.block_tokens, kv_tokens=kv, block_size=bs, history=hist_reqs,
                         timing=timed)
        tim.append(r.hit_rate)
        depth.append(reqs[0].t_s - whole.requests[w.history_start].t_s)
        if r.short_blocks:
            print(f"  window {w.index + 1}: running requests lacked {r.short_blocks} blocks (vLLM would queue)")
    print(f"\nvLLM's cache at {kv:,} tokens, primed with the history it holds "
          f"({min(depth):.0f}-{max(depth):.0f} s of traffic before the window):")
    print(f"  one request at a time:                         {spread(seq)}")
    print(f"  at the trace's arrivals, TTFT {args.ttft:g} s, TPOT {1000 * args.tpot:g} ms: {spread(tim)}")
    print(f"  one at a time, output blocks left out:         {spread(no_out)}")

    print(f"\nHit rate over the whole hour against cache size (block {bs}, one request at a time):")
    sizes = [round(f * kv) for f in args.sizes] + [None]
    curve = pcm.hit_rate_curve(whole, sizes, block_size=bs)
    for kv_i, rate in zip(curve["kv_tokens"], curve["hit_rate"]):
        size = "never evicts" if kv_i is None or kv_i != kv_i else f"{int(kv_i):>12,} tokens"
        mark = "  <- this server" if kv_i == kv else ""
        print(f"  {size:>19}: {pct(rate)}{mark}")
    print(f"\n({time.monotonic() - t_start:.0f} s)")


if __name__ == "__main__":
    main()
