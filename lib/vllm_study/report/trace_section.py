"""A trace run's windows against the whole trace, and the hit rate against cache size.

For trace runs with prefix ids that replay windows from across the trace
(`trace.windows`) or prime a window with its history (`trace.prime: history`): how
representative each window is of the whole trace (workload/windows.py `summary`), and
what the cache model predicts over the whole trace at a range of cache sizes
(workload/prefix_cache_model.py `hit_rate_curve`), with this server's KV size marked.
Nothing for any other run, so reports of runs without them read as before.
"""
from __future__ import annotations

import pandas as pd

from ..define.traces import Trace, read_history, read_trace, read_whole
from ..workload import prefix_cache_model as pcm, windows
from .run import Run

# The curve's cache sizes, in multiples of the server's KV size: down to a sixteenth, and
# up to 64 times (what vLLM's CPU KV offloading could add).
CURVE_MULTIPLES = (1 / 16, 1 / 8, 1 / 4, 1 / 2, 1, 2, 4, 8, 16, 32, 64)


def applies(r: Run) -> bool:
    w = r.study.workload
    return w.kind == "trace" and bool(w.trace.windows or w.trace.prime == "history")


def whole_and_plan(r: Run) -> tuple[Trace, windows.Plan] | None:
    """The whole trace and the run's windows of it: trace.windows' plan (deterministic in
    the trace and workload.seed), or the one window's place in its file. None where the
    trace has no prefix ids."""
    spec, seed = r.study.workload.trace, r.study.workload.seed
    if spec.windows:
        whole, plan = windows.for_study(spec, seed)
    else:  # the one window from start_s: its rows follow the file's rows before it (a shipped
        # window's file is its whole trace's first rows: the same indices in the whole trace)
        whole = read_whole(spec.model_copy(update={"windows": 1}))
        start = len(read_history(spec))
        stop = start + len(read_trace(spec).requests)
        plan = windows.Plan([windows.Window(0, start, stop, (spec.start_s, whole.requests[stop - 1].t_s), start)])
    return (whole, plan) if whole.block_tokens is not None else None


def window_table(r: Run) -> pd.DataFrame | None:
    """One row for the whole trace, then one a window: where it lies, its arrival rate,
    input and output length quantiles, and the never-evicting reuse alone and with all
    the traffic before it (windows.summary)."""
    if not applies(r):
        return None
    got = whole_and_plan(r)
    if got is None:
        return None
    df = windows.summary(*got)
    df["start_s"], df["end_s"] = df["start_s"].round(1), df["end_s"].round(1)
    df["rate_rps"] = df["rate_rps"].round(2)
    for c in df.columns:
        if c.startswith(("input_p", "output_p")):
            df[c] = df[c].round().astype(int)
        elif c.startswith("reuse"):
            df[c] = df[c].round(3)
    # the window's every row of the trace; the fidelity table's never-evicting hit rate is
    # the requests sent's (the rows that fit max_model_len): two figures, each named
    print(REUSE_NOTE)
    return df.rename(columns={c: f"{c} (all rows)" for c in df.columns if c.startswith("reuse")})


REUSE_NOTE = ("reuse (all rows): over every row of the window in the trace file, those longer than "
              "max_model_len included, at the trace's block size; the fidelity table's \"hit rate if nothing were "
              "evicted\" counts only the requests sent (the rows kept), from their rendered prompts")


def server_kv(r: Run) -> tuple[int, int] | None:
    """(KV tokens, block size) of the run's first start that reported its cache
    (vllm:cache_config_info: num_gpu_blocks x block_size)."""
    for s in r.summaries:
        for st in r.folder.point(s.point).starts():
            c = st.launch.cache_config
            if c.get("num_gpu_blocks") and c.get("block_size"):
                return int(c["num_gpu_blocks"]) * int(c["block_size"]), int(c["block_size"])
    return None


def hit_rate_curve(r: Run) -> tuple[pd.DataFrame, int, float, int] | None:
    """The cache model over the whole trace at CURVE_MULTIPLES of this server's KV size,
    requests one after another (no running request holds blocks), and never evicting:
    (the curve, the server's KV tokens, the never-evicting rate, the block size modelled). Modelled at the trace's
    own block size, not the server's: 32 times fewer blocks to replay for Mooncake (two
    seconds a size, not a minute and a half), and at the H200's 2.06M tokens the hour's
    rate moved by 0.001 (0.0894 at 512-token blocks, 0.0882 at 16). None without a KV
    size or prefix ids."""
    if not applies(r):
        return None
    got, kv = whole_and_plan(r), server_kv(r)
    if got is None or kv is None:
        return None
    whole, bt = got[0], got[0].block_tokens
    sizes = [max(2 * bt, int(kv[0] * m)) for m in CURVE_MULTIPLES]
    curve = pcm.hit_rate_curve(whole, sizes, block_size=bt)
    unbounded = pcm.hit_rate_curve(whole, [None], block_size=bt)["hit_rate"].iloc[0]
    return curve, kv[0], float(unbounded), bt
