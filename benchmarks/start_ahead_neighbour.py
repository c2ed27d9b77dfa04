"""Does a server started ahead disturb the server that measures beside it?

One server measures rounds of a study's workload (the prefix cache reset before each).
Rounds alternate, in counterbalanced pairs (with, without, without, with, ...), between
a round with a second server of the same point importing beside it, placed as the sweep
places a server started ahead (server.background_cpus at nice 19, frozen at its
engine's init, before it touches the GPU), and a round without. The neighbour is spawned
as the round starts and killed when it ends: every "with" round has the whole of its
imports beside it, more than a sweep's first round gets. Per metric: the mean log
difference over pairs with its 95% t interval (paired: adjacent rounds share the
server's state and drift).

    python benchmarks/start_ahead_neighbour.py params/h200-qwen2.5-7b.yaml --point mbt=2048__gmu=0.90 \\
        --pairs 6 [--requests 200] [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
from scipy import stats as sps

from vllm_study.define.tokenizer import load as load_tokenizer
from vllm_study.analysis.intervals import one_start_note
from vllm_study.measure import client, counters, stats
from vllm_study.define import models
from vllm_study.define.grid import expand
from vllm_study.launch.machine import resolve_engine
from vllm_study.define.study_file import load_study
from vllm_study.launch.server import ServerStartError, VllmServer, free_port, serve_command
from vllm_study.workload.workload import SharedPrefixWorkload

METRICS = ("ttft_p50_ms", "ttft_p90_ms", "itl_p99_ms", "tpot_p50_ms", "output_throughput")


class Neighbour:
    """A second server of the point, started as the sweep starts one ahead, held at its
    engine's init until killed (it never reaches the GPU)."""

    def __init__(self, cmd_for_port, log: Path, env: dict):
        port = free_port()
        self.server = VllmServer(cmd_for_port(port), port, log, env=env, startup_timeout_s=3600)
        self.frozen = threading.Event()
        self.release = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _hold(self):
        self.frozen.set()
        self.release.wait()

    def _run(self):
        try:
            self.server.start(hold=self._hold)
        except ServerStartError:
            pass  # killed while importing or held: what kill() asks

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        # the whole group at once, frozen or not: SIGKILL needs no SIGCONT
        proc = self.server.proc
        if proc is not None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.release.set()
        self.thread.join(timeout=60)
        if proc is not None:
            proc.wait(timeout=60)


def paired(rows: list[dict]) -> dict:
    """Per metric: with over without, the mean log ratio over pairs with its t interval."""
    out = {}
    pairs = {}
    for r in rows:
        pairs.setdefault(r["pair"], {})[r["neighbour"]] = r
    full = [p for p in pairs.values() if True in p and False in p]
    for m in METRICS:
        d = np.array([np.log(p[True][m] / p[False][m]) for p in full if p[True].get(m) and p[False].get(m)])
        if len(d) < 2:
            continue
        half = sps.t.ppf(0.975, len(d) - 1) * d.std(ddof=1) / np.sqrt(len(d))
        out[m] = {"pairs": len(d), "effect": float(np.expm1(d.mean())), "low": float(np.expm1(d.mean() - half)),
                  "high": float(np.expm1(d.mean() + half))}
    return out


def heading(pairs: int) -> str:
    """The summary's first line. Every pair is measured on the one server this benchmark
    starts: one start a side (intervals.one_start_note)."""
    note = one_start_note(1, 1, why="another start may show a different effect")
    return (f"\nwith a neighbour importing over without, {pairs} pairs planned (mean log ratio, 95% t interval; "
            f"{note}):")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("params")
    ap.add_argument("--point", default="", help="grid point id (default: the last point)")
    ap.add_argument("--pairs", type=int, default=6)
    ap.add_argument("--requests", type=int, help="requests per round (default: the study's)")
    ap.add_argument("--bound", type=float, default=0.10, help="the effect that must be excluded (0.10: +-10%%)")
    ap.add_argument("--out", type=Path, default=Path(tempfile.mkdtemp(prefix="neighbour-")))
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    study = load_study(a.params)
    if study.workload.kind != "shared_prefix":
        raise SystemExit("this benchmark replays a shared_prefix workload; the study has " + study.workload.kind)
    points = {p.id: p for p in expand(study, resolve_engine(study.server.engine))}
    point = points[a.point] if a.point else list(points.values())[-1]
    w, served = study.workload, study.model.served_name
    model, dummy = models.resolve(study.model)
    wl = SharedPrefixWorkload(load_tokenizer(model), api=w.api,
                              system_prompt_tokens=w.system_prompt_tokens, question_tokens=w.question_tokens,
                              output_tokens=w.output_tokens, seed=w.seed)
    requests = wl.requests(a.requests or w.requests_per_round)

    def cmd(port):
        return serve_command(model, port, point.engine_args.cli(), served, dummy, study.server.extra_cli_args)
    env = dict(study.server.env)
    port = free_port()
    rows, log = [], a.out / "rounds.jsonl"
    # with, without, without, with, ...: a drift over the session favours neither
    plan = [(i, flag) for i in range(a.pairs) for flag in ((True, False) if i % 2 == 0 else (False, True))]
    try:
        with VllmServer(cmd(port), port, a.out / "server.log", env=env,
                        startup_timeout_s=study.server.startup_timeout_s) as srv:
            print(f"server ready in {srv.startup_s:.0f} s; point {point.id}; {len(requests)} requests a round, "
                  f"concurrency {w.concurrency}", flush=True)
            client.run_sync(client.run_closed_loop(srv.url, served, w.api, wl.requests(2 * w.concurrency, "warmup"),
                                                   w.concurrency))
            for k, (pair, beside) in enumerate(plan):
                counters.reset_prefix_cache(srv.url)
                neighbour = Neighbour(cmd, a.out / f"neighbour-{k}.log", env) if beside else None
                t0 = time.perf_counter()
                if neighbour:
                    neighbour.__enter__()
                try:
                    res = client.run_sync(client.run_closed_loop(srv.url, served, w.api, requests, w.concurrency))
                finally:
                    frozen = neighbour.frozen.is_set() if neighbour else None
                    if neighbour:
                        neighbour.__exit__(None, None, None)
                st = stats.round_metrics([r.to_dict() for r in res], time.perf_counter() - t0)
                row = {"pair": pair, "neighbour": beside, "order": k, "held_before_end": frozen,
                       **{m: st.get(m) for m in METRICS}}
                rows.append(row)
                with log.open("a") as f:
                    f.write(json.dumps(row) + "\n")
                print(f"round {k + 1}/{len(plan)} pair {pair + 1} {'with' if beside else 'without':>7} neighbour: "
                      + "  ".join(f"{m} {row[m]:.2f}" for m in METRICS if row[m] is not None)
                      + ("  (it reached its hold before the round ended)" if frozen else ""), flush=True)
    except KeyboardInterrupt:
        print("\ninterrupted: the summary covers the rounds that finished", flush=True)
    summary = paired(rows)
    print(heading(a.pairs))
    for m, x in summary.items():
        resolved = x["low"] > 0 or x["high"] < 0
        within = -a.bound <= x["low"] and x["high"] <= a.bound
        print(f"  {m:<18} {x['effect']:+.1%} [{x['low']:+.1%}, {x['high']:+.1%}] over {x['pairs']} pairs: "
              f"{'resolved' if resolved else 'not resolved'}, {'within' if within else 'NOT within'} "
              f"+-{a.bound:.0%}")
    (a.out / "neighbour.json").write_text(json.dumps({"point": point.id, "rows": rows, "summary": summary}, indent=2))
    print(f"\nresults: {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
