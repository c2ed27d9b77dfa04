"""The step-time model with and without its attention term (predict/step_model.py:
per_prefill_attention_pair_s), fitted on the starts of some chunk sizes of a run and
judged on the steps of the others: held out by launch, as a prediction of an unmeasured
chunk size is.

Both forms are fitted by step_model.fit on the same rounds; "without" is the same rounds
with the prefill_attention_pairs column zeroed, as an older kit's records read, so the
fit leaves the term out by its own rule. Printed for each form: its coefficients, and on
the held-out starts' busy steps |predicted / measured - 1| (median, P90) for steps whose
prefill fills at least --fill of the chunk, other steps with a prefill, and decode-only
steps, with the sum of predicted over measured busy time (what the simulator's clock
adds up).

    python benchmarks/attention_term.py results/<run> --fit-chunks 2048,8192 [--fill 0.9]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "lib"))

from vllm_study.predict import step_model  # noqa: E402

COLUMN = "prefill_attention_pairs"


def rounds_by_chunk(run_dir: Path) -> dict[int, list[np.ndarray]]:
    """Every round's step records of the run (step_model.collect), by the chunk size of
    the start it ran in."""
    out: dict[int, list[np.ndarray]] = {}
    for rows, scope in step_model.collect(run_dir):
        out.setdefault(scope.launch["max_num_batched_tokens"], []).append(rows)
    return out


def without(rows: np.ndarray) -> np.ndarray:
    rows = rows.copy()
    rows[COLUMN] = 0
    return rows


def errors(model: step_model.StepModel, rounds: list[np.ndarray], chunk: int, fill: float) -> str:
    parts = [step_model.busy(r) for r in rounds]
    rows = np.concatenate([r for r, _ in parts])
    y = np.concatenate([c for _, c in parts])
    guess = model.predict(rows)
    err = np.abs(guess / y - 1)
    full = rows["prefill_tokens"] >= fill * chunk
    kinds = (("full-chunk", full), ("other prefill", (rows["prefill_tokens"] > 0) & ~full),
             ("decode-only", rows["prefill_tokens"] == 0))
    return "; ".join(f"{name} ({m.sum()}) median {np.median(err[m]):.1%}, P90 {np.quantile(err[m], 0.9):.1%}"
                     for name, m in kinds if m.any()) + f"; busy time predicted / measured {guess.sum() / y.sum():.3f}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run", type=Path)
    ap.add_argument("--fit-chunks", required=True,
                    help="chunk sizes whose starts the model is fitted on, e.g. 2048,8192")
    ap.add_argument("--fill", type=float, default=0.9, help="a full-chunk step's prefill share of the chunk")
    a = ap.parse_args()
    by_chunk = rounds_by_chunk(a.run)
    fit_chunks = [int(c) for c in a.fit_chunks.split(",")]
    missing = [c for c in fit_chunks if c not in by_chunk]
    if missing:
        raise SystemExit(f"--fit-chunks {missing}: no start of the run at that chunk (it has {sorted(by_chunk)})")
    train = [r for c in fit_chunks for r in by_chunk[c]]
    if not all(step_model.recorded(r, COLUMN) for r in train):
        raise SystemExit(f"{a.run}: a round of the fitted starts lacks {COLUMN} (an older kit's records)")
    scope = step_model.Scope(model="-", device="-", dtype="-", vllm_version="-", engine="gpu", launch={})
    for form, rounds in (("with the attention term", train), ("without it", [without(r) for r in train])):
        m = step_model.fit(rounds, scope)
        print(f"{form}: fitted on chunk {a.fit_chunks} ({m.rounds} rounds, {m.steps} busy steps); "
              + ", ".join(f"{t} {v * 1e6:.4g} us" for t, v in m.coef.items() if v)
              + (f"; held-out by round: median {m.held_out.median:.1%}, P90 {m.held_out.p90:.1%}"
                 if m.held_out else ""))
        for chunk in sorted(set(by_chunk) - set(fit_chunks)):
            test = by_chunk[chunk] if form.startswith("with ") else [without(r) for r in by_chunk[chunk]]
            print(f"    on chunk {chunk} ({len(test)} rounds, not fitted): {errors(m, test, chunk, a.fill)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
