"""Step records: one row per engine step, written by the kit's scheduler in the engine
process and cut into rounds by the kit (a step-time model is fitted from them, and the
simulator replays rounds with it).

The engine appends fixed-width rows to a raw file (``STEPS_ENV`` names it) as steps
finish: a crash loses at most the rows not yet flushed, and the kit reads the file
while the engine writes (a torn last row is dropped). After a round the kit keeps the
rows whose step was scheduled inside the round as ``steps/r<round>.npz``, one array a
column (numpy's own compressed columnar format: no extra dependency, and a 10,000-step
round is ~260 kB on synthetic steps of random counts; real counts compress better).

Times are ``time.monotonic()`` (CLOCK_MONOTONIC on Linux: one clock for the engine and
the kit's processes). A step's *cycle* is the time between its output and the previous
step's output while the engine is busy: under async scheduling (a GPU engine's
default) vLLM schedules step n+1 before step n's output is back, so
``t_done - t_scheduled`` overlaps the previous step, and consecutive outputs are what
a step costs the engine loop (as Dynamo's InstrumentedScheduler times it).
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np

STEPS_ENV = "VLLM_STUDY_STEPS"  # the raw file's path, in the server's environment

# (name, dtype, meaning); the order is the raw file's row layout.
COLUMNS = (
    ("t_scheduled", "f8", "time.monotonic() when schedule() was called for the step"),
    ("t_done", "f8", "time.monotonic() when update_from_output() took its output"),
    ("prefill_tokens", "i4", "tokens scheduled for requests still inside their prompt"),
    ("prefill_reqs", "i4", "requests scheduled inside their prompt (a chunk or all of it)"),
    ("decode_reqs", "i4", "requests scheduled past their prompt"),
    ("decode_tokens", "i4", "tokens scheduled for those (one each without speculative decoding)"),
    ("context_tokens", "i8", "KV tokens the scheduled requests had computed before the step (read by attention)"),
    ("cached_tokens", "i4", "prompt tokens found in the prefix cache for requests first scheduled in the step"),
    ("running", "i4", "requests running after the step was scheduled"),
    ("waiting", "i4", "requests waiting after the step was scheduled"),
    ("preempted", "i4", "requests preempted while scheduling the step"),
    ("kv_usage", "f4", "share of KV blocks in use after the step was scheduled"),
    ("prefill_context_tokens", "i8", "KV tokens the requests inside their prompt had computed before the "
     "step (what a chunk's attention reads besides itself: a chunk late in a long prompt costs more)"),
    ("prefill_attention_pairs", "i8", "query-key pairs the prefill chunks' causal attention computes: for each "
     "request inside its prompt, n x c + n (n + 1) / 2 for n tokens scheduled after c computed"),
)
DTYPE = np.dtype([(name, kind) for name, kind, _ in COLUMNS])
ROUNDS_DIR = "steps"


def round_path(start_dir: str | os.PathLike, round_index: int) -> Path:
    return Path(start_dir) / ROUNDS_DIR / f"r{round_index}.npz"


def read_raw(path: str | os.PathLike) -> np.ndarray:
    """Every whole row of the engine's raw file (a row being written is left out)."""
    data = Path(path).read_bytes()
    whole = len(data) - len(data) % DTYPE.itemsize
    return np.frombuffer(data[:whole], dtype=DTYPE)


def between(rows: np.ndarray, t0: float, t1: float) -> np.ndarray:
    """The rows of steps scheduled in [t0, t1] (monotonic seconds)."""
    return rows[(rows["t_scheduled"] >= t0) & (rows["t_scheduled"] <= t1)]


def save_round(start_dir: str | os.PathLike, round_index: int, rows: np.ndarray) -> Path:
    path = round_path(start_dir, round_index)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp.npz")
    np.savez_compressed(tmp, **{name: rows[name] for name in DTYPE.names})
    os.replace(tmp, path)
    return path


def load_round(path: str | os.PathLike) -> np.ndarray:
    """A round's rows as saved by save_round; columns a later kit added are zero."""
    with np.load(path) as z:
        n = len(z[DTYPE.names[0]])
        rows = np.zeros(n, dtype=DTYPE)
        for name in DTYPE.names:
            if name in z.files:
                rows[name] = z[name]
    return rows


def cycles(rows: np.ndarray) -> np.ndarray:
    """Each step's cycle in seconds: its output time less the previous step's output
    time, or less its own schedule time where the engine was idle in between (the
    previous output came before this step was scheduled)."""
    done = rows["t_done"]
    prev = np.concatenate([[-np.inf], done[:-1]])
    start = np.maximum(prev, rows["t_scheduled"])
    return done - start
