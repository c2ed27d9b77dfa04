"""Whether the KV a prefill chunk's attention reads explains the spread of full-chunk
steps: per start of a run whose step records carry `prefill_context_tokens`, the steps
whose prefill fills at least 90% of the chunk (max_num_batched_tokens), fitted by least
squares on their cycle with and without that column.

The step-time model's terms (predict/step_model.py) leave the full-chunk steps' spread
unexplained: on one H100 a least-squares fit on the recorded columns left a median
residual of 13% among chunk-4096 steps. The column is the sum, over the requests in the
step's prefill, of the context each had computed before the step; the attention of a
chunk deep in a long prompt reads all of it. Printed per start: the full-chunk steps'
count and time, the column's median and P90, Spearman's rho with the step's time, and
the absolute relative residual (median, P90) of an ordinary least-squares fit on
(1, decode requests, context tokens) against the same with `prefill_context_tokens`,
with that term's coefficient; where the records have it, the same with
`prefill_attention_pairs` (the chunks' causal query-key pairs) in its place. A fit over
one start's full-chunk steps: a within-sample reading of what the term could explain,
not a held-out error.

    python benchmarks/prefill_context_term.py results/<run> [--fill 0.9]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
from scipy import stats

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "lib"))

from vllm_study.scheduler_plugin import steps  # noqa: E402
from vllm_study.records.results import RunFolder  # noqa: E402


def residuals(x: np.ndarray, t: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Ordinary least squares (numpy's lstsq: no bounds needed for a reading) of t on x:
    the coefficients and each step's |fitted / t - 1|."""
    b, *_ = np.linalg.lstsq(x, t, rcond=None)
    return b, np.abs(x @ b / t - 1)


def start_rows(start_dir: Path) -> tuple[np.ndarray, np.ndarray] | None:
    """Every round's rows and cycles (seconds) of a start, or None where its records
    were written before the column (load_round reads a missing column as zeros)."""
    files = sorted((start_dir / "steps").glob("r*.npz"))
    if not files:
        return None
    for f in files:
        with np.load(f) as z:
            if "prefill_context_tokens" not in z.files:
                return None
    rounds = [steps.load_round(f) for f in files]
    return np.concatenate(rounds), np.concatenate([steps.cycles(r) for r in rounds])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run", type=Path)
    ap.add_argument("--fill", type=float, default=0.9, help="a full-chunk step's prefill share of the chunk")
    a = ap.parse_args()
    run, seen = RunFolder(a.run), 0
    for pid in run.point_ids():
        folder = run.point(pid)
        chunk = folder.plan().point.engine_args.max_num_batched_tokens
        for rec in folder.starts():
            got = start_rows(folder.start_dir(rec.start))
            if got is None or not chunk:
                continue
            rows, cyc = got
            full = rows["prefill_tokens"] >= a.fill * chunk
            if full.sum() < 10:
                continue
            seen += 1
            t, pc = cyc[full] * 1e3, rows["prefill_context_tokens"][full].astype(float)
            base = np.column_stack([np.ones(full.sum()), rows["decode_reqs"][full], rows["context_tokens"][full]])
            _, r0 = residuals(base, t)
            b1, r1 = residuals(np.column_stack([base, pc]), t)
            print(f"{pid}#s{rec.start}: {full.sum()} full-chunk steps (>= {a.fill:.0%} of {chunk}), "
                  f"median {np.median(t):.1f} ms, P90 {np.quantile(t, 0.9):.1f} ms; prefill_context_tokens "
                  f"median {np.median(pc):.0f}, P90 {np.quantile(pc, 0.9):.0f}; Spearman rho "
                  f"{stats.spearmanr(pc, t).statistic:+.2f}")
            print(f"    residual without it: median {np.median(r0):.1%}, P90 {np.quantile(r0, 0.9):.1%}; "
                  f"with it: median {np.median(r1):.1%}, P90 {np.quantile(r1, 0.9):.1%} "
                  f"({b1[-1] * 1e3:.2f} us a context token)")
            pairs = rows["prefill_attention_pairs"][full].astype(float)
            if pairs.any():   # records from before the column read it as zeros
                b2, r2 = residuals(np.column_stack([base, pairs]), t)
                print(f"    with prefill_attention_pairs instead: median {np.median(r2):.1%}, P90 "
                      f"{np.quantile(r2, 0.9):.1%} ({b2[-1] * 1e6:.3f} ns a query-key pair)")
    if not seen:
        raise SystemExit(f"{a.run}: no start has step records with prefill_context_tokens and 10 full-chunk steps")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
