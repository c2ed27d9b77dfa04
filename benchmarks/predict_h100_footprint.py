"""The simulator against one GPU: the step-time model fitted from the step records of a
few starts of the kit's server on one GPU, and the study's rounds replayed in vLLM's own
scheduler beside what the other starts measured.

The input is a run of benchmarks/live_knobs_equivalence.py with --kit-measuring (not a
sweep's run folder: no manifest, no start.json): its `starts.jsonl` (each start's
measured rounds and KV pool) and, for each start that ran the kit's scheduler, every
engine step of the start in `pair<k>-lowered/steps/r0.npz` (warm-up and rounds in one
array). This script

1. cuts each start's steps into the warm-up and its rounds at the engine's idle gaps
   (split_idle: the rounds' clock times were not kept, but the kit resets the prefix
   cache and waits between rounds, so the engine idles there far longer than inside a
   closed-loop round) and checks each piece's token counts against the requests it
   should hold (a piece whose counts fall short lost step rows: it is left out);
2. fits the step-time model (predict/step_model.fit) from the rounds of the --fit starts,
   its K-fold held-out error by round, and its per-step error on the other starts' rounds;
3. replays the study's rounds in simulation (predict/start.SimulatedStart: the study's own
   prompts, the starts' KV pool and block size, AsyncScheduler as a GPU engine runs) with
   whichever vLLM is first on the path, and sets the predicted figures beside the
   per-start medians of the held-out starts (their min / median / max over starts);
4. compares the simulated rounds' steps with the recorded ones (steps, prefill, cached
   and decode tokens, busy time) and reports the engine's idle time inside measured
   rounds, which the simulator has none of.

    PYTHONPATH=lib python benchmarks/predict_h100_footprint.py \\
        results/live-knobs-equivalence/20261207-h100-kit-footprint --fit 0,1 [--json OUT.json]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "lib"))

from vllm_study.predict import step_model  # noqa: E402
from vllm_study.prefix_budget import steps  # noqa: E402
from vllm_study.records.results import git_state

# The engine idles between a round's last output and the next round's first request for
# the prefix-cache reset, the counters' scrapes and the client's start (0.6 s on the H100
# run), and between the warm-up and the first round (0.2 s); inside a closed-loop round
# it idles only while a finished request's successor goes through the client and the API
# server (30-60 ms there). 0.1 s lies between.
IDLE_S = 0.1
FIGURES = ("ttft_p50_ms", "ttft_p90_ms", "itl_p99_ms", "tpot_p50_ms", "output_throughput")


# -- the step records ------------------------------------------------------------------
def split_idle(rows: np.ndarray, min_idle_s: float = IDLE_S) -> list[np.ndarray]:
    """A start's steps (steps.DTYPE, in order) cut where the engine sat idle: where a
    step was scheduled more than `min_idle_s` after the previous step's output came
    back. Under async scheduling a busy engine schedules the next step before the
    previous output is back, so only an engine with nothing to run leaves such a gap.
    Written here (no library splits on it) because the kit's own rounds are cut by the
    client's clock, which this run did not keep."""
    if min_idle_s <= 0:
        raise ValueError(f"min_idle_s must be positive, not {min_idle_s}")
    if len(rows) < 2:
        return [rows] if len(rows) else []
    if np.any(np.diff(rows["t_scheduled"]) < 0):
        raise ValueError("step rows are not in schedule order: give a start's records as the engine wrote them")
    idle = rows["t_scheduled"][1:] - rows["t_done"][:-1]
    cuts = np.flatnonzero(idle > min_idle_s) + 1
    return np.split(rows, cuts)


def tally(rows: np.ndarray) -> dict:
    """A piece of step records' counts: steps, tokens, requests admitted (a request's
    prompt is its prefill plus its cached tokens) and the engine's busy time."""
    busy_rows, c = step_model.busy(rows)
    return {"steps": int(len(rows)), "prefill_tokens": int(rows["prefill_tokens"].sum()),
            "cached_tokens": int(rows["cached_tokens"].sum()), "decode_tokens": int(rows["decode_tokens"].sum()),
            "span_s": float(rows["t_done"][-1] - rows["t_scheduled"][0]) if len(rows) else 0.0,
            "busy_s": float(c.sum()), "cycle_ms": float(1e3 * c.mean()) if len(c) else None}


def complete(t: dict, requests: int, prompt_tokens: int, output_tokens: int) -> bool:
    """Whether a piece's counts account for `requests` requests of these lengths (every
    prompt token computed or found in the cache; every output token past the first
    decoded: the first is sampled by the prompt's last step)."""
    return (t["prefill_tokens"] + t["cached_tokens"] == requests * prompt_tokens
            and t["decode_tokens"] == requests * (output_tokens - 1))


def rounds_of(rows: np.ndarray, n_rounds: int, warmup: int, requests: int, prompt_tokens: int,
              output_tokens: int) -> tuple[list[np.ndarray | None], list[dict], str | None]:
    """A start's measured rounds from its whole-start records: (rounds, each piece's
    tally, why not). Rounds that do not account for their requests are None."""
    pieces = split_idle(rows)
    tallies = [tally(p) for p in pieces]
    if len(pieces) != n_rounds + (1 if warmup else 0):
        return [None] * n_rounds, tallies, (f"{len(pieces)} idle-separated pieces, not {n_rounds} rounds"
                                            + (" and the warm-up" if warmup else ""))
    if warmup:
        pieces, tallies_r = pieces[1:], tallies[1:]
        tallies[0]["complete"] = complete(tallies[0], warmup, prompt_tokens, output_tokens)
    else:
        tallies_r = tallies
    out = []
    for p, t in zip(pieces, tallies_r):
        t["complete"] = complete(t, requests, prompt_tokens, output_tokens)
        out.append(p if t["complete"] else None)
    return out, tallies, None


def admitted(r: np.ndarray, prompt_tokens: int) -> np.ndarray | None:
    """Requests admitted in each step, where every prompt (of `prompt_tokens`) is computed
    whole in the step that admits it (no chunk carried over): its cached and prefill
    tokens then add up to whole prompts step by step. None where they do not."""
    whole = r["prefill_tokens"].astype(np.int64) + r["cached_tokens"]
    return None if np.any(whole % prompt_tokens) else whole // prompt_tokens


def engine_side(r: np.ndarray, prompt_tokens: int) -> dict | None:
    """What a round's steps alone say of its latencies, nothing outside the engine
    counted. A request admitted in step k arrived after step k-1 was scheduled (else
    k-1 would have taken it: no round here ever left a request waiting) and no later
    than step k was, and got its first token at step k's output: its time to first
    token inside the engine lies in [t_done(k) - t_scheduled(k), t_done(k) -
    t_scheduled(k-1)]. A running request gets a token from every step (no preemption),
    so the gaps between its tokens are the step cycles, one per decoding request."""
    n = admitted(r, prompt_tokens)
    if n is None:
        return None
    prev = np.concatenate([r["t_scheduled"][:1], r["t_scheduled"][:-1]])
    lo = np.repeat(r["t_done"] - r["t_scheduled"], n)
    hi = np.repeat(r["t_done"] - prev, n)
    itl = np.repeat(steps.cycles(r), r["decode_reqs"])
    return {"requests": int(n.sum()), "ttft_lo_p50_ms": 1e3 * float(np.median(lo)),
            "ttft_hi_p50_ms": 1e3 * float(np.median(hi)), "ttft_hi_p90_ms": 1e3 * float(np.quantile(hi, 0.9)),
            "itl_p50_ms": 1e3 * float(np.median(itl)), "itl_p99_ms": 1e3 * float(np.quantile(itl, 0.99)),
            "max_waiting": int(r["waiting"].max()), "preempted": int(r["preempted"].sum())}


def _lead_design(r: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(design with the next step's prefill requests and tokens added, cycles, kinds:
    0 decode-only, 1 a prefill, 2 decode-only before a prefill) of a round's busy steps."""
    br, c = step_model.busy(r)
    nxt_req = np.r_[br["prefill_reqs"][1:], 0].astype(float)
    nxt_tok = np.r_[br["prefill_tokens"][1:], 0].astype(float)
    base = np.column_stack([np.ones(len(br))] + [br[f].astype(float) for f in step_model.FEATURES])
    kind = np.where(br["prefill_reqs"] > 0, 1, np.where(nxt_req > 0, 2, 0))
    return np.column_stack([base, nxt_req, nxt_tok]), c, kind


def _lead_check(model, train: list[np.ndarray], test: list[np.ndarray]) -> dict:
    """The step model's error where a step precedes a prefill, and a fit with the next
    step's prefill requests and tokens as terms (nonnegative least squares, as
    step_model fits; scipy's lsq_linear)."""
    from scipy.optimize import lsq_linear
    Xtr, ytr, _ = (np.concatenate(x) for x in zip(*map(_lead_design, train)))
    Xte, yte, kind = (np.concatenate(x) for x in zip(*map(_lead_design, test)))
    scale = np.maximum(np.abs(Xtr).max(axis=0), 1e-12)
    coef = lsq_linear(Xtr / scale, ytr, bounds=(0, np.inf), method="bvls").x / scale
    lead = np.abs(Xte @ coef - yte) / yte
    base = np.abs(Xte[:, :-2] @ np.array([model.coef[t] for t in step_model.TERMS]) - yte) / yte
    ms = lambda k: [float(1e3 * np.quantile(yte[kind == k], q)) for q in (0.1, 0.5, 0.9)]  # noqa: E731
    return {"before_ms": ms(2), "other_ms": ms(0), "before_err": float(np.median(base[kind == 2])),
            "base_prefill": float(np.median(base[kind == 1])), "lead_median": float(np.median(lead)),
            "lead_p90": float(np.quantile(lead, 0.9)), "lead_prefill": float(np.median(lead[kind == 1])),
            "lead_before": float(np.median(lead[kind == 2])),
            "lead_coef_ms": [float(1e3 * x) for x in coef]}


def admit_ms(r: np.ndarray, concurrency: int, prompt_tokens: int) -> float | None:
    """Milliseconds a request took to reach the engine while a round's first
    `concurrency` requests (sent at once by a closed loop) went through the API server:
    the time from the round's first step to the step that admitted the last of them,
    over the others."""
    n = admitted(r, prompt_tokens)
    if n is None or concurrency < 2:
        return None
    k = np.flatnonzero(np.cumsum(n) >= concurrency)
    return float(1e3 * (r["t_scheduled"][k[0]] - r["t_scheduled"][0]) / (concurrency - 1)) if len(k) else None


def closed_loop_front(engine, prompts, requests, concurrency: int, admit_s: float) -> list[dict]:
    """traffic.closed_loop with a serial front end before the engine: each request
    reaches the engine `admit_s` after the previous one did (or after its own send),
    as one API server process tokenizing and forwarding requests one at a time would;
    TTFT and end-to-end latency run from the client's send. A sensitivity check, not
    the kit's simulator: the front end's cost here is one number read from the records."""
    from vllm_study.measure.client import RequestResult
    todo = list(requests)[::-1]
    sent: dict[str, tuple] = {}
    free = [engine.now]

    def send(_key=None, t=None):
        if todo:
            r = todo.pop()
            t = engine.now if t is None else t
            free[0] = max(t, free[0]) + admit_s
            sent[engine.submit(r.index, prompts.ids(r), r.max_tokens, at=free[0])] = (r, t)
    for _ in range(min(concurrency, len(todo))):
        send()
    engine.run(send)
    out = []
    for rid, (r, t_send) in sent.items():
        tr = engine.tracked[rid]
        res = RequestResult(index=r.index, send_time=t_send, end_time=tr.end_time, prompt_tokens=tr.prompt_tokens,
                            output_tokens=len(tr.token_times), tags=dict(r.tags))
        res.ttft_s, res.e2e_s = tr.token_times[0] - t_send, tr.end_time - t_send
        res.itl_s = [b - a for a, b in zip(tr.token_times, tr.token_times[1:])]
        out.append(res.to_dict())
    return out


# -- the run ---------------------------------------------------------------------------
def load_run(run: Path) -> tuple[dict, list[dict]]:
    plan = json.loads((run / "plan.json").read_text())
    starts = [json.loads(line) for line in (run / "starts.jsonl").read_text().splitlines() if line.strip()]
    kit = [s for s in starts if (run / f"pair{s['pair']}-{s['way']}" / steps.ROUNDS_DIR / "r0.npz").exists()]
    if not kit:
        raise SystemExit(f"{run}: no start has steps/r0.npz (a --kit-measuring run of live_knobs_equivalence.py?)")
    return plan, sorted(kit, key=lambda s: s["pair"])


def server_version(log: Path) -> str | None:
    """vLLM's version as the start's server logged it (`... LLM engine (v0.26.0) ...`)."""
    import gzip
    import re
    with gzip.open(log, "rt", errors="replace") as f:
        for line in f:
            m = re.search(r"LLM engine \(v([^)]+)\)", line)
            if m:
                return m.group(1)
    return None


def study_and_point(params: Path, knob: str, value: int):
    from vllm_study.define.grid import PointPlan, expand
    from vllm_study.define.study_file import load_study, study_from_dict
    s = load_study(params)
    study = study_from_dict({**s.model_dump(exclude_unset=True), "grid": {knob: [value]}})
    [point] = expand(study, "gpu")
    return study, point, PointPlan(study=study, point=point, engine="gpu")


def scope_for(study, point, cache_config: dict, device: str, version: str) -> step_model.Scope:
    eff = point.effective
    return step_model.Scope(model=study.model.card or study.model.path or study.model.served_name, device=device,
                            dtype=str(study.engine_args.dtype), vllm_version=version, engine="gpu",
                            launch={"max_num_batched_tokens": eff.max_num_batched_tokens,
                                    "max_num_seqs": eff.max_num_seqs, "block_size": int(cache_config["block_size"]),
                                    "enforce_eager": bool(study.engine_args.enforce_eager),
                                    "tensor_parallel_size": int(study.engine_args.tensor_parallel_size or 1)})


def _median_rounds(start: dict, figure: str) -> float:
    return float(np.median([r["metrics"][figure] for r in start["rounds"]]))


def _commit() -> str | None:
    """The kit's commit, as a run records it (records.results.git_state: git, or in a copy
    without .git, VLLM_STUDY_GIT_SHA or the stamp file)."""
    return git_state(Path(__file__).resolve().parents[1]).sha


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run", type=Path, help="a --kit-measuring run of live_knobs_equivalence.py")
    ap.add_argument("--fit", default="0,1", help="pairs whose kit starts the step model is fitted from (default 0,1)")
    ap.add_argument("--device", default="NVIDIA H100 80GB HBM3", help="the GPU the run measured (nvidia-smi's name)")
    ap.add_argument("--json", type=Path, help="write the figures here too")
    a = ap.parse_args()
    import vllm
    plan, starts = load_run(a.run)
    fit_pairs = [int(x) for x in a.fit.split(",")]
    if missing := set(fit_pairs) - {s["pair"] for s in starts}:
        raise SystemExit(f"--fit names pairs with no step records: {sorted(missing)}")
    params = Path(__file__).resolve().parents[1] / plan["params"]
    study, point, pplan = study_and_point(params, plan["knob"], plan["launch"])
    w = study.workload
    from transformers import AutoTokenizer

    from vllm_study.define import models
    from vllm_study.workload.build_workload import make_workload
    tok = AutoTokenizer.from_pretrained(models.resolve(study.model)[0])
    wl = make_workload(tok, w)
    lengths = {r.prompt_tokens for r in wl.requests(w.requests_per_round)}
    if len(lengths) != 1:
        raise SystemExit(f"prompts of {sorted(lengths)} tokens: the token check wants one prompt length")
    [prompt_tokens] = lengths
    versions = {server_version(a.run / f"pair{s['pair']}-{s['way']}" / "server.log.gz") for s in starts}
    if len(versions) != 1 or None in versions:
        raise SystemExit(f"the starts' servers logged vLLM versions {versions}: one version is needed")
    [gpu_version] = versions
    blocks = {(s["cache_config"]["num_gpu_blocks"], s["cache_config"]["block_size"]) for s in starts}
    print(f"run {a.run} ({plan['params']}): {len(starts)} starts with step records, vLLM {gpu_version} on the GPU, "
          f"KV pools (blocks, block size) {sorted(blocks)}; prompts {prompt_tokens} tokens, {w.output_tokens} out, "
          f"{w.requests_per_round} a round, {w.concurrency} in flight, {w.warmup_requests} warm-up")
    out: dict = {"run": str(a.run), "commit": _commit(), "gpu_vllm": gpu_version, "sim_vllm": vllm.__version__,
                 "device": a.device, "fit_pairs": fit_pairs, "starts": {}}

    # 1. cut into rounds
    rounds: dict[int, list] = {}
    print(f"\n1. each start's steps cut at idle gaps over {IDLE_S} s (warm-up, then rounds):")
    for s in starts:
        rows = steps.load_round(a.run / f"pair{s['pair']}-{s['way']}" / steps.ROUNDS_DIR / "r0.npz")
        rs, tallies, why = rounds_of(rows, len(s["rounds"]), w.warmup_requests, w.requests_per_round,
                                     prompt_tokens, w.output_tokens)
        rounds[s["pair"]] = rs
        body = []
        for k, t in enumerate(tallies):
            name = "warm-up" if (w.warmup_requests and k == 0) else f"r{k - (1 if w.warmup_requests else 0)}"
            measured = ""
            if name != "warm-up" and why is None:
                m = s["rounds"][int(name[1:])]["metrics"]["duration_s"]
                measured = f", client {m:.2f} s"
            body.append(f"{name} {t['steps']} steps {t['span_s']:.2f} s{measured}"
                        + ("" if t.get("complete", True) else " INCOMPLETE"))
        print(f"  pair {s['pair']}: {len(rows)} rows: " + "; ".join(body) + (f" ({why})" if why else ""))
        out["starts"][s["pair"]] = {"rows": int(len(rows)), "pieces": tallies, "why_not": why}

    # 2. fit
    scope = scope_for(study, point, starts[0]["cache_config"], a.device, gpu_version)
    train = [r for p in fit_pairs for r in rounds[p] if r is not None]
    model = step_model.fit(train, scope)
    c = model.coef
    print(f"\n2. step model from pairs {fit_pairs} ({model.rounds} rounds, {model.steps} busy steps):")
    print(f"  cycle = {1e3 * c['overhead_s']:.3f} ms" + "".join(
        f" + {1e6 * c[t]:.4g} us x {f}" for t, f in zip(step_model.TERMS[1:], step_model.FEATURES)))
    print("  observed ranges: " + ", ".join(f"{f} {lo:g}..{hi:g}" for f, (lo, hi) in model.ranges.items()))
    h = model.held_out
    print(f"  K-fold held out by round ({h.folds} folds, {h.steps} steps): per-step |error| median "
          f"{100 * h.median:.1f}%, P90 {100 * h.p90:.1f}%")
    out["model"] = model.model_dump()
    held, refused = {}, {}
    for s in starts:
        if s["pair"] in fit_pairs:
            continue
        for k, r in enumerate(rounds[s["pair"]]):
            if r is None:
                continue
            br, cyc = step_model.busy(r)
            try:
                model.check(scope, br)
            except step_model.Extrapolation as e:  # recorded, not hidden: such a round's steps are left out
                refused[(s["pair"], k)] = str(e)
                continue
            pred = model.predict(br)
            rel = (pred - cyc) / cyc
            held[(s["pair"], k)] = {"steps": len(br), "abs_rel": np.abs(rel), "total": pred.sum() / cyc.sum() - 1,
                                    "decode_only": (br["prefill_reqs"] == 0), "rel": rel}
    for (p, k), why in refused.items():
        print(f"  pair {p} r{k}: REFUSED, {why}")
    allrel = np.concatenate([v["abs_rel"] for v in held.values()])
    dec = np.concatenate([v["decode_only"] for v in held.values()])
    signed = np.concatenate([v["rel"] for v in held.values()])
    totals = np.array([v["total"] for v in held.values()])
    print(f"  the other starts' {len(held)} complete rounds ({len(allrel)} steps): per-step |error| median "
          f"{100 * np.median(allrel):.1f}%, P90 {100 * np.quantile(allrel, 0.9):.1f}% (decode-only steps "
          f"{100 * np.median(allrel[dec]):.1f}% / {100 * np.quantile(allrel[dec], 0.9):.1f}%, steps with a prefill "
          f"{100 * np.median(allrel[~dec]):.1f}% / {100 * np.quantile(allrel[~dec], 0.9):.1f}%); signed median "
          f"{100 * np.median(signed):+.1f}%; a round's summed step time {100 * totals.min():+.1f}% .. "
          f"{100 * totals.max():+.1f}% (median {100 * np.median(totals):+.1f}%)")
    out["held_out_starts"] = {"rounds": len(held),
                              "refused": {f"pair{p} r{k}": why for (p, k), why in refused.items()},
                              "steps": int(len(allrel)), "median": float(np.median(allrel)),
                              "p90": float(np.quantile(allrel, 0.9)),
                              "decode_only_median": float(np.median(allrel[dec])),
                              "prefill_median": float(np.median(allrel[~dec])),
                              "signed_median": float(np.median(signed)),
                              "round_total": [float(totals.min()), float(np.median(totals)), float(totals.max())]}

    # where a step's cost lands: under async scheduling the next step is scheduled (and its
    # inputs prepared) before this one's output is back, so admitting requests may show in
    # the cycle of the step before the one that computes them
    lead = _lead_check(model, [r for p in fit_pairs for r in rounds[p] if r is not None],
                       [r for s in starts if s["pair"] not in fit_pairs for r in rounds[s["pair"]] if r is not None])
    out["lead_check"] = lead
    print(f"  decode-only steps just before a step with a prefill: measured cycle median {lead['before_ms'][1]:.1f} ms "
          f"(P10 {lead['before_ms'][0]:.1f}, P90 {lead['before_ms'][2]:.1f}) against {lead['other_ms'][1]:.1f} ms for "
          f"other decode-only steps; the model's per-step |error| on them {100 * lead['before_err']:.0f}% (median)")
    print(f"  with the next step's prefill requests and tokens as two more terms (same data, a diagnostic, not "
          f"the kit's model): per-step |error| on the other starts median {100 * lead['lead_median']:.1f}%, P90 "
          f"{100 * lead['lead_p90']:.1f}%; steps with a prefill {100 * lead['lead_prefill']:.0f}%, the steps just "
          f"before them {100 * lead['lead_before']:.0f}% (without: {100 * lead['base_prefill']:.0f}%, "
          f"{100 * lead['before_err']:.0f}%)")

    # 3. replay
    from vllm_study.predict.start import SimulatedStart, StudyInputs
    [(num_blocks, block_size)] = blocks if len(blocks) == 1 else [max(blocks)]
    cfg = {"num_gpu_blocks": num_blocks, "block_size": block_size, "enable_prefix_caching": "True"}
    sim = SimulatedStart(pplan, model, cache_config=cfg, async_scheduling=True, inputs=StudyInputs(study, tok))
    print(f"\n3. replay: vLLM {vllm.__version__} {type(sim.engine.scheduler).__name__}, {num_blocks} blocks of "
          f"{block_size}, the study's {w.requests_per_round} prompts closed loop at {w.concurrency}, "
          f"{len(starts[0]['rounds'])} rounds (prefix cache reset before each)")
    sims = [sim.run_round(i) for i in range(len(starts[0]["rounds"]))]
    try:  # the simulator steps with the model wherever vLLM's scheduler takes it
        model.check(scope, np.concatenate([r.steps for r in sims]))
        out["sim_extrapolates"] = None
    except step_model.Extrapolation as e:
        out["sim_extrapolates"] = str(e)
        r0 = sims[0].steps
        n_out = int(np.any([r0[f] > model.ranges[f][1] for f in step_model.FEATURES], axis=0).sum())
        print(f"  NOTE: {n_out} of a simulated round's {len(r0)} steps lie outside the fitted range: {e}")
    wall = sum(r.wall_s for r in sims)
    virt = sum(r.virtual_s for r in sims)
    heldout = [s for s in starts if s["pair"] not in fit_pairs]
    print(f"  {'figure':18s} {'predicted':>10s} {'held-out starts (median of 3 rounds each)':>44s}  inside  error vs "
          "median")
    fig = {}
    for f in FIGURES:
        pred = [r.values[f] for r in sims]
        meds = np.array([_median_rounds(s, f) for s in heldout])
        lo, md, hi = meds.min(), float(np.median(meds)), meds.max()
        p = float(np.median(pred))
        inside = lo <= p <= hi
        print(f"  {f:18s} {p:10.2f} {'min ' + f'{lo:.2f}':>14s} {'median ' + f'{md:.2f}':>16s} "
              f"{'max ' + f'{hi:.2f}':>12s}  {'yes' if inside else 'NO':>6s}  {100 * (p / md - 1):+.1f}%"
              + ("" if max(pred) - min(pred) < 1e-9 * max(1, abs(p))
                 else f"  (sim rounds {min(pred):.2f}..{max(pred):.2f})"))
        fig[f] = {"predicted": p, "predicted_rounds": pred, "starts": meds.tolist(), "min": float(lo), "median": md,
                  "max": float(hi), "inside": bool(inside)}
    out["figures"] = fig
    print(f"  simulation: {virt:.2f} s of virtual time in {wall:.2f} s of one core: {virt / wall:.1f} x real time")
    out["sim"] = {"wall_s": wall, "virtual_s": virt, "x_real_time": virt / wall}

    # 4. the steps themselves
    print("\n4. simulated rounds' steps beside the recorded complete rounds (held-out starts: min / median / max):")
    rec = [tally(r) | {"complete": True} for s in heldout for r in rounds[s["pair"]] if r is not None]
    simt = [tally(r.steps) for r in sims]
    for key in ("steps", "prefill_tokens", "cached_tokens", "decode_tokens", "busy_s", "cycle_ms"):
        v = np.array([t[key] for t in rec], dtype=float)
        print(f"  {key:15s} simulated {simt[0][key]:10.4g}   recorded {v.min():10.4g} {np.median(v):10.4g} "
              f"{v.max():10.4g}")
    for t in simt:
        t["complete"] = complete(t, w.requests_per_round, prompt_tokens, w.output_tokens)
    print(f"  prefill + cached = {w.requests_per_round} x {prompt_tokens} prompt tokens and decode = "
          f"{w.requests_per_round} x {w.output_tokens - 1}: simulated {[t['complete'] for t in simt]}, recorded "
          f"{sum(t['complete'] for t in rec)} of {len(rec)}")
    first = [r.steps[:3] for r in sims[:1]][0]
    print("  a round's first 3 steps, simulated (prefill tokens/requests, cached): "
          + "; ".join(f"{int(x['prefill_tokens'])}/{int(x['prefill_reqs'])}, {int(x['cached_tokens'])}" for x in first))
    r0 = next(r for s in heldout for r in rounds[s["pair"]] if r is not None)
    print("  ... recorded (one held-out round):             "
          + "; ".join(f"{int(x['prefill_tokens'])}/{int(x['prefill_reqs'])}, {int(x['cached_tokens'])}"
                      for x in r0[:3]))
    idle, gaps, dur = [], [], []
    for s in heldout:
        for k, r in enumerate(rounds[s["pair"]]):
            if r is None:
                continue
            g = r["t_scheduled"][1:] - r["t_done"][:-1]
            idle.append(float(g[g > 0].sum()))
            gaps.append(int((g > 0.005).sum()))
            dur.append(s["rounds"][k]["metrics"]["duration_s"] - (r["t_done"][-1] - r["t_scheduled"][0]))
    print(f"  engine idle inside a measured round (its next step scheduled after the previous output): "
          f"{np.median(idle):.3f} s a round (median; {min(idle):.3f}..{max(idle):.3f}), in {int(np.median(gaps))} "
          f"gaps over 5 ms; the simulator's rounds: 0")
    print(f"  the client's round (first send to last answer) less the engine's (first step scheduled to last "
          f"output): {1e3 * np.median(dur):.0f} ms (median; {1e3 * min(dur):.0f}..{1e3 * max(dur):.0f})")
    sim_dur = [r.values["duration_s"] for r in sims]
    print(f"  round duration: simulated {np.median(sim_dur):.3f} s; measured (held-out starts' rounds) "
          f"{np.median([x['metrics']['duration_s'] for s in heldout for x in s['rounds']]):.3f} s")
    # the engine's side of the latencies, recorded and simulated alike
    print("\n  inside the engine (the steps alone; TTFT bounded by the admitting step's schedule times, ITL the "
          "step cycles), beside the client's figures:")
    print(f"  {'round':10s} {'client TTFT P50':>15s} {'engine TTFT P50 in':>22s} {'engine P90 <=':>13s} "
          f"{'client ITL P99':>14s} {'engine ITL P99':>14s}")
    eng_rows = []
    for s in heldout:
        for k, r in enumerate(rounds[s["pair"]]):
            e = engine_side(r, prompt_tokens) if r is not None else None
            if e is None:
                continue
            m = s["rounds"][k]["metrics"]
            eng_rows.append((m["ttft_p50_ms"], e["ttft_hi_p50_ms"], m["itl_p99_ms"], e["itl_p99_ms"]))
            print(f"  pair {s['pair']} r{k}  {m['ttft_p50_ms']:15.1f} {e['ttft_lo_p50_ms']:10.1f} .. "
                  f"{e['ttft_hi_p50_ms']:7.1f} {e['ttft_hi_p90_ms']:13.1f} {m['itl_p99_ms']:14.2f} "
                  f"{e['itl_p99_ms']:14.2f}" + (f"  (waiting up to {e['max_waiting']})" if e["max_waiting"] else ""))
    sim_e = engine_side(sims[0].steps, prompt_tokens)
    if sim_e:
        print(f"  {'simulated':10s} {sims[0].values['ttft_p50_ms']:15.1f} {sim_e['ttft_lo_p50_ms']:10.1f} .. "
              f"{sim_e['ttft_hi_p50_ms']:7.1f} {sim_e['ttft_hi_p90_ms']:13.1f} {sims[0].values['itl_p99_ms']:14.2f} "
              f"{sim_e['itl_p99_ms']:14.2f}")
    er = np.array(eng_rows)
    from scipy import stats as sps
    rho_t = sps.spearmanr(er[:, 0], er[:, 1])
    rho_i = sps.spearmanr(er[:, 2], er[:, 3])
    outside = er[:, 0] - er[:, 1]
    print(f"  over {len(er)} rounds: client TTFT P50 less the engine's upper bound {np.median(outside):.0f} ms "
          f"(median; {outside.min():.0f}..{outside.max():.0f}); Spearman rho client vs engine: TTFT P50 "
          f"{rho_t.statistic:.2f} (p {rho_t.pvalue:.2g}), ITL P99 {rho_i.statistic:.2f} (p {rho_i.pvalue:.2g})")
    out["engine_side"] = {"rounds": eng_rows, "simulated": sim_e, "ttft_p50_outside_ms": outside.tolist(),
                          "spearman_ttft": float(rho_t.statistic), "spearman_itl": float(rho_i.statistic)}

    # 5. a serial front end before the engine, its cost read from the records
    adm = [x for s in heldout for r in rounds[s["pair"]] if r is not None
           and (x := admit_ms(r, w.concurrency, prompt_tokens)) is not None]
    a_ms = float(np.median(adm))
    from vllm_study.measure import stats
    from vllm_study.predict.simulator import VirtualEngine
    fe = VirtualEngine(sim.spec, model)
    wl_sim, prompts = sim.workloads[0], sim.prompts[0]
    fronted = []
    for _ in range(len(sims)):
        fe.scheduler.reset_prefix_cache()
        n0 = len(fe.steps())
        res = closed_loop_front(fe, prompts, wl_sim.requests(w.requests_per_round), w.concurrency, a_ms / 1e3)
        dur = max(r["end_time"] for r in res) - min(r["send_time"] for r in res)
        fronted.append((stats.round_metrics(res, dur), fe.steps()[n0:]))
    print(f"\n5. the same rounds with a serial front end: each request reaches the engine {a_ms:.2f} ms after the "
          f"previous one (the held-out rounds' median time to admit a round's first {w.concurrency}, "
          f"{min(adm):.2f}..{max(adm):.2f} ms a request); not the kit's simulator, a check of where the error is")
    for f in FIGURES:
        p = float(np.median([v[f] for v, _ in fronted]))
        print(f"  {f:18s} {p:10.2f}  inside {'yes' if fig[f]['min'] <= p <= fig[f]['max'] else 'NO':>3s}  "
              f"{100 * (p / fig[f]['median'] - 1):+.1f}% vs the held-out median")
    ft = tally(fronted[0][1])
    print(f"  steps {ft['steps']}, busy {ft['busy_s']:.3f} s; first 3 steps: " + "; ".join(
        f"{int(x['prefill_tokens'])}/{int(x['prefill_reqs'])}, {int(x['cached_tokens'])}" for x in fronted[0][1][:3]))
    out["front_end"] = {"admit_ms": a_ms, "admit_ms_range": [min(adm), max(adm)],
                        "figures": {f: float(np.median([v[f] for v, _ in fronted])) for f in FIGURES},
                        "steps": ft["steps"], "busy_s": ft["busy_s"]}
    out["steps_check"] = {"simulated": simt, "recorded_complete": len(rec), "idle_in_round_s": idle,
                          "client_less_engine_s": dur, "sim_duration_s": sim_dur}
    if a.json:
        a.json.write_text(json.dumps(out, indent=1, default=lambda x: x.tolist() if hasattr(x, "tolist") else str(x)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
