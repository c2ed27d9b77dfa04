"""Predicted against measured: vLLM's own scheduler in virtual time (vllm_study.predict),
its step times from a model fitted to real starts' step records, set beside the kit's
measured rounds and capacities.

1. measure: the kit's own sweep of a capacity study (one server start a configuration;
   every start records its engine steps, steps/r<k>.npz), into <out>/runs/.
2. fit: the step-time model (predict/step_model.py) from the step records of the starts
   named by --fit (default: every other configuration in grid order); its per-step error
   on the others' steps (held out).
3. replay: every measured round of every start simulated with the same requests,
   arrivals, load, priming and KV pool: TTFT P50/P90, ITL P99, TPOT P50 and throughput,
   predicted beside measured; vLLM's own prefix-cache hit rate in the simulator beside
   the kit's cache model (workload/prefix_cache_model.py) and the measured one.
4. capacity: the study's capacity bracket over simulated rounds for every configuration,
   beside the measured bracket; the rank agreement (Kendall's tau) of the two orders.

Each phase writes its file in --out and is skipped when that file is there, so an
invocation cut short goes on from where it stopped; --summarize prints every figure
from the files alone.

    nice -n 5 python benchmarks/predict_vs_measured.py params/cpu-predict-vs-measured.yaml \\
        --out results/predict-vs-measured/<YYYYMMDD>-cpu
    python benchmarks/predict_vs_measured.py --summarize results/predict-vs-measured/<YYYYMMDD>-cpu
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from scipy import stats as sps

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "lib"))

from vllm_study.launch.machine import cpu_info  # noqa: E402
from vllm_study.predict import step_model  # noqa: E402
from vllm_study.predict.replay import predict_capacity, replay_start  # noqa: E402
from vllm_study.predict.start import SimulatedStart, StudyInputs  # noqa: E402
from vllm_study.scheduler_plugin import steps  # noqa: E402
from vllm_study.records.results import RunFolder, StartRecord  # noqa: E402
from vllm_study.records.results import git_state

MEASURED, FIT, REPLAY, CAPACITY, CACHE, SUMMARY = ("measured.json", "fit.json", "replay.json", "capacity.json",
                                                   "cache.json", "summary.json")
# the simulator's own bracket, finer than a study can afford on a server: a point estimate
FINE_PRECISION, FINE_STEPS = 0.02, 14
CACHE_SCALES = (0.125, 0.25, 0.5, 1.0, 2.0)  # KV pools, as a share of the measured start's, for the cache check
# the replay error is reported for these (the end-to-end figures)
REPLAYED = ("ttft_p50_ms", "ttft_p90_ms", "ttft_sched_p90_ms", "itl_p99_ms", "tpot_p50_ms", "output_throughput")


def _save(path: Path, data) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=float))
    tmp.replace(path)


def _commit() -> str | None:
    """The kit's commit, as a run records it (records.results.git_state: git, or in a copy
    without .git, VLLM_STUDY_GIT_SHA or the stamp file)."""
    return git_state(Path(__file__).resolve().parents[1]).sha


# -- 1. measure ------------------------------------------------------------------------
def run_folder(out: Path) -> RunFolder | None:
    runs = sorted(p for p in (out / "runs").glob("*") if (p / "manifest.json").exists()) \
        if (out / "runs").exists() else []
    return RunFolder(runs[-1]) if runs else None


def measure(study_path: Path, out: Path) -> RunFolder:
    """The kit's sweep of the study into out/runs (resumed where a run is there)."""
    run = run_folder(out)
    if (out / MEASURED).exists() and run is not None:
        return run
    cmd = [sys.executable, "-m", "vllm_study", "sweep", "--results", str(out / "runs"), "--no-report"]
    cmd += ["--resume", str(run.path)] if run is not None else [str(study_path)]
    print("+", " ".join(cmd), flush=True)
    t0 = time.time()
    rc = subprocess.run(cmd).returncode
    run = run_folder(out)
    if run is None:
        raise SystemExit(f"the sweep exited {rc} and left no run folder under {out / 'runs'}")
    git = run.manifest().git
    _save(out / MEASURED, {"run": str(run.path.relative_to(out)), "sweep_rc": rc, "wall_s": time.time() - t0,
                           "study": str(study_path), "commit": git.sha[:7] if git and git.sha else None,
                           "cpu": cpu_info().model,
                           "command": " ".join(cmd)})
    return run


def starts_of(run: RunFolder) -> list[tuple[str, Path, StartRecord]]:
    """(point, start folder, record) of every start that measured, in grid order."""
    out = []
    for pid in run.point_ids():
        if not run.point(pid).plan_path.exists():  # a point the sweep never reached
            continue
        for rec, d in run.point(pid)._start_dirs():
            if rec.status == "ok" and not rec.served_by:
                out.append((pid, d, rec))
    return out


def step_rows(start_dir: Path) -> list[np.ndarray]:
    """A start's step records, one array (steps.DTYPE) a measured round (a step's cycle is
    measured within its round)."""
    return [steps.load_round(f) for f in sorted((start_dir / steps.ROUNDS_DIR).glob("r*.npz"))]


# -- 2. fit ----------------------------------------------------------------------------
def _scope(run: RunFolder, p: str, rec: StartRecord):
    return step_model.scope_of(run.point(p).plan(), rec, rec.launch, run.manifest())


def describe(model) -> str:
    c = model.coef
    return (f"{1e3 * c['overhead_s']:.2f} ms" + "".join(
        f" + {1e6 * c.get(t, 0.0):.3g} us x {t.removeprefix('per_').removesuffix('_s')}" for t in step_model.TERMS[1:])
            + f" ({model.steps} steps, {model.rounds} rounds)")


def fit(run: RunFolder, out: Path, fit_points: list[str] | None):
    """step_model.fit over the chosen starts' rounds (their launches: the model's scope);
    each other start's steps predicted with it (held out)."""
    starts = starts_of(run)
    points = list(dict.fromkeys(p for p, _, _ in starts))
    chosen = fit_points or points[::2]
    unknown = [p for p in chosen if p not in points]
    if unknown:
        raise SystemExit(f"--fit names points with no measured start: {unknown}; the run has {points}")
    train, scopes = [], []
    for p, d, rec in starts:
        if p in chosen:
            train += step_rows(d)
            scopes.append(_scope(run, p, rec))
    if not sum(len(r) for r in train):
        raise SystemExit(f"the starts of {chosen} recorded no steps (steps/r<k>.npz): was the run made by a kit "
                         "whose starts record steps?")
    model = step_model.fit(train, scopes[0], [s.launch for s in scopes])
    held = {}
    for p, d, rec in starts:
        rounds = [step_model.busy(r) for r in step_rows(d)]
        rounds = [(r, c) for r, c in rounds if len(r)]
        if p in chosen or not rounds:
            continue
        rows = np.concatenate([r for r, _ in rounds])
        real = np.concatenate([c for _, c in rounds])
        try:
            model.check(_scope(run, p, rec), rows)
        except step_model.Extrapolation as e:
            held[f"{p}/s{rec.start}"] = {"steps": int(len(rows)), "refused": str(e)}
            continue
        pred = model.predict(rows)
        rel = np.abs(pred - real) / real
        held[f"{p}/s{rec.start}"] = {"steps": int(len(rows)), "median_abs_rel_error": float(np.median(rel)),
                                     "p90_abs_rel_error": float(np.percentile(rel, 90)),
                                     "total_time_rel_error": float(pred.sum() / real.sum() - 1)}
    record = {"fit_points": chosen, "fit_steps": int(model.steps), "held_out": held,
              "commit": _commit(), "model": describe(model),
              "k_fold": model.held_out.model_dump() if model.held_out else model.held_out_why_not}
    _save(out / FIT, record)
    return model, record


# -- 3. replay -------------------------------------------------------------------------
def replay(run: RunFolder, out: Path, model, inputs: StudyInputs) -> list[dict]:
    path = out / REPLAY
    done = json.loads(path.read_text()) if path.exists() else []
    seen = {(r["point"], r["start"]) for r in done}
    for p, d, rec in starts_of(run):
        if (p, rec.start) in seen:
            continue
        print(f"replay {p} s{rec.start}", flush=True)
        try:
            model.check(_scope(run, p, rec))
            done += replay_start(d, model, inputs=inputs)
        except step_model.Extrapolation as e:  # recorded, not hidden: the model refused to extrapolate
            done.append({"point": p, "start": rec.start, "refused": str(e)})
        _save(path, done)
    return done


# -- 4. capacity -----------------------------------------------------------------------
def capacities(run: RunFolder, out: Path, model, inputs: StudyInputs) -> list[dict]:
    path = out / CAPACITY
    done = json.loads(path.read_text()) if path.exists() else []
    seen = {r["point"] for r in done}
    for p, d, rec in starts_of(run):
        if p in seen or rec.capacity is None:
            continue
        seen.add(p)
        plan = run.point(p).plan()
        t0 = time.perf_counter()
        try:
            model.check(_scope(run, p, rec))
            cap, sim = predict_capacity(plan, model, cache_config=rec.launch.cache_config, inputs=inputs)
        except step_model.Extrapolation as e:
            done.append({"point": p, "values": plan.point.values, "refused": str(e),
                         "measured": {"start": rec.start, "load": rec.capacity.load,
                                      "bracket": rec.capacity.bracket}})
            _save(path, done)
            continue
        wall = time.perf_counter() - t0
        fine, _ = predict_capacity(plan, model, cache_config=rec.launch.cache_config, inputs=inputs,
                                   precision=FINE_PRECISION, max_steps=FINE_STEPS)
        done.append({"point": p, "values": plan.point.values, "over": cap.over,
                     "fine": {"load": fine.load, "bracket": fine.bracket, "censored": fine.censored,
                              "requests_per_s": fine.requests_per_s},
                     "measured": {"start": rec.start, "load": rec.capacity.load, "bracket": rec.capacity.bracket,
                                  "censored": rec.capacity.censored, "requests_per_s": rec.capacity.requests_per_s},
                     "predicted": {"load": cap.load, "bracket": cap.bracket, "censored": cap.censored,
                                   "requests_per_s": cap.requests_per_s,
                                   "steps": [(s["load"], s["met"]) for s in cap.steps]},
                     "sim_wall_s": wall, "sim_virtual_s": sum(r.virtual_s for r in sim.rounds)})
        _save(path, done)
        print(f"capacity {p}: measured {rec.capacity.load} {rec.capacity.bracket}, predicted {cap.load} "
              f"{cap.bracket} ({wall:.1f} s)", flush=True)
    return done


# -- 5. one cache model ------------------------------------------------------------------
def cache_check(run: RunFolder, out: Path, model, inputs: StudyInputs) -> list[dict]:
    """vLLM's own prefix cache (in the simulator) beside the kit's cache model
    (workload/prefix_cache_model.py, given the simulated round's TTFT and TPOT) on the
    same rounds, at KV pools from an eighth to twice the measured start's: where the
    pool is small, eviction decides the hit rate and the two can part."""
    path = out / CACHE
    if path.exists():
        return json.loads(path.read_text())
    rows = []
    for p, d, rec in starts_of(run):
        plan = run.point(p).plan()
        blocks = int(rec.launch.cache_config.get("num_gpu_blocks") or 0)
        if not blocks or plan.study.workload.kind != "trace":
            continue
        for scale in CACHE_SCALES:
            n = max(1, int(blocks * scale))
            if n * int(rec.launch.cache_config.get("block_size") or 1) < plan.point.effective.max_model_len:
                continue  # vLLM would not start with a pool that cannot hold one longest request
            cfg = {**rec.launch.cache_config, "num_gpu_blocks": str(n)}
            sim = SimulatedStart(plan, model, cache_config=cfg, inputs=inputs)
            load = rec.capacity.load if rec.capacity and rec.capacity.load else None
            r = sim.run_round(0, load)
            rows.append({"point": p, "kv_blocks": n, "scale": scale, "load": load,
                         "vllm_hit_rate": r.values.get("prefix_cache_hit_rate"),
                         "model_hit_rate": r.values.get("model_prefix_hit_rate")})
        break  # one configuration: the cache's behaviour does not depend on the chunk size much
    _save(path, rows)
    return rows


# -- the figures -----------------------------------------------------------------------
def _pct(x) -> str:
    return "n/a" if x is None or x != x else f"{100 * x:+.0f}%"


def _bracket(b) -> str:
    lo, hi = b
    return f"[{lo:.3g}, {'>' if hi is None else f'{hi:.3g}'}]" if lo is not None else f"[<floor, {hi:.3g}]"


def summarize(out: Path) -> dict:
    meta = json.loads((out / MEASURED).read_text())
    fitrec = json.loads((out / FIT).read_text()) if (out / FIT).exists() else None
    rep = json.loads((out / REPLAY).read_text()) if (out / REPLAY).exists() else []
    caps = json.loads((out / CAPACITY).read_text()) if (out / CAPACITY).exists() else []
    cache_rows = json.loads((out / CACHE).read_text()) if (out / CACHE).exists() else []
    for r in [r for r in rep + caps if "refused" in r]:
        print(f"REFUSED {r['point']}: {r['refused']}")
    rep = [r for r in rep if "refused" not in r]
    caps = [c for c in caps if "refused" not in c]
    summary: dict = {"commit": meta.get("commit"), "cpu": meta.get("cpu"), "study": meta.get("study"),
                     "analysis_commit": fitrec.get("commit") if fitrec else None}
    print(f"run {meta['run']} (measured at commit {meta.get('commit')}, {meta.get('cpu')}); sweep "
          f"{meta['wall_s']:.0f} s; predicted at commit {summary['analysis_commit']}")
    if fitrec:
        print(f"\nstep model fitted from {fitrec['fit_points']} ({fitrec['fit_steps']} steps): {fitrec['model']}")
        print(f"  its own held-out error, {fitrec.get('k_fold')}")
        for k, h in fitrec["held_out"].items():
            if "refused" in h:
                print(f"  held out {k}: REFUSED ({h['refused']})")
                continue
            print(f"  held out {k}: {h['steps']} steps, per-step |error| median {100 * h['median_abs_rel_error']:.0f}%"
                  f" P90 {100 * h['p90_abs_rel_error']:.0f}%, total step time {_pct(h['total_time_rel_error'])}")
        summary["held_out"] = fitrec["held_out"]
    fitted = set(fitrec["fit_points"]) if fitrec else set()
    if rep:
        print(f"\nreplay: {len(rep)} measured rounds simulated with the same requests, arrivals and load "
              "(error = predicted / measured - 1)")
        print(f"  {'point':32s} {'rd':>3s} {'load':>6s} " + " ".join(f"{k:>18s}" for k in REPLAYED))
        for r in rep:
            cells = []
            for k in REPLAYED:
                m, p = r.get(f"measured_{k}"), r.get(f"predicted_{k}")
                cells.append(f"{p:7.1f}/{m:7.1f} {_pct(p / m - 1) if m else 'n/a':>4s}" if m is not None
                             and p is not None else f"{'n/a':>18s}")
            mark = "*" if r["point"] in fitted else " "
            print(f" {mark}{r['point']:32s} {r['round']:3d} {r['load'] or 0:6.2f} " + " ".join(cells))
        print("  (* a configuration the step model was fitted on; predicted/measured, ms or tokens/s)")
        errs = {}
        for scope, rows in (("all", rep), ("held out", [r for r in rep if r["point"] not in fitted])):
            for k in REPLAYED:
                e = [abs(r[f"predicted_{k}"] / r[f"measured_{k}"] - 1) for r in rows
                     if r.get(f"measured_{k}") and r.get(f"predicted_{k}") is not None]
                if e:
                    errs[f"{scope}/{k}"] = {"median_abs": float(np.median(e)), "p90_abs": float(np.percentile(e, 90)),
                                           "rounds": len(e)}
        print("  median |error| over rounds (P90), all rounds / held-out configurations' rounds:")
        for k in REPLAYED:
            a, h = errs.get(f"all/{k}"), errs.get(f"held out/{k}")
            fmt = lambda x: f"{100 * x['median_abs']:.0f}% ({100 * x['p90_abs']:.0f}%, n={x['rounds']})" if x else "n/a"  # noqa: E731
            print(f"    {k:20s} {fmt(a):>22s}   {fmt(h):>22s}")
        summary["replay_error"] = errs
        wall = sum(r["sim_wall_s"] for r in rep)
        virt = sum(r["sim_virtual_s"] for r in rep)
        print(f"  simulation speed: {virt:.0f} s of virtual time (priming included) in {wall:.1f} s of one core: "
              f"{virt / wall:.0f} x real time")
        summary["sim_x_real_time"] = virt / wall
        cache = [(r["measured_prefix_cache_hit_rate"], r["predicted_prefix_cache_hit_rate"],
                  r["predicted_model_prefix_hit_rate"]) for r in rep
                 if r.get("measured_prefix_cache_hit_rate") is not None
                 and r.get("predicted_prefix_cache_hit_rate") is not None
                 and r.get("predicted_model_prefix_hit_rate") is not None]
        if cache:
            m, v, c = (np.array(x) for x in zip(*cache))
            print(f"\nprefix-cache hit rate over {len(cache)} rounds: measured (vLLM /metrics) mean {m.mean():.3f}; "
                  f"vLLM's cache in the simulator {v.mean():.3f} (|error| mean {np.abs(v - m).mean():.4f}, max "
                  f"{np.abs(v - m).max():.4f}); the kit's cache model {c.mean():.3f} (|error| mean "
                  f"{np.abs(c - m).mean():.4f}, max {np.abs(c - m).max():.4f})")
            summary["cache"] = {"rounds": len(cache), "measured_mean": float(m.mean()),
                                "simulator_abs_error_mean": float(np.abs(v - m).mean()),
                                "simulator_abs_error_max": float(np.abs(v - m).max()),
                                "model_abs_error_mean": float(np.abs(c - m).mean()),
                                "model_abs_error_max": float(np.abs(c - m).max())}
    if caps:
        print(f"\ncapacity over {caps[0]['over']} (the study's bracket; measured: one start each):")
        print(f"  {'point':32s} {'measured':>18s} {'predicted':>18s} {'predicted, fine':>18s} {'error':>7s}  "
              "fine inside measured bracket")
        pairs, inside = [], 0
        for c in caps:
            m, p, f = c["measured"], c["predicted"], c.get("fine") or c["predicted"]
            lo, hi = m["bracket"]
            # error: the fine point estimate against the measured bracket's geometric middle
            mid = (lo * hi) ** 0.5 if lo and hi else lo
            err = f["load"] / mid - 1 if mid and f["load"] else None
            ok = f["load"] is not None and (lo is None or f["load"] >= lo * (1 - 1e-9)) and \
                (hi is None or f["load"] < hi)
            inside += ok
            mark = "*" if c["point"] in fitted else " "
            print(f" {mark}{c['point']:32s} {_bracket(m['bracket']):>18s} {_bracket(p['bracket']):>18s} "
                  f"{_bracket(f['bracket']):>18s} {_pct(err):>7s}  {'yes' if ok else 'NO'}")
            if mid and f["load"]:
                pairs.append((mid, f["load"]))
        errs = [abs(p / m - 1) for m, p in pairs]
        summary["capacity"] = {"configs": len(caps), "median_abs_error": float(np.median(errs)) if errs else None,
                               "inside_measured_bracket": inside}
        print(f"  median |capacity error| {100 * np.median(errs):.0f}% over {len(errs)} configurations (the fine "
              "prediction against the measured bracket's geometric middle, a step's width being the measured "
              f"interval); {inside} of {len(caps)} fine predictions inside the measured bracket" if errs
              else "  no pair to compare")
        if len(pairs) >= 3:
            tau, pval = sps.kendalltau([m for m, _ in pairs], [p for _, p in pairs])
            rho, _ = sps.spearmanr([m for m, _ in pairs], [p for _, p in pairs])
            best_m = max(caps, key=lambda c: c["measured"]["load"] or 0)["point"]
            best_p = max(caps, key=lambda c: (c.get("fine") or c["predicted"])["load"] or 0)["point"]
            print(f"  rank agreement: Kendall tau {tau:.2f} (p = {pval:.2f}), Spearman rho {rho:.2f}; best measured "
                  f"{best_m}, best predicted {best_p} (ties in a bracket's step are common: loads are a grid)")
            summary["capacity"] |= {"kendall_tau": float(tau), "kendall_p": float(pval), "spearman_rho": float(rho),
                                    "best_measured": best_m, "best_predicted": best_p}
        wall = sum(c["sim_wall_s"] for c in caps)
        virt = sum(c["sim_virtual_s"] for c in caps)
        print(f"  predicting the {len(caps)} capacities took {wall:.1f} s of one core ({virt:.0f} s virtual)")
        summary["capacity"] |= {"predict_wall_s": wall}
    if cache_rows:
        print(f"\nvLLM's cache in the simulator against the kit's cache model, same rounds ({cache_rows[0]['point']}, "
              f"load {cache_rows[0]['load']}), KV pool scaled:")
        for c in cache_rows:
            v, m = c["vllm_hit_rate"], c["model_hit_rate"]
            d = f"{m - v:+.4f}" if v is not None and m is not None else "n/a"
            print(f"  {c['kv_blocks']:6d} blocks (x{c['scale']:g}): vLLM {v if v is None else f'{v:.4f}'}, "
                  f"model {m if m is None else f'{m:.4f}'}, model - vLLM {d}")
        summary["cache_by_kv"] = cache_rows
    _save(out / SUMMARY, summary)
    return summary


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("study", nargs="?", type=Path, help="a capacity study (params/cpu-predict-vs-measured.yaml)")
    ap.add_argument("--out", type=Path, help="the benchmark's folder (a new one, or one to go on from)")
    ap.add_argument("--fit", help="comma-separated point ids whose starts the step model is fitted from "
                    "(default: every other configuration in grid order)")
    ap.add_argument("--summarize", type=Path, metavar="OUT", help="print the figures of a finished --out")
    a = ap.parse_args()
    if a.summarize:
        summarize(a.summarize)
        return 0
    if a.out is None:
        ap.error("--out is needed (or --summarize OUT)")
    a.out.mkdir(parents=True, exist_ok=True)
    if a.study is None and not (a.out / MEASURED).exists():
        ap.error("a study file is needed to measure (the first invocation into a folder)")
    run = measure(a.study, a.out)
    model, _ = fit(run, a.out, a.fit.split(",") if a.fit else None)
    measured = starts_of(run)
    if not measured:
        raise SystemExit(f"{run.path}: no start measured; nothing to fit or replay")
    inputs = StudyInputs(run.point(measured[0][0]).plan().study)
    replay(run, a.out, model, inputs)
    capacities(run, a.out, model, inputs)
    cache_check(run, a.out, model, inputs)
    summarize(a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
