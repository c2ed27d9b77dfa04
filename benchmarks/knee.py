"""Find the arrival rate near a server's knee from a rate-ladder run, and write it as a
study override.

A ladder run (workload.load.kind: ladder) measures TTFT at each step of rising Poisson
rates. The knee is where queueing starts: the last step whose TTFT P50 and P99 stay
within `--factor` times the first step's. A study meant to load the server without
saturating it runs there; give the steps enough requests (60 or more) for a queue to
show.

    python benchmarks/knee.py results/<ladder run> --out knee.yaml
    python -m vllm_study sweep params/h200-qwen2.5-32b.yaml knee.yaml
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

from vllm_study.records.results import RunFolder


def steps(run: RunFolder) -> list[dict]:
    """Per ladder step: rate, TTFT P50 and P99 (ms), requests, failures (first round)."""
    rows = []
    for s in run.summaries():
        for label, ests in s.groups.items():
            key, _, value = label.partition("=")
            if key == "step":
                rows.append({"rate": float(value), "ttft_p50_ms": ests["ttft_p50_ms"].median,
                             "ttft_p99_ms": ests["ttft_p99_ms"].median, "requests": ests["requests"].median,
                             "failed": ests["failed"].median})
    return sorted(rows, key=lambda r: r["rate"])


def knee(rows: list[dict], factor: float) -> float:
    """The highest rate whose TTFT P50 and P99 are both within `factor` of the lowest
    rate's, every step up to it included (a later dip does not count) and with no failed
    request. The P99 matters: a queue that is starting to build shows in the tail of a
    short step before its median moves (on the H200 32B ladder, P99 doubled at 6 req/s
    while P50 held, and 6 req/s sustained turned out past the knee)."""
    base50, base99 = rows[0]["ttft_p50_ms"], rows[0]["ttft_p99_ms"]
    chosen = rows[0]["rate"]
    for r in rows:
        if r["failed"] or r["ttft_p50_ms"] > factor * base50 or r["ttft_p99_ms"] > factor * base99:
            break
        chosen = r["rate"]
    return chosen


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run", type=Path, help="a run folder of a ladder study")
    ap.add_argument("--factor", type=float, default=2.0, help="TTFT P50 growth that marks the knee (default 2)")
    ap.add_argument("--out", type=Path, help="write a study override with the chosen rate here")
    a = ap.parse_args()
    rows = steps(RunFolder(a.run))
    if not rows:
        print(f"{a.run} has no ladder steps (workload.load.kind: ladder)", file=sys.stderr)
        return 2
    print(f"{'rate':>6} {'TTFT P50':>10} {'TTFT P99':>10} {'failed':>7}")
    for r in rows:
        print(f"{r['rate']:>6g} {r['ttft_p50_ms']:>10.1f} {r['ttft_p99_ms']:>10.1f} {r['failed']:>7.0f}")
    rate = knee(rows, a.factor)
    print(f"knee: {rate:g} req/s (the last step with TTFT P50 and P99 within {a.factor:g}x of the first)")
    if a.out:
        a.out.write_text(yaml.safe_dump({"workload": {"load": {"kind": "poisson", "rate": rate}}}))
        print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
