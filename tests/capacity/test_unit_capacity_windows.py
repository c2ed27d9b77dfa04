"""A capacity step over trace.windows measures one round a window and judges their
requests pooled: the fit of its margins must pool them too, not read the first window's
round alone (the step's `round`)."""
import gzip
import json
import math

import numpy as np

from vllm_study.capacity.bracket import CapacityRecord
from vllm_study.records.point_capacity import start_capacity

SLO = {"ttft_p90_ms": 1000.0}
LOADS = [0.8, 2.0, 1.26, 1.0]


def _write_start(d, ttft_ms_by_window):
    """One start of four steps, two windows each; window w's requests at load x take
    ttft_ms_by_window[w](x) ms, 60 requests a round, spread +-10% (seeded)."""
    rng = np.random.default_rng(0)
    rounds, reqs, steps = [], [], []
    for i, load in enumerate(LOADS):
        first = 2 * i
        pooled = []
        for w in (0, 1):
            rnd = first + w
            ttfts = ttft_ms_by_window[w](load) * rng.uniform(0.9, 1.1, 60)
            pooled += list(ttfts)
            reqs += [{"round": rnd, "ttft_s": t / 1000, "send_time": 0.0, "due_time": None} for t in ttfts]
            rounds.append({"point": "p", "start": 1, "round": rnd, "status": "ok", "utc": "2026-12-04T00:00:00Z",
                           "metrics": {"ttft_p90_ms": float(np.percentile(ttfts, 90)), "completed": 60.0},
                           "load": load, "window": w + 1})
        margin = float(np.percentile(pooled, 90)) / SLO["ttft_p90_ms"]
        steps.append({"load": load, "met": margin <= 1, "why": "", "round": first,
                      "margins": {"ttft_p90_ms": margin}})
    (d / "rounds.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rounds))
    with gzip.open(d / "requests.jsonl.gz", "wt") as f:
        f.writelines(json.dumps(r) + "\n" for r in reqs)
    return CapacityRecord(over="speed", load=0.8, bracket=(0.8, 1.0), floor=0.8, steps=steps)


def test_the_fit_pools_every_window_of_a_step(tmp_path):
    # window 1's P90 (about 1.08 x its base) meets 1000 ms up to ~1.5 x, window 2's only up to
    # ~0.9 x: pooled, the P90 lies in window 2's requests, so the capacity is near 0.9 x, far
    # below window 1's alone (which meets at every load measured)
    rec = _write_start(tmp_path, [lambda x: 620 * x, lambda x: 1030 * x])
    cap, how = start_capacity(tmp_path, rec, SLO, 0.8)
    assert how == "fit" and cap.kind == "value"
    assert 0.8 < cap.value < 1.0, cap
    per_step = rec.step_rounds([type("R", (), {"round": r, "load": LOADS[r // 2]})() for r in range(8)])
    assert [[r.round for r in rs] for rs in per_step] == [[0, 1], [2, 3], [4, 5], [6, 7]]


def test_a_step_whose_later_window_failed_is_a_miss(tmp_path):
    rec = _write_start(tmp_path, [lambda x: 400 * x, lambda x: 400 * x])
    lines = [json.loads(x) for x in (tmp_path / "rounds.jsonl").read_text().splitlines()]
    lines[3]["status"] = "failed"   # window 2 of the 2 x step
    (tmp_path / "rounds.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    cap, _ = start_capacity(tmp_path, rec, SLO, 0.8)
    # every step met (P90 under 900 ms at 2 x); the failed round makes 2 x a miss
    assert cap.kind == "value" and cap.value < 2.0 and math.isfinite(cap.value)
