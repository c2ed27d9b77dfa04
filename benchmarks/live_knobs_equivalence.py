"""Is a scheduler limit lowered at runtime the same as a server started at it?

Pairs, interleaved: each pair holds, for every value v of --values, a fresh start
launched at v (vLLM's own scheduler, --rounds rounds), and ONE start launched at
--launch with the kit's live-limits scheduler (measure/live_knobs.py), lowered to each
value in turn (--rounds rounds a value, the values' order shuffled per pair by --seed).
Even pairs run their fresh starts first, odd pairs the lowered start first: a drift
over the session favours neither. Each start warms up once; the prefix cache is reset
before every round, as the kit's rounds do.

Per round: TTFT P50/P90, ITL P99, TPOT P50, output throughput, preemptions (the delta
of vllm:num_preemptions), the start's KV capacity (num_gpu_blocks x block_size from
/metrics) and the limits the engine ran it under (live_knobs.limits_used; a fresh
start's are its launch arguments). Per value and metric: lowered over fresh, the ratio
of the per-pair medians over rounds, as the mean log ratio over pairs with a 95% t
interval. Why t and not a bootstrap over pairs: with 4-8 pairs a bootstrap has too few
distinct resamples (35 for 4 pairs) and its percentile interval covers well under 95%;
the t interval is exact where log ratios are normal, and pairs cancel the start-to-start
spread that makes them wide. A metric equal in every pair (KV capacity; no preemptions
either way) has a zero-width interval: nothing varied.

--fresh-scheduler kit launches the fresh starts with the kit's live-limits scheduler too
(at their own value, never lowered): lowered against those isolates what the launch value
fixes (torch.compile's range, CUDA graph sizes) from what the plugin's scheduling does.

--kit-measuring gives the lowered start the rest of what a sweep's start carries: the
kit's counting flags (--custom-histogram-buckets; on a GPU --enable-mfu-metrics, unless
the study says --no-enable-mfu-metrics), its 0.5 s sampling of /metrics and NVML
during rounds, and the plugin's step records (all of the start's steps, warm-up
included, kept as steps/r0.npz in its folder). With --launch equal to the one value it compares a sweep's start at its
launch point with the server vLLM's own tools launch:
    python benchmarks/live_knobs_equivalence.py params/h200-kit-measuring-footprint.yaml --launch 2048 \\
        --values 2048 --kit-measuring --pairs 4 --rounds 3 --out results/live-knobs-equivalence/<run>

The rule: a metric is "equal" where its interval lies within +-3%; "not resolved"
where it holds 0 and lies within +-5%; "differs" where it excludes 0 and leaves +-3%;
"too wide" where it holds 0 but leaves +-5% (more pairs may still settle it). Live
knobs pass on this engine only where every metric is equal or not resolved.

    python benchmarks/live_knobs_equivalence.py params/h200-live-knobs-equivalence.yaml \\
        --knob max_num_batched_tokens --launch 8192 --values 2048,512 --pairs 4 --rounds 1 \\
        --out results/live-knobs-equivalence/<run> --minutes 9     # again until the pairs are done
    python benchmarks/live_knobs_equivalence.py --summarize results/live-knobs-equivalence/<run>
    python benchmarks/live_knobs_equivalence.py --plan results/live-knobs-equivalence/<run> \\
        [--metric ttft_p90_ms] [--within 0.05] [--requests 400]

--plan: from a run's own starts, the pairs x rounds (x requests a round) whose 95%
interval on --metric would lie within +-(--within), and the device minutes they take at
the run's start and round times (verdict_plan says how); a round's offset that every start
shares (a first round still warming up) is printed and left out of the round-to-round
spread, and where the run reads a difference, the pairs that would put zero outside the
interval if it stays, and those that would bring the interval, around that reading, inside
+-(--within).

--minutes: no start begins that would not end (at the longest start-up and round so
far) before that many minutes; a rerun with the same --out continues where it stopped
(finished starts are kept in starts.jsonl; a start cut off midway runs again whole).
"""
from __future__ import annotations

import argparse
import contextlib
import gzip
import hashlib
import json
import math
import os
import random
import shutil
import signal
import sys
import time
from pathlib import Path

import numpy as np
from scipy import stats as sps

from vllm_study.define.tokenizer import load as load_tokenizer
from vllm_study.define import models
from vllm_study.define.grid import expand
from vllm_study.define.study_file import load_study, study_from_dict
from vllm_study.define.traces import read_trace
from vllm_study.launch.machine import NvmlProbe, cpu_model, resolve_engine
from vllm_study.launch.server import VllmServer, free_port, serve_command
from vllm_study.measure import client, counters, live_knobs, stats
from vllm_study.measure.launcher import counting_flags
from vllm_study.measure.rounds import _send_to_finish
from vllm_study.scheduler_plugin import steps
from vllm_study.records.results import git_state
from vllm_study.workload.build_workload import make_workload
from vllm_study.workload.trace_workload import TraceWorkload

KNOBS = ("max_num_batched_tokens", "max_num_seqs")
METRICS = ("ttft_p50_ms", "ttft_p90_ms", "itl_p99_ms", "tpot_p50_ms", "output_throughput", "preemptions",
           "kv_tokens")
KIT_ROOT = Path(__file__).resolve().parents[1]
EQUAL, LOOSE = 0.03, 0.05   # the rule's bounds on lowered / fresh - 1
MARGIN_S = 20               # left at --minutes for the summary and the files' way back


# ------------------------------------------------------------------ statistics

def log_ratio(lowered: float, fresh: float) -> float:
    """log(lowered / fresh); 0 where both are equal (no preemptions either way), +-inf
    where only one side is 0 (a ratio cannot say how far apart that is)."""
    if lowered == fresh:
        return 0.0
    if lowered <= 0 or fresh <= 0:
        return math.inf if lowered > fresh else -math.inf
    return math.log(lowered / fresh)


def interval(logs) -> dict:
    """The mean log ratio over pairs with its 95% t interval, as fractions (+0.02: +2%)."""
    d = np.asarray(logs, dtype=float)
    out = {"pairs": len(d), "effect": None, "low": None, "high": None, "sd": None}
    if len(d) == 0 or not np.isfinite(d).all():
        return out
    out.update(effect=float(np.expm1(d.mean())))
    if len(d) < 2:
        return out
    sd = float(d.std(ddof=1))
    low, high = (d.mean(), d.mean()) if sd == 0 else sps.ttest_1samp(d, 0.0).confidence_interval(0.95)
    return {**out, "low": float(np.expm1(low)), "high": float(np.expm1(high)), "sd": sd}


def verdict(x: dict) -> str:
    """The rule, on one metric's interval (interval()'s dict)."""
    if x["effect"] is None and x["pairs"]:
        return "differs"  # zero on one side only: lowered and fresh did not behave alike
    if x["low"] is None:
        return "too few pairs"
    low, high = x["low"], x["high"]
    if -EQUAL <= low and high <= EQUAL:
        return "equal"
    if low <= 0 <= high:
        return "not resolved" if -LOOSE <= low and high <= LOOSE else "too wide"
    return "differs"


def pairs_needed(sd: float, half: float = math.log1p(EQUAL), most: int = 10_000) -> int:
    """The fewest pairs whose t interval's half-width, at this sd of the log ratios,
    is at most `half` (log scale; log(1.03): +-3%)."""
    n = 2
    while n < most and sps.t.ppf(0.975, n - 1) * sd / math.sqrt(n) > half:
        n += 1
    return n


LEFT_OUT = "left_out.json"  # {pair index: why}: pairs a run's folder declares unpaired


def unpaired(starts: list[dict], declared: dict[int, str] | None = None) -> dict[int, str]:
    """{pair index: why} for the pairs the summary leaves out: those whose two starts ran on
    two GPUs (their `gpus`, NVML's UUIDs, differ: a machine's own speed would be read as the
    difference), and those `declared` in the run's left_out.json (starts written before
    they recorded their GPUs)."""
    out = {int(k): v for k, v in (declared or {}).items()}
    seen: dict[int, set] = {}
    for s in starts:
        if s.get("gpus"):
            seen.setdefault(s["pair"], set()).add(tuple(s["gpus"]))
    for p, gpus in seen.items():
        if len(gpus) > 1 and p not in out:
            out[p] = "its starts ran on two GPUs (" + " and ".join(",".join(g) for g in sorted(gpus)) + ")"
    return out


def read_left_out(out: Path) -> dict[int, str]:
    f = out / LEFT_OUT
    return {int(k): v for k, v in json.loads(f.read_text()).items()} if f.exists() else {}


def paired(starts: list[dict], values: list[int]) -> dict:
    """{value: {metric: interval + verdict}} over the pairs that have both ways of it."""
    med: dict = {}  # (pair, value, way) -> {metric: median over rounds}
    for s in starts:
        for v in values:
            rows = [r["metrics"] for r in s["rounds"] if r["value"] == v and r["metrics"].get("completed")]
            if rows:
                med[(s["pair"], v, s["way"])] = {m: float(np.median([r[m] for r in rows if r.get(m) is not None]
                                                                    or [np.nan])) for m in METRICS}
    out = {}
    for v in values:
        pairs = sorted({p for p, _, _ in med if (p, v, "fresh") in med and (p, v, "lowered") in med})
        out[v] = {}
        for m in METRICS:
            both = [(med[(p, v, "lowered")][m], med[(p, v, "fresh")][m]) for p in pairs]
            both = [(a, b) for a, b in both if not (math.isnan(a) or math.isnan(b))]
            x = interval([log_ratio(a, b) for a, b in both])
            x["lowered"] = float(np.median([a for a, _ in both])) if both else None
            x["fresh"] = float(np.median([b for _, b in both])) if both else None
            out[v][m] = {**x, "verdict": verdict(x)}
    return out


def summary(starts: list[dict], values: list[int], declared: dict[int, str] | None = None) -> dict:
    """The verdict over the pairs; those `unpaired` names are left out, and listed."""
    left_out = unpaired(starts, declared)
    by_value = paired([s for s in starts if s["pair"] not in left_out], values)
    rows = [(v, m, x) for v, ms in by_value.items() for m, x in ms.items()]
    widest = max((r for r in rows if r[2]["sd"] is not None), key=lambda r: r[2]["sd"], default=None)
    need = None
    if widest:
        v, m, x = widest
        n = pairs_needed(x["sd"])
        need = {"value": v, "metric": m, "low": x["low"], "high": x["high"], "pairs": n,
                "more": max(0, n - x["pairs"])}
    passes = bool(rows) and all(x["verdict"] in ("equal", "not resolved") for _, _, x in rows)
    devices = sorted({st["device"] for st in starts if st.get("device")})
    return {"by_value": by_value, "passes": passes, "widest": need, "devices": devices,
            "left_out": {str(p): why for p, why in sorted(left_out.items())},
            "method": "mean log ratio over pairs, 95% t interval (scipy.stats.ttest_1samp)"}


# ------------------------------------------------------------------ planning
# How many pairs x rounds a verdict needs, from a run's own variance components (log
# scale), by the method of moments of a one-way random-effects design:
#   round  var_round: the pooled variance of a start's rounds about its mean (every start);
#   pair   var_pair:  the variance over pairs of d = mean log(kit or lowered start's rounds)
#                     - mean log(fresh start's rounds), at the run's R0 rounds a start;
#   start  var_start = max(0, var_pair - 2 var_round / R0): what pairing leaves of the two
#          starts' own difference (start-to-start spread, less any drift a pair shares).
# At R rounds a start of N requests each, d has variance var_start + 2 var_round (N0 / N) / R
# (N0: the run's requests a round). The N0 / N scaling takes a round's quantile to vary as
# 1 / requests, as independent requests would; the run did not test that. Means of logs,
# not the summary's medians of rounds, so that the variance adds up over rounds.
PLAN_ROUNDS = (1, 2, 3, 5, 10, 20, 40)
MOST_PAIRS = 100_000   # pairs_needed's answer where no count up to it is enough


def variance_parts(starts: list[dict], value: int, metric: str) -> dict:
    """The log `metric`'s variance components at `value` (above): var_round (df_round),
    var_pair (df_pair: pairs - 1), var_start, the run's rounds a start and requests a round,
    and round_effects: each round's index's offset from the start's level.

    var_round is what is left of the rounds once each start's level and each round index's
    offset are taken out (an additive fit, numpy's least squares): a first round that runs
    slower in every start (a warm-up the start's own did not finish) is the same in both
    starts of a pair and cancels in their difference, so it is not noise to average away."""
    logs: dict = {}  # (pair, way) -> {round index: log metric} of each completed round at value
    requests = []
    for st in starts:
        rows = [r for r in st["rounds"] if r["value"] == value and r["metrics"].get("completed")
                and (r["metrics"].get(metric) or 0) > 0]
        if rows:
            logs[(st["pair"], st["way"])] = {r.get("round", i): math.log(r["metrics"][metric])
                                             for i, r in enumerate(rows)}
            requests += [r["metrics"]["completed"] + r["metrics"].get("failed", 0) for r in rows]
    var_round, df_round, effects = _round_variance(logs, f"{metric} at {value}")
    pairs = sorted(p for p, w in logs if w == "fresh" and (p, "lowered") in logs)
    if len(pairs) < 2:
        raise ValueError(f"{metric} at {value}: {len(pairs)} complete pair(s): the spread over pairs needs 2 or more")
    mean = lambda x: float(np.mean(list(x.values())))  # noqa: E731
    d = np.array([mean(logs[(p, "lowered")]) - mean(logs[(p, "fresh")]) for p in pairs])
    r0 = len(pairs) * 2 / sum(1 / len(logs[(p, w)]) for p in pairs for w in ("fresh", "lowered"))  # harmonic
    var_pair = float(d.var(ddof=1))
    return {"var_round": var_round, "df_round": df_round, "var_pair": var_pair, "df_pair": len(pairs) - 1,
            "var_start": max(0.0, var_pair - 2 * var_round / r0), "rounds": r0, "round_effects": effects,
            "requests": float(np.median(requests)), "mean_diff": float(d.mean())}


def _round_variance(logs: dict, what: str) -> tuple[float, int, dict[int, float]]:
    """(var_round, df_round, {round index: offset}) from {start: {round index: log value}}:
    the residual variance of log value = start level + round index offset (offsets centred
    on zero over the rounds seen), least squares over the starts with two rounds or more."""
    within = {k: x for k, x in logs.items() if len(x) > 1}
    index = sorted({i for x in within.values() for i in x})
    cells = [(k, i, y) for k, x in within.items() for i, y in x.items()]
    df = len(cells) - len(within) - (len(index) - 1)
    if not within:
        raise ValueError(f"{what}: no start has 2 rounds: the round-to-round spread is not measured")
    if df < 1:
        raise ValueError(f"{what}: {len(cells)} rounds in {len(within)} starts leave no degree of freedom for the "
                         "round-to-round spread once each start's level and each round's offset are taken out")
    col = {k: j for j, k in enumerate(within)}
    design = np.zeros((len(cells), len(within) + len(index) - 1))
    for row, (k, i, _) in enumerate(cells):
        design[row, col[k]] = 1.0
        if i != index[0]:  # the first index is the baseline of the offsets
            design[row, len(within) + index.index(i) - 1] = 1.0
    y = np.array([c[2] for c in cells])
    fit, *_ = np.linalg.lstsq(design, y, rcond=None)
    resid = y - design @ fit
    offsets = np.concatenate([[0.0], fit[len(within):]])
    counts = np.array([sum(1 for c in cells if c[1] == i) for i in index])
    offsets -= np.average(offsets, weights=counts)
    return float(resid @ resid) / df, df, {i: float(o) for i, o in zip(index, offsets)}


def pairs_assured(sd: float, half: float, assurance: float = 0.8, most: int = MOST_PAIRS) -> int:
    """The fewest pairs whose 95% t half-width is at most `half` with probability
    `assurance`: a run's interval is built from its own sample sd, which falls above the
    true `sd` about half the time, so pairs_needed at the true sd meets `half` only about
    half the time. The sample variance is sd^2 chi2(n-1) / (n-1)."""
    n = 2
    while n < most and sps.chi2.cdf((n - 1) * n * half ** 2 / (sps.t.ppf(0.975, n - 1) * sd) ** 2,
                                    n - 1) < assurance:
        n += 1
    return n


def start_minutes(starts: list[dict]) -> dict:
    """A start's time as the run measured it: its fixed part (start-up, warm-up, stop: its
    wall less its rounds) and a round's (as the run sized it), medians over starts and
    rounds; the minutes a pair's starts took, median over the pairs with both ways."""
    fixed = [st["wall_s"] - sum(r["wall_s"] for r in st["rounds"]) for st in starts]
    rounds = [r["wall_s"] for st in starts for r in st["rounds"]]
    walls: dict = {}   # pair -> {way: [each start's wall_s]}
    for st in starts:
        walls.setdefault(st["pair"], {}).setdefault(st["way"], []).append(st["wall_s"])
    pair_min = [sum(map(sum, w.values())) / 60 for w in walls.values() if len(w) == 2]
    return {"fixed_s": float(np.median(fixed)), "round_s": float(np.median(rounds)),
            "pair_min": float(np.median(pair_min)) if pair_min else None}


def verdict_plan(starts: list[dict], value: int, metric: str, within: float = LOOSE,
                 requests: int | None = None, rounds=PLAN_ROUNDS, values: int = 1) -> dict:
    """Per rounds a start R (of `requests` each, default the run's): the pairs whose 95%
    interval on `metric`'s lowered (or kit) over fresh ratio at `value` is within
    +-`within` (half-width log(1 + within)), and the device minutes they take at the run's
    own start and round times. A pair of a run comparing `values` values is that many
    fresh starts and one lowered start, R rounds a value in each."""
    v = variance_parts(starts, value, metric)
    t = start_minutes(starts)
    n_req = requests or v["requests"]
    scale = v["requests"] / n_req              # a round's variance against the run's round's
    half = math.log1p(within)

    def table(var_start: float) -> list[dict]:
        rows = []
        for r in rounds:
            var_diff = var_start + 2 * v["var_round"] * scale / r
            n = pairs_needed(math.sqrt(var_diff), half, most=MOST_PAIRS)
            pair_s = (values + 1) * t["fixed_s"] + 2 * values * r * t["round_s"] / scale
            n80 = pairs_assured(math.sqrt(var_diff), half)
            rows.append({"rounds": r, "sd_diff": math.sqrt(var_diff), "pairs": n, "minutes": n * pair_s / 60,
                         "pairs_80": n80, "minutes_80": n80 * pair_s / 60})
        return rows

    def cheapest(rows: list[dict]) -> dict:
        return min(rows, key=lambda x: x["minutes"])

    rows = table(v["var_start"])
    # the pair variance's one-sided 90% upper confidence bound (chi-square on its df): a plan
    # that still holds if this run's few pairs read the start part low
    var_pair_up = v["var_pair"] * v["df_pair"] / float(sps.chi2.ppf(0.10, v["df_pair"]))
    var_start_up = max(0.0, var_pair_up - 2 * v["var_round"] / v["rounds"])
    floor = pairs_needed(math.sqrt(v["var_start"]), half, most=MOST_PAIRS)
    # the plan above is for a difference near zero; where the run reads one, the pairs (at its
    # own rounds a start and pair spread) whose interval would leave zero out, if it stays
    apart = (pairs_needed(math.sqrt(v["var_pair"]), abs(v["mean_diff"]), most=MOST_PAIRS)
             if v["mean_diff"] else None)
    # and the rule's "inside +-within" is of the interval, not its half-width: around the
    # run's reading the half-width has only what the reading leaves of +-within
    inside = (pairs_needed(math.sqrt(v["var_pair"]), half - abs(v["mean_diff"]), most=MOST_PAIRS)
              if abs(v["mean_diff"]) < half else None)
    return {"metric": metric, "value": value, "within": within, "requests": n_req, "parts": v, "times": t,
            "rows": rows, "pairs_at_infinite_rounds": floor, "cheapest": cheapest(rows), "pairs_apart": apart,
            "pairs_inside": inside,
            "upper": {"var_pair": var_pair_up, "var_start": var_start_up, "cheapest": cheapest(table(var_start_up))},
            "method": "method-of-moments variance components of log values (round-to-round: the residual of "
                      "start level + round offset; start part = variance of pair differences less 2 var_round / "
                      "rounds), "
                      "95% t interval over pairs (scipy.stats.t)"}


def plan_report(p: dict) -> str:
    v, t = p["parts"], p["times"]
    sd = lambda x: f"{math.sqrt(x):.3f}"  # noqa: E731
    lines = [f"{p['metric']} at {p['value']}: pairs x rounds for a 95% interval within +-{p['within']:.0%} "
             f"(half-width log(1 + {p['within']:g}) = {math.log1p(p['within']):.4f})",
             f"  method: {p['method']}",
             f"  round-to-round sd of log {p['metric']} {sd(v['var_round'])} (df {v['df_round']}, "
             f"{v['requests']:.0f} requests a round); pair difference sd {sd(v['var_pair'])} "
             f"(df {v['df_pair']}, {v['rounds']:g} rounds a start); its start part sd {sd(v['var_start'])}",
             "  each round's offset from its start's level, the same in both ways and cancelled in a pair: "
             + ", ".join(f"round {i + 1} {math.expm1(o):+.1%}" for i, o in v["round_effects"].items()),
             f"  a start: {t['fixed_s']:.1f} s fixed (start-up, warm-up, stop) + {t['round_s']:.2f} s a round "
             f"of {v['requests']:.0f} requests; a pair took {t['pair_min']:.2f} min in this run at "
             f"{v['rounds']:g} rounds",
             f"  planned rounds of {p['requests']:.0f} requests"
             + ("" if p["requests"] == v["requests"] else
                f" (round variance scaled by {v['requests']:.0f}/{p['requests']:.0f}, an assumption)"),
             "  pairs: at the estimated sd; 80%: pairs whose interval meets the bound in 80% of runs",
             f"  {'rounds':>6}  {'sd of d':>8}  {'pairs':>6}  {'device min':>10}  {'pairs 80%':>9}  {'min 80%':>8}"]
    for x in p["rows"]:
        lines.append(f"  {x['rounds']:>6}  {x['sd_diff']:>8.4f}  {x['pairs']:>6}  {x['minutes']:>10.0f}  "
                     f"{x['pairs_80']:>9}  {x['minutes_80']:>8.0f}")
    lines.append(f"  with rounds without end, the start part alone needs {p['pairs_at_infinite_rounds']} pairs")
    c = p["cheapest"]
    c80 = min(p["rows"], key=lambda x: x["minutes_80"])
    lines.append(f"  cheapest: {c['pairs']} pairs x {c['rounds']} rounds, about {c['minutes']:.0f} device "
                 f"minutes ({c['minutes'] / 60:.1f} h); for 80% of runs to meet it {c80['pairs_80']} pairs x "
                 f"{c80['rounds']} rounds, about {c80['minutes_80']:.0f} minutes ({c80['minutes_80'] / 60:.1f} h)")
    if p["pairs_apart"]:
        lines.append(f"  the run reads {math.expm1(v['mean_diff']):+.1%} (mean log ratio over {v['df_pair'] + 1} "
                     f"pairs): if that stays, {_about(p['pairs_apart'])} pairs at {v['rounds']:g} rounds a start "
                     f"put zero outside the interval (at the pair difference sd {sd(v['var_pair'])})")
    if v["mean_diff"]:
        reading = f"  at the run's reading ({math.expm1(v['mean_diff']):+.1%}) an interval inside +-{p['within']:.0%} "
        lines.append(reading + (f"takes {_about(p['pairs_inside'])} pairs at {v['rounds']:g} rounds a start (its "
                                f"half-width at most {math.log1p(p['within']) - abs(v['mean_diff']):.4f})"
                                if p["pairs_inside"] else "takes more than any pairs: the reading lies outside"))
    u = p["upper"]
    c = u["cheapest"]
    lines.append(f"  at the pair variance's one-sided 90% upper bound (chi-square, df {v['df_pair']}: pair sd "
                 f"{sd(u['var_pair'])}, start part sd {sd(u['var_start'])}): {c['pairs']} pairs x {c['rounds']} "
                 f"rounds, about {c['minutes']:.0f} device minutes ({c['minutes'] / 60:.1f} h)")
    return "\n".join(lines)


def _about(pairs: int) -> str:
    return f"about {pairs}" if pairs < MOST_PAIRS else f"more than {MOST_PAIRS:,}"


def report(plan: dict, s: dict) -> str:
    pct = lambda x: "    -" if x is None else f"{x:+.1%}"  # noqa: E731
    fresh = "fresh starts at each value" + (" (the kit's scheduler too)" if runs_plugin("fresh", plan) else "")
    kit = " with the kit's measuring" if plan.get("kit_measuring") else ""
    head = (f"{plan['knob']} {plan['launch']}: the kit's server as a sweep launches it (its measuring) over "
            f"plain vLLM starts" if footprint(plan) else
            f"{plan['knob']}: launched at {plan['launch']}{kit} and lowered live, over {fresh}")
    on = f"on {', '.join(s['devices'])}" if s.get("devices") else "device not recorded"
    lines = [f"{head}; {on}; {s['method']}; rounds a value {plan['rounds']}",
             f"{'value':>7}  {'metric':<18} {'lowered':>10} {'fresh':>10} {'ratio':>7}  {'95% interval':<18} "
             f"pairs  verdict"]
    for v, ms in s["by_value"].items():
        for m, x in ms.items():
            ci = "" if x["low"] is None else f"[{pct(x['low'])}, {pct(x['high'])}]"
            num = lambda y: "-" if y is None else f"{y:.5g}"  # noqa: E731
            lines.append(f"{v:>7}  {m:<18} {num(x['lowered']):>10} {num(x['fresh']):>10} {pct(x['effect']):>7}  "
                         f"{ci:<18} {x['pairs']:>5}  {x['verdict']}")
    rule = f"rule (equal within +-{EQUAL:.0%}, or not resolved inside +-{LOOSE:.0%}): "
    if footprint(plan):
        lines.append(footprint_verdict(s))
    elif s["passes"]:
        lines.append(rule + "PASSES: live knobs may be the default on this engine")
    elif any(x["verdict"] == "too few pairs" for ms in s["by_value"].values() for x in ms.values()):
        lines.append(rule + "not decided: every value needs at least 2 complete pairs")
    else:
        # "differs" fails the rule whatever more pairs show; "too wide" only until they narrow it
        differs = [f"{m} at {v}" for v, ms in s["by_value"].items() for m, x in ms.items() if x["verdict"] == "differs"]
        wide = [f"{m} at {v}" for v, ms in s["by_value"].items() for m, x in ms.items() if x["verdict"] == "too wide"]
        lines.append(rule + (f"does NOT pass ({', '.join(differs)} differs): the kit restarts for this knob on "
                             "this engine" if differs else
                             f"not decided yet ({', '.join(wide)} too wide; more pairs may settle it): until then "
                             "the kit restarts for this knob on this engine"))
    for p, why in s.get("left_out", {}).items():
        lines.append(f"left out: pair {int(p) + 1}, {why}")
    w = s["widest"]
    if w:
        lines.append(f"widest interval: {w['metric']} at {w['value']}, [{pct(w['low'])}, {pct(w['high'])}]: about "
                     f"{w['pairs']} pairs ({w['more']} more) at this spread narrow it to +-{EQUAL:.0%}")
    else:
        lines.append("no interval yet: it needs at least 2 complete pairs")
    return "\n".join(lines)


def footprint(plan: dict) -> bool:
    """Nothing lowered: the kit's measuring start at its launch value against plain vLLM's,
    a footprint check rather than a live-knobs one."""
    return bool(plan.get("kit_measuring")) and plan["values"] == [plan["launch"]]


def footprint_verdict(s: dict) -> str:
    """The footprint's target: every metric equal within +-3%, resolved. Names the metrics
    that miss it, each with its verdict."""
    rows = [(m, x) for ms in s["by_value"].values() for m, x in ms.items()]
    missing = [f"{m} ({x['verdict']})" for m, x in rows if x["verdict"] != "equal"]
    target = f"footprint target (every metric equal within +-{EQUAL:.0%}, resolved): "
    if not rows or any(x["verdict"] == "too few pairs" for _, x in rows):
        return target + "not decided: every metric needs at least 2 complete pairs"
    return target + ("met" if not missing else "not met: " + ", ".join(missing))


# ------------------------------------------------------------------ the plan and its files

def pair_units(pair: int, values: list[int], seed: int) -> list[tuple[str, list[int]]]:
    """(way, values) in run order: the fresh starts and the one lowered start of a pair."""
    order = list(values)
    random.Random(f"{seed}/{pair}").shuffle(order)
    fresh = [("fresh", [v]) for v in order]
    return fresh + [("lowered", order)] if pair % 2 == 0 else [("lowered", order)] + fresh


def read_starts(out: Path) -> list[dict]:
    f = out / "starts.jsonl"
    return [json.loads(line) for line in f.read_text().splitlines() if line.strip()] if f.exists() else []


def check_plan(out: Path, plan: dict) -> None:
    """A rerun into the same folder must measure the same thing (--pairs may grow)."""
    f = out / "plan.json"
    if f.exists():
        old = json.loads(f.read_text())
        diff = [k for k in plan if k not in ("pairs", "params") and old.get(k) != plan[k]]
        if diff:
            raise SystemExit(f"{out} holds a run with other {', '.join(diff)} ({ {k: old.get(k) for k in diff} }): "
                             "rerun with its arguments, or give a new --out")
    f.write_text(json.dumps(plan, indent=1))


def this_device(gpus: list | None = None) -> tuple[str, list[str]]:
    """What measures here, as a start records it: the GPUs' names as NVML gives them (the
    first device's, with the count where there are several), else the CPU's model; and the
    GPUs' UUIDs (which physical cards: two machines of one kind differ in speed). `gpus`:
    NvmlProbe().describe() where the caller has it already."""
    gpus = NvmlProbe().describe() if gpus is None else gpus
    if gpus:
        return gpus[0].name + (f" x{len(gpus)}" if len(gpus) > 1 else ""), [g.uuid for g in gpus]
    return f"CPU: {cpu_model()}", []


def this_host(gpus: list | None = None) -> dict:
    """The machine around the GPUs, as a start records it: three lends of one H100 model
    served one study's TTFT P50 up to 2.3x apart at a like TPOT, so the host's CPU, its
    cores and the GPU driver are kept beside the cards' UUIDs. `gpus` as in this_device."""
    gpus = NvmlProbe().describe() if gpus is None else gpus
    return {"cpu": cpu_model(), "cores": os.cpu_count(), "gpu_driver": gpus[0].driver if gpus else None}


def check_device(starts: list[dict], device: str) -> None:
    """A resumed run goes on only on the device its starts ran on: pairs from two kinds of
    GPU (an H100 and an H200) are not samples of one difference. Starts written before
    starts recorded their device are not checked."""
    seen = {s["device"] for s in starts if s.get("device")}
    if seen and seen != {device}:
        raise SystemExit(f"this run's starts ran on {', '.join(sorted(seen))}; this machine is {device}: "
                         "pairs from other hardware would be pooled with them. Resume it on that hardware, "
                         "or give a new --out for a run on this one")


def parse_values(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"--values {text!r}: give whole numbers separated by commas, e.g. 2048,512") from None
    if not values or len(set(values)) != len(values) or min(values) < 1:
        raise SystemExit(f"--values {text!r}: give distinct values of at least 1, e.g. 2048,512")
    return values


# ------------------------------------------------------------------ measuring

class Bench:
    def __init__(self, a, plan: dict, device: str, gpus: list[str], host: dict):
        self.a, self.plan, self.device, self.gpus, self.host = a, plan, device, gpus, host
        s = load_study(a.params)
        if s.workload.kind == "multi_turn" or s.workload.load.kind != "closed" or s.targets or s.search \
                or s.scheduler.ratios != ["off"]:
            raise SystemExit("the study must launch its own server with vLLM's scheduler and send a trace or a "
                             "closed-loop workload: no targets, search, multi_turn, load or scheduler.min_reuse_ratio")
        if s.workload.kind == "trace" and s.workload.trace.prime != "none":
            raise SystemExit("workload.trace.prime: history is not sent by this benchmark: set prime: none")
        if any(x.startswith("--scheduler-cls") for x in s.server.extra_cli_args):
            raise SystemExit("server.extra_cli_args names a --scheduler-cls: remove it (the lowered start runs "
                             f"{live_knobs.SCHEDULER_CLS}, the fresh ones vLLM's own)")
        # the kit's own checks of every launch (e.g. max_num_seqs <= max_num_batched_tokens)
        grid = {a.knob: [a.launch, *(v for v in plan["values"] if v != a.launch)]}
        self.study = study_from_dict({**s.model_dump(exclude_unset=True), "grid": grid})
        self.engine = resolve_engine(self.study.server.engine)
        self.points = {p.values[a.knob]: p for p in expand(self.study, self.engine)}
        self.model, self.dummy = models.resolve(self.study.model)
        tok, w = load_tokenizer(self.model), self.study.workload
        if w.kind == "trace":
            limit = self.points[a.launch].engine_args.max_model_len or models.max_positions(self.study.model)
            trace, dropped = read_trace(w.trace).fit(limit) if limit else (read_trace(w.trace), 0)
            self.wl = TraceWorkload(tok, api=w.api, seed=w.seed, trace=trace)
            self.requests, self.times = self.wl.requests(), self.wl.schedule(w.trace.speed)
            print(f"{trace.source}: {len(self.requests)} requests at {w.trace.speed:g} x ({dropped} longer than "
                  f"max_model_len {limit} left out)", flush=True)
        else:
            self.wl = make_workload(tok, w)
            self.requests, self.times = self.wl.requests(w.requests_per_round), None

    def _send(self, url: str, requests, times=None) -> list[dict]:
        w, served = self.study.workload, self.study.model.served_name
        coro = (client.run_open_loop(url, served, w.api, requests, times, timeout_s=w.request_timeout_s) if times
                else client.run_closed_loop(url, served, w.api, requests, w.concurrency, timeout_s=w.request_timeout_s))
        return [r.to_dict() for r in client.run_sync(coro)]

    def run_start(self, pair: int, way: str, values: list[int]) -> dict:
        a, s = self.a, self.study
        launch = a.launch if way == "lowered" else values[0]
        work = a.out / (f"pair{pair}-{way}" + ("" if way == "lowered" else f"-{launch}"))
        work.mkdir(parents=True, exist_ok=True)
        control, counters_file = work / "control.json", work / "counters.json"
        env, extra = dict(s.server.env), list(s.server.extra_cli_args)
        plugin = runs_plugin(way, self.plan)
        if plugin:
            env |= live_knobs.launch_env(control, counters_file)
            extra += ["--scheduler-cls", live_knobs.SCHEDULER_CLS]
        measuring = way == "lowered" and self.plan.get("kit_measuring", False)
        if measuring:
            chunks = (a.launch, *values) if a.knob == "max_num_batched_tokens" else ()
            extra += counting_flags(self.engine, chunks, extra)
            env[steps.STEPS_ENV] = str(work / "steps.raw")  # the plugin records every engine step, as in a sweep
        port = free_port()
        cmd = serve_command(self.model, port, self.points[launch].engine_args.cli(), s.model.served_name,
                            self.dummy, extra)
        t0 = time.perf_counter()
        rec = {"pair": pair, "way": way, "launch": {a.knob: launch}, "device": self.device, "gpus": self.gpus,
               "host": self.host, "rounds": [],
               "extra_cli_args": extra,
               "commit": git_state(KIT_ROOT).model_dump(),  # a copy without .git: VLLM_STUDY_GIT_SHA names it
               "sampling_s": counters.RoundSampler.PERIOD_S if measuring else None}
        with VllmServer(cmd, port, work / "server.log", env=env, startup_timeout_s=s.server.startup_timeout_s) as srv:
            rec["startup_s"] = srv.startup_s
            cache = counters.cache_config(counters.scrape(srv.url))
            kv = int(cache["num_gpu_blocks"]) * int(cache["block_size"]) if "num_gpu_blocks" in cache else None
            rec["cache_config"] = cache
            if s.workload.warmup_requests:
                self._send(srv.url, self.wl.requests(s.workload.warmup_requests, "warmup"))
            for v in values:
                # a fresh start on the plugin is "set" to its own launch value: its counters then
                # cover the rounds, not the warm-up
                limits = (live_knobs.set_limits(srv.url, counters_file, control, **{a.knob: v}) if plugin
                          else {a.knob: v, "source": "launch arguments"})
                for i in range(a.rounds):
                    t_round = time.perf_counter()
                    counters.reset_prefix_cache(srv.url)  # every round starts cold
                    before = counters.scrape(srv.url)
                    # as a sweep's rounds sample: a thread beside the client
                    with counters.RoundSampler(srv.url, NvmlProbe()) if measuring else contextlib.nullcontext():
                        results = self._send(srv.url, self.requests, self.times)
                    after = counters.scrape(srv.url)
                    m = stats.round_metrics(results, _send_to_finish(results))
                    m["preemptions"] = counters.round_deltas(before, after)["preemptions"]
                    m["kv_tokens"] = kv
                    if plugin:
                        time.sleep(0.5)  # the plugin rewrites its counters file every 0.2 s
                        limits = live_knobs.limits_used(counters_file, limits["seq"])
                    rec["rounds"].append({"value": v, "round": i, "limits": limits,
                                          "wall_s": time.perf_counter() - t_round,
                                          "metrics": {k: m.get(k) for k in ("completed", "failed", "duration_s",
                                                                            *METRICS)}})
                    print(f"  pair {pair + 1} {way:>7} {a.knob}={v} round {i + 1}: " + "  ".join(
                        f"{k} {m[k]:.4g}" for k in METRICS if m.get(k) is not None)
                        + (f"  ({m['failed']} requests failed)" if m["failed"] else ""), flush=True)
        rec["wall_s"] = time.perf_counter() - t0
        raw = work / "steps.raw"
        if raw.exists():  # kept whole, column-wise, for a step-time model of this GPU
            rows = steps.read_raw(raw)
            rec["step_records"] = {"steps": len(rows), "raw_bytes": raw.stat().st_size}
            steps.save_round(work, 0, rows)
            raw.unlink()
        with open(work / "server.log", "rb") as f, gzip.open(work / "server.log.gz", "wb") as z:
            shutil.copyfileobj(f, z)
        (work / "server.log").unlink()
        return rec


def runs_plugin(way: str, plan: dict) -> bool:
    """Whether a start runs the kit's live-limits scheduler: the lowered one always, the
    fresh ones where the plan says --fresh-scheduler kit."""
    return way == "lowered" or plan.get("fresh_scheduler") == "kit"


def todo(starts: list[dict], pairs: int, values: list[int], launch: int, seed: int) -> list[tuple]:
    """(pair, way, values) of the starts still to run, in run order."""
    done = {(s["pair"], s["way"], tuple(s["launch"].values())) for s in starts}
    return [(p, way, vals) for p in range(pairs) for way, vals in pair_units(p, values, seed)
            if (p, way, (launch if way == "lowered" else vals[0],)) not in done]


def fits(starts: list[dict], rounds: int, elapsed_s: float, minutes: float) -> bool:
    """Would a start of this many rounds end before `minutes`? Estimated from the starts
    so far: the longest start-up and stop (a start's time outside its rounds) plus its
    rounds at the longest round; the first start of a run always begins."""
    if not minutes or not starts:
        return True
    outside = max(s["wall_s"] - sum(r["wall_s"] for r in s["rounds"]) for s in starts)
    per_round = max((r["wall_s"] for s in starts for r in s["rounds"]), default=0.0)
    return elapsed_s + outside + rounds * per_round + MARGIN_S <= 60 * minutes


def run(a) -> None:
    t_begin = time.monotonic()
    values = parse_values(a.values)
    if any(v > a.launch for v in values):
        raise SystemExit(f"--values {a.values}: the live limit is capped at the launch value {a.launch}; "
                         "raise --launch or lower the values")
    text = Path(a.params).read_text()
    plan = {"params": str(a.params), "params_sha256": hashlib.sha256(text.encode()).hexdigest(), "knob": a.knob,
            "launch": a.launch, "values": values, "rounds": a.rounds, "seed": a.seed, "pairs": a.pairs}
    if a.fresh_scheduler == "kit":  # vLLM's, the default, is left out: plans written before stay the same
        plan["fresh_scheduler"] = "kit"
    if a.kit_measuring:  # likewise
        plan["kit_measuring"] = True
    a.out.mkdir(parents=True, exist_ok=True)
    check_plan(a.out, plan)
    starts = read_starts(a.out)
    left = todo(starts, a.pairs, values, a.launch, a.seed)
    found = NvmlProbe().describe()  # once: the device's name and UUIDs, and the host's driver
    device, gpus = this_device(found)
    check_device(starts, device)
    bench = Bench(a, plan, device, gpus, this_host(found)) if left else None
    for pair, way, vals in left:
        if not fits(starts, len(vals) * a.rounds, time.monotonic() - t_begin, a.minutes):
            print(f"stopping before {a.minutes:g} minutes: {len(left)} starts left; rerun with the same --out "
                  "to go on", flush=True)
            return
        print(f"pair {pair + 1}/{a.pairs}: {way} start at {a.knob}={a.launch if way == 'lowered' else vals[0]}",
              flush=True)
        rec = bench.run_start(pair, way, vals)
        starts.append(rec)
        left = left[1:]
        with open(a.out / "starts.jsonl", "a") as f:
            f.write(json.dumps(rec) + "\n")
        print(f"  started in {rec['startup_s']:.0f} s, {rec['wall_s']:.0f} s in all", flush=True)


def summarize(out: Path) -> int:
    plan = json.loads((out / "plan.json").read_text())
    starts = read_starts(out)
    s = summary(starts, plan["values"], read_left_out(out))
    (out / "summary.json").write_text(json.dumps({"plan": plan, **s}, indent=1))
    print(f"\n{len(starts)} starts in {out}")
    print(report(plan, s))
    return 0


def _interrupted(*_):
    raise KeyboardInterrupt


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("params", nargs="?")
    ap.add_argument("--knob", choices=KNOBS, default="max_num_batched_tokens")
    ap.add_argument("--launch", type=int, help="the lowered start's launch value (the largest)")
    ap.add_argument("--values", default="", help="the values compared, e.g. 2048,512")
    ap.add_argument("--pairs", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=1, help="rounds per value in every start")
    ap.add_argument("--seed", type=int, default=0, help="shuffles the values' order in each pair")
    ap.add_argument("--fresh-scheduler", choices=("vllm", "kit"), default="vllm",
                    help="the fresh starts' scheduler: vLLM's own, or the kit's live-limits one at their value")
    ap.add_argument("--kit-measuring", action="store_true",
                    help="the lowered start also carries the kit's counting flags and its 0.5 s sampling")
    ap.add_argument("--minutes", type=float, default=0, help="begin no start that would end after this (0: no limit)")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--summarize", type=Path, metavar="DIR", help="print the summary of DIR's files, run nothing")
    ap.add_argument("--plan", type=Path, metavar="DIR",
                    help="from DIR's starts, print the pairs x rounds a verdict within --within needs, run nothing")
    ap.add_argument("--metric", choices=METRICS, default="ttft_p90_ms", help="--plan's metric")
    ap.add_argument("--within", type=float, default=LOOSE, help="--plan's bound on kit / plain - 1 (0.05: +-5%%)")
    ap.add_argument("--requests", type=int, help="--plan's requests a round (default: the run's)")
    a = ap.parse_args()
    if a.summarize:
        return summarize(a.summarize)
    if a.plan:
        plan = json.loads((a.plan / "plan.json").read_text())
        starts = read_starts(a.plan)
        left_out = unpaired(starts, read_left_out(a.plan))  # a machine's own speed is no start-to-start spread
        try:
            for v in plan["values"]:
                print(plan_report(verdict_plan([s for s in starts if s["pair"] not in left_out], v, a.metric,
                                               a.within, a.requests,
                                               values=len(plan["values"]))))
        except ValueError as e:   # too little measured to plan from
            raise SystemExit(f"{a.plan}: {e}") from None
        return 0
    missing = [n for n, v in (("params", a.params), ("--launch", a.launch), ("--values", a.values),
                              ("--out", a.out)) if not v]
    if missing or a.pairs < 1 or a.rounds < 1:
        ap.error(f"give {', '.join(missing)}" if missing else "--pairs and --rounds must be at least 1")
    signal.signal(signal.SIGTERM, _interrupted)  # a timeout's TERM stops the server too, as Ctrl-C does
    try:
        run(a)
    except KeyboardInterrupt:
        print("\ninterrupted: finished starts are kept; rerun with the same --out to go on", flush=True)
    return summarize(a.out)


if __name__ == "__main__":
    sys.exit(main())
