"""Where a replayed round's ITL P99 comes from: the recorded steps of a measured start's
rounds beside the steps the simulator ran for the same round (the kit's step model fitted
on the whole run, the start's KV pool, async scheduling on a GPU engine), told apart as
the step model's error and the simulated schedule's.

A token's inter-token latency is the cycle of the step that produced it, so a round's ITL
P99 is near the decode-weighted P99 of its steps' cycles (each step weighted by its decode
requests). Printed for each round, recorded and simulated: busy steps, full-chunk steps
(prefill at least --fill of the chunk), the share of decode tokens produced in them and
their decodes a step, their attention pairs and cycle (median, P90), and the
decode-weighted P99 cycle; for the recorded steps also that P99 with the model's times in
place of the measured ones (the step model alone, on the server's own schedule) and the
same with the model's spread drawn (one stream, seed 0). Each round is simulated on a
fresh simulated start, at the round's own load; its ITL P99 and TTFT P50 / P90 close each
block, beside the measured ones.

Then the round's TTFT by prompt length (median over the requests of each band,
measured / simulated): which requests the simulated schedule serves sooner or later than
the server did.

--send-order adds a second simulated round a round: each request sent as late after its
due time as the client sent it in the measured round. A trace's requests often share an
arrival instant (the Mooncake trace's timestamps are whole seconds); the simulator sends
those in index order, the client in whatever order its event loop woke them, so this
replays the measured order instead.

    python benchmarks/itl_tail.py results/<run> --point mbt=4096__mns=128__pc=on__lpt=0 --start 1 [--send-order]
"""
from __future__ import annotations

import argparse
import sys
from contextlib import contextmanager
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "lib"))

from vllm_study.predict import start as simulated_start  # noqa: E402
from vllm_study.predict import step_model  # noqa: E402
from vllm_study.predict.start import SimulatedStart  # noqa: E402
from vllm_study.scheduler_plugin import steps  # noqa: E402
from vllm_study.records.results import RunFolder, StartRecord, read_requests, read_rounds  # noqa: E402


def weighted_p99(cycles: np.ndarray, weights: np.ndarray) -> float:
    order = np.argsort(cycles)
    cum = np.cumsum(weights[order])
    return float(cycles[order][np.searchsorted(cum, 0.99 * cum[-1])])


def describe(rows: np.ndarray, cyc: np.ndarray, chunk: int, fill: float) -> str:
    w = rows["decode_reqs"].astype(float)
    full = rows["prefill_tokens"] >= fill * chunk
    return (f"busy steps {len(rows)}, full-chunk {full.sum()} (decode tokens in them {(w * full).sum() / w.sum():.1%}, "
            f"{np.median(w[full]):.0f} decodes a step, {np.median(rows['prefill_attention_pairs'][full]) / 1e6:.1f}M "
            f"pairs; cycle median {np.median(cyc[full]) * 1e3:.1f} ms, P90 {np.quantile(cyc[full], 0.9) * 1e3:.1f}); "
            f"decode-weighted P99 cycle {weighted_p99(cyc, w) * 1e3:.1f} ms")


@contextmanager
def sent_as_measured(late: dict[int, float]):
    """The simulated start's open loop with each request's arrival moved by its measured
    lateness (send_time - due_time, by request index). A benchmark's patch of one name,
    undone on exit: the kit's simulator has no such input, since a prediction has no
    measured order to follow."""
    orig = simulated_start.open_loop

    def shifted(engine, prompts, requests, arrivals_s, **kw):
        return orig(engine, prompts, requests, [a + late.get(r.index, 0.0) for r, a in zip(requests, arrivals_s)], **kw)
    simulated_start.open_loop = shifted
    try:
        yield
    finally:
        simulated_start.open_loop = orig


BANDS = (0, 2000, 8000, 16000, 1 << 30)   # prompt tokens: one chunk or less, to several


def ttft_by_length(measured: list[dict], simulated: list[dict]) -> str:
    """Median TTFT by prompt-length band, measured / simulated, the same requests (by index)."""
    sim = {r["index"]: r for r in simulated}
    out = []
    for lo, hi in zip(BANDS, BANDS[1:]):
        pairs = [(r["ttft_s"], sim[r["index"]]["ttft_s"]) for r in measured
                 if lo <= r["prompt_tokens"] < hi and r["index"] in sim and r.get("ttft_s") is not None
                 and sim[r["index"]].get("ttft_s") is not None]
        if pairs:
            m, s_ = np.median(np.array(pairs), axis=0) * 1e3
            out.append(f"{lo}-{hi if hi < BANDS[-1] else ''} tokens ({len(pairs)}) {m:.0f} / {s_:.0f} ms")
    return "; ".join(out)


def figures(values: dict) -> str:
    return ", ".join(f"{k} {values[k]:.1f} ms" for k in ("itl_p99_ms", "ttft_p50_ms", "ttft_p90_ms"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run", type=Path)
    ap.add_argument("--point", required=True)
    ap.add_argument("--start", type=int, default=1)
    ap.add_argument("--fill", type=float, default=0.9)
    ap.add_argument("--send-order", action="store_true", help="also simulate each round in the measured send order")
    a = ap.parse_args()
    run = RunFolder(a.run)
    folder = run.point(a.point)
    plan = folder.plan()
    chunk = plan.point.engine_args.max_num_batched_tokens
    start_dir = folder.start_dir(a.start)
    record = StartRecord.load_if(start_dir / "start.json")
    model = max(step_model.fit_run(a.run), key=lambda m: m.steps)
    rng = np.random.default_rng(0)
    sent = read_requests(start_dir) or {}
    for rnd in read_rounds(start_dir / "rounds.jsonl"):
        path = steps.round_path(start_dir, rnd.round)
        if rnd.status != "ok" or not path.exists():
            continue
        load = rnd.load
        rec, cyc = step_model.busy(steps.load_round(path))
        w = rec["decode_reqs"].astype(float)
        guess = model.predict(rec)
        print(f"round {rnd.round} at load {load:.3g} (measured: {figures(rnd.metrics)})")
        print(f"    recorded:  {describe(rec, cyc, chunk, a.fill)}; with the model's times on these steps "
              f"{weighted_p99(guess, w) * 1e3:.1f} ms, with its spread drawn "
              f"{weighted_p99(guess * model.jitter(rec, rng), w) * 1e3:.1f} ms")
        sim = SimulatedStart(plan, model, record=record, async_scheduling=plan.engine == "gpu")
        out = sim.run_round(rnd.round, load=load)
        srows, scyc = step_model.busy(out.steps)
        print(f"    simulated: {describe(srows, scyc, chunk, a.fill)}; {figures(out.values)}")
        print("    TTFT by prompt length, measured / simulated: "
              + ttft_by_length(sent.get(rnd.round, []), out.results))
        if a.send_order:
            late = {r["index"]: r["send_time"] - r["due_time"] for r in sent.get(rnd.round, [])
                    if r.get("due_time") is not None}
            with sent_as_measured(late):
                out = SimulatedStart(plan, model, record=record, async_scheduling=plan.engine == "gpu").run_round(
                    rnd.round, load=load)
            print(f"    simulated in the measured send order: {figures(out.values)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
