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
   beside its row-wise form (no next-step terms: the kit's model before them), their
   K-fold held-out error by round and their per-step error on the other starts' rounds
   (decode-only steps, steps with a prefill, and the decode-only steps just before one);
   and the front end (predict/front_end.fit: the API server's hand-over spacing and the
   latency outside the engine) from the same rounds, and again from the other starts'
   rounds as a check of its spread;
3. replays the study's rounds in simulation (predict/start.SimulatedStart: the study's own
   prompts, the starts' KV pool and block size, AsyncScheduler as a GPU engine runs) with
   whichever vLLM is first on the path, three ways (row-wise without front end, next-step
   terms without, next-step terms with the front end: the kit's), and sets the predicted
   figures beside the per-start medians of the held-out starts (their min / median / max
   over starts);
4. compares the kit's simulated rounds' steps with the recorded ones (steps, prefill,
   cached and decode tokens, busy time) and the engine's own TTFT and ITL P99 from the
   steps alone, recorded and simulated.

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

from vllm_study.define.tokenizer import load as load_tokenizer  # noqa: E402
from vllm_study.predict import step_model  # noqa: E402
from vllm_study.scheduler_plugin import steps  # noqa: E402
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
    from vllm_study.define import models
    from vllm_study.workload.build_workload import make_workload
    tok = load_tokenizer(models.resolve(study.model)[0])
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

    # 2. fit: the kit's model (next-step terms: where an async engine pays for admitting) beside the
    # row-wise form it had before, and the front end from the same starts' rounds
    scope = scope_for(study, point, starts[0]["cache_config"], a.device, gpu_version)
    train = [r for p in fit_pairs for r in rounds[p] if r is not None]
    model = step_model.fit(train, scope)
    rowwise = step_model.fit(train, scope, lead=False)
    print(f"\n2. step model from pairs {fit_pairs} ({model.rounds} rounds, {model.steps} busy steps):")
    for name, m in (("row-wise", rowwise), ("next-step terms", model)):
        c = m.coef
        print(f"  {name}: cycle = {1e3 * c['overhead_s']:.3f} ms" + "".join(
            f" + {1e6 * c[t]:.4g} us x {t.removeprefix('per_').removesuffix('_s')}" for t in step_model.TERMS[1:]
            if c.get(t)))
        h = m.held_out
        print(f"    K-fold held out by round ({h.folds} folds, {h.steps} steps): per-step |error| median "
              f"{100 * h.median:.1f}%, P90 {100 * h.p90:.1f}%")
    print("  observed ranges: " + ", ".join(f"{f} {lo:g}..{hi:g}" for f, (lo, hi) in model.ranges.items())
          + f"; check refuses past {step_model.RANGE_MARGIN:g} x the maximum")
    out["model"] = model.model_dump()
    out["model_rowwise"] = rowwise.model_dump()
    heldout = [s for s in starts if s["pair"] not in fit_pairs]
    out["held_out_starts"] = held_out_errors(model, scope, heldout, rounds)
    out["held_out_starts_rowwise"] = held_out_errors(rowwise, scope, heldout, rounds, quiet=True)

    from vllm_study.predict import front_end
    def samples_of(pairs):
        return [front_end.RoundSample(r, [prompt_tokens] * w.requests_per_round,
                                      s["rounds"][k]["metrics"]["ttft_p50_ms"] / 1e3, w.concurrency,
                                      [w.output_tokens] * w.requests_per_round)
                for s in starts if s["pair"] in pairs for k, r in enumerate(rounds[s["pair"]]) if r is not None]
    fscope = front_end.FrontEndScope(api=w.api, model=scope.model, vllm_version=gpu_version,
                                     prompt_tokens=(prompt_tokens, prompt_tokens))
    fe = front_end.fit(samples_of(fit_pairs), fscope)
    model.front_end = fe
    fe_other = front_end.fit(samples_of({s["pair"] for s in heldout}), fscope)
    q = lambda v: f"{1e3 * min(v):.2f}..{1e3 * max(v):.2f}"  # noqa: E731
    for name, f in (("front end from the same starts'", fe), ("the same fit on the held-out starts'", fe_other)):
        print(f"  {name} {f.rounds} rounds: hand-over {1e3 * f.spacing_s:.2f} ms a request (rounds "
              f"{q(f.spacing_rounds)}), latency {1e3 * f.latency_s:.1f} ms (rounds {q(f.latency_rounds)}); client "
              f"TTFT P50 less the engine's {1e3 * np.median(f.gap_rounds):.1f} ms (rounds {q(f.gap_rounds)})")
    out["front_end_model"] = fe.model_dump()
    out["front_end_held_out_fit"] = fe_other.model_dump()

    # 3. replay, each form of the model
    from vllm_study.predict.start import SimulatedStart, StudyInputs
    [(num_blocks, block_size)] = blocks if len(blocks) == 1 else [max(blocks)]
    cfg = {"num_gpu_blocks": num_blocks, "block_size": block_size, "enable_prefix_caching": "True"}
    inputs = StudyInputs(study, tok)
    n_rounds = len(starts[0]["rounds"])
    variants = {"row-wise, no front end (before)": rowwise,
                "next-step terms, no front end": model.model_copy(update={"front_end": None}),
                "next-step terms and front end (the kit)": model}
    print(f"\n3. replay: vLLM {vllm.__version__}, {num_blocks} blocks of {block_size}, the study's "
          f"{w.requests_per_round} prompts closed loop at {w.concurrency}, {n_rounds} rounds (prefix cache reset "
          "before each), beside the held-out starts (median of 3 rounds each)")
    out["variants"] = {}
    for name, m in variants.items():
        sim = SimulatedStart(pplan, m, cache_config=cfg, async_scheduling=True, inputs=inputs)
        sims = [sim.run_round(i) for i in range(n_rounds)]
        fig = figures(sims, heldout)
        try:  # the simulator steps with the model wherever vLLM's scheduler takes it
            m.check(scope, np.concatenate([r.steps for r in sims]))
            ext = None
        except step_model.Extrapolation as e:
            ext = str(e)
        wall, virt = sum(r.wall_s for r in sims), sum(r.virtual_s for r in sims)
        print(f"  {name} ({type(sim.engine.scheduler).__name__}; {virt:.2f} s virtual in {wall:.2f} s, "
              f"{virt / wall:.1f} x real time)" + (f"; EXTRAPOLATES: {ext}" if ext else ""))
        print(f"    {'figure':18s} {'predicted':>10s} {'min':>9s} {'median':>9s} {'max':>9s}  inside  vs median")
        for f, v in fig.items():
            print(f"    {f:18s} {v['predicted']:10.2f} {v['min']:9.2f} {v['median']:9.2f} {v['max']:9.2f}  "
                  f"{'yes' if v['inside'] else 'NO':>6s}  {100 * v['error']:+.1f}%"
                  + ("" if max(v["predicted_rounds"]) - min(v["predicted_rounds"]) < 1e-9 * max(1, abs(v["predicted"]))
                     else f"  (sim rounds {min(v['predicted_rounds']):.2f}..{max(v['predicted_rounds']):.2f})"))
        out["variants"][name] = {"figures": fig, "extrapolates": ext, "steps": [len(r.steps) for r in sims],
                                 "sim": {"wall_s": wall, "virtual_s": virt}}
    out["figures"] = out["variants"]["next-step terms and front end (the kit)"]["figures"]

    # 4. the steps themselves (the kit's replay)
    print("\n4. the kit's simulated rounds' steps beside the recorded complete rounds (held-out starts: min / "
          "median / max):")
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
    first = sims[0].steps[:3]
    print("  a round's first 3 steps, simulated (prefill tokens/requests, cached): "
          + "; ".join(f"{int(x['prefill_tokens'])}/{int(x['prefill_reqs'])}, {int(x['cached_tokens'])}" for x in first))
    r0 = next(r for s in heldout for r in rounds[s["pair"]] if r is not None)
    print("  ... recorded (one held-out round):             "
          + "; ".join(f"{int(x['prefill_tokens'])}/{int(x['prefill_reqs'])}, {int(x['cached_tokens'])}"
                      for x in r0[:3]))
    sim_dur = [r.values["duration_s"] for r in sims]
    print(f"  round duration: simulated {np.median(sim_dur):.3f} s; measured (held-out starts' rounds) "
          f"{np.median([x['metrics']['duration_s'] for s in heldout for x in s['rounds']]):.3f} s")
    # the engine's side of the latencies, recorded and simulated alike
    print("\n  inside the engine (the steps alone; TTFT bounded by the admitting step's schedule times, ITL the "
          "step cycles), beside the client's figures:")
    eng_rows = []
    for s in heldout:
        for k, r in enumerate(rounds[s["pair"]]):
            e = engine_side(r, prompt_tokens) if r is not None else None
            if e is not None:
                m = s["rounds"][k]["metrics"]
                eng_rows.append((m["ttft_p50_ms"], e["ttft_hi_p50_ms"], m["itl_p99_ms"], e["itl_p99_ms"]))
    er = np.array(eng_rows)
    sim_e = engine_side(sims[0].steps, prompt_tokens)
    print(f"  recorded rounds (median over {len(er)}): engine TTFT P50 <= {np.median(er[:, 1]):.1f} ms, ITL P99 "
          f"{np.median(er[:, 3]):.2f} ms (client: {np.median(er[:, 2]):.2f}; client less engine "
          f"{np.median(er[:, 2] - er[:, 3]):+.2f} ms)")
    if sim_e:
        print(f"  simulated: engine TTFT P50 <= {sim_e['ttft_hi_p50_ms']:.1f} ms, ITL P99 {sim_e['itl_p99_ms']:.2f} ms")
    out["engine_side"] = {"rounds": eng_rows, "simulated": sim_e,
                          "itl_p99_client_less_engine_ms": (er[:, 2] - er[:, 3]).tolist()}
    out["steps_check"] = {"simulated": simt, "recorded_complete": len(rec), "sim_duration_s": sim_dur}
    if a.json:
        a.json.write_text(json.dumps(out, indent=1, default=lambda x: x.tolist() if hasattr(x, "tolist") else str(x)))
    return 0


def held_out_errors(model, scope, heldout: list[dict], rounds: dict, quiet: bool = False) -> dict:
    """The model's per-step error on the held-out starts' complete rounds (those its range
    check refuses are listed and left out), by kind of step: decode-only, with a prefill,
    and decode-only just before a step with a prefill (where async admission lands)."""
    held, refused = {}, {}
    for s in heldout:
        for k, r in enumerate(rounds[s["pair"]]):
            if r is None:
                continue
            br, cyc = step_model.busy(r)
            try:
                model.check(scope, br)
            except step_model.Extrapolation as e:  # recorded, not hidden: such a round's steps are left out
                refused[f"pair{s['pair']} r{k}"] = str(e)
                continue
            pred = model.predict(br)
            nxt = np.r_[br["prefill_reqs"][1:], 0]
            kind = np.where(br["prefill_reqs"] > 0, 1, np.where(nxt > 0, 2, 0))
            held[(s["pair"], k)] = {"rel": (pred - cyc) / cyc, "kind": kind, "total": pred.sum() / cyc.sum() - 1}
    rel = np.concatenate([v["rel"] for v in held.values()])
    kind = np.concatenate([v["kind"] for v in held.values()])
    ab = np.abs(rel)
    totals = np.array([v["total"] for v in held.values()])
    med = lambda x: float(np.median(x)) if len(x) else float("nan")  # noqa: E731
    res = {"rounds": len(held), "refused": refused, "steps": int(len(ab)), "median": med(ab),
           "p90": float(np.quantile(ab, 0.9)), "decode_only_median": med(ab[kind == 0]),
           "prefill_median": med(ab[kind == 1]), "before_prefill_median": med(ab[kind == 2]),
           "signed_median": med(rel), "round_total": [float(totals.min()), med(totals), float(totals.max())]}
    if not quiet:
        for name, why in refused.items():
            print(f"  {name}: REFUSED, {why}")
    print(f"  {'next-step terms' if not quiet else 'row-wise'} on the other starts' {len(held)} complete rounds "
          f"({len(ab)} steps; {len(refused)} refused): per-step |error| median {100 * res['median']:.1f}%, P90 "
          f"{100 * res['p90']:.1f}% (decode-only {100 * res['decode_only_median']:.1f}%, with a prefill "
          f"{100 * res['prefill_median']:.1f}%, just before one {100 * res['before_prefill_median']:.1f}%); "
          f"a round's summed step time {100 * totals.min():+.1f}% .. {100 * totals.max():+.1f}% (median "
          f"{100 * res['round_total'][1]:+.1f}%)")
    return res


def figures(sims: list, heldout: list[dict]) -> dict:
    """Each FIGURE predicted (median over the simulated rounds) beside the held-out starts'
    per-start medians (min, median, max), whether it lies inside and its error vs the median."""
    fig = {}
    for f in FIGURES:
        pred = [r.values[f] for r in sims]
        meds = np.array([_median_rounds(s, f) for s in heldout])
        p, md = float(np.median(pred)), float(np.median(meds))
        fig[f] = {"predicted": p, "predicted_rounds": pred, "starts": meds.tolist(), "min": float(meds.min()),
                  "median": md, "max": float(meds.max()), "inside": bool(meds.min() <= p <= meds.max()),
                  "error": p / md - 1}
    return fig


if __name__ == "__main__":
    sys.exit(main())
