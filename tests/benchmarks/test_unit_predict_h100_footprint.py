"""benchmarks/predict_h100_footprint.py: a start's whole step records cut into its
warm-up and rounds at the engine's idle gaps, and each piece's token counts checked
against the requests it should hold (synthetic rows, no server)."""
from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from vllm_study.scheduler_plugin.steps import DTYPE
from paths import REPO

SCRIPT = REPO / "benchmarks" / "predict_h100_footprint.py"
_spec = importlib.util.spec_from_file_location("predict_h100_footprint", SCRIPT)
fp = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fp)

PROMPT, OUT, CACHED = 40, 4, 32  # a request: 40 prompt tokens (32 of them a shared prefix), 4 out


def burst(t0: float, n: int, cycle: float = 0.01) -> list[tuple]:
    """The steps of n requests sent together to an async engine: one step computes the
    first prompt whole, the next the others' uncached tails, then OUT - 1 decode steps.
    Each step is scheduled half a cycle before the previous output (two in flight)."""
    rows, t = [], t0
    shapes = [(PROMPT, 1, 0, 0, 0)] + ([((n - 1) * (PROMPT - CACHED), n - 1, 1, 1, (n - 1) * CACHED)] if n > 1 else [])
    shapes += [(0, 0, n, n, 0)] * (OUT - 1 - (1 if n > 1 else 0))
    shapes += [(0, 0, n - 1, n - 1, 0)] if n > 1 else []  # the first request's last decode came a step earlier
    for p_tok, p_req, d_req, d_tok, cached in shapes:
        rows.append((t, t + cycle, p_tok, p_req, d_req, d_tok, 0, cached, n, 0, 0, 0.0, 0, 0))
        t += cycle / 2
    return rows


def test_split_idle_cuts_only_where_the_engine_idled():
    rows = np.array(burst(0.0, 2) + burst(1.0, 3) + burst(1.05, 3) + burst(3.0, 3), dtype=DTYPE)
    pieces = fp.split_idle(rows, 0.1)
    # the 30 ms gap inside the second round (a closed loop's turnaround) is not a cut
    assert [len(p) for p in pieces] == [len(burst(0, 2)), 2 * len(burst(0, 3)), len(burst(0, 3))]
    assert np.array_equal(np.concatenate(pieces), rows)
    # overlapping steps (async: scheduled before the previous output) never cut
    assert len(fp.split_idle(np.array(burst(0.0, 3), dtype=DTYPE), 1e-6)) == 1
    assert fp.split_idle(np.zeros(0, dtype=DTYPE)) == []


def test_split_idle_refuses_bad_input():
    rows = np.array(burst(1.0, 2) + burst(0.0, 2), dtype=DTYPE)
    with pytest.raises(ValueError, match="not in schedule order"):
        fp.split_idle(rows)
    with pytest.raises(ValueError, match="must be positive"):
        fp.split_idle(rows[:2], 0)


def test_rounds_of_checks_each_round_s_tokens():
    warm, r0, r1 = burst(0.0, 2), burst(1.0, 3), burst(2.0, 3)
    rows = np.array(warm + r0 + r1, dtype=DTYPE)
    rounds, tallies, why = fp.rounds_of(rows, 2, warmup=2, requests=3, prompt_tokens=PROMPT, output_tokens=OUT)
    assert why is None and all(r is not None for r in rounds)
    assert [t["complete"] for t in tallies] == [True, True, True]
    assert tallies[1]["prefill_tokens"] + tallies[1]["cached_tokens"] == 3 * PROMPT
    assert tallies[1]["decode_tokens"] == 3 * (OUT - 1)
    # a round that lost rows (its last steps) is flagged and left out, the others kept
    lossy = np.array(warm + r0[:-2] + r1, dtype=DTYPE)
    rounds, tallies, why = fp.rounds_of(lossy, 2, warmup=2, requests=3, prompt_tokens=PROMPT, output_tokens=OUT)
    assert rounds[0] is None and rounds[1] is not None and tallies[1]["complete"] is False
    # more pieces than the protocol has: no round is guessed
    extra = np.array(warm + r0 + r1 + burst(3.0, 3), dtype=DTYPE)
    rounds, _, why = fp.rounds_of(extra, 2, warmup=2, requests=3, prompt_tokens=PROMPT, output_tokens=OUT)
    assert rounds == [None, None] and "4 idle-separated pieces, not 2 rounds and the warm-up" in why
