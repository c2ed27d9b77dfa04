"""A capacity study's figures from its run folder: the answer, each config's capacity
with its 95% interval and each start's bracket, the latencies at capacity, and whether
the replay reproduced the trace (prompt tokens against the trace, the hit rate the
trace's prefix ids allow against vLLM's, send lateness), then every step of every
start with its verdict. A plain trace run (no `capacity:`) gets the fidelity figures alone.

    python benchmarks/capacity_table.py results/<run> [--price 3.5]
"""
from __future__ import annotations

import argparse

import pandas as pd

from vllm_study.report import report
from vllm_study.report import answer, capacity_section


def steps_table(r: report.Run) -> pd.DataFrame:
    rows = []
    for s in r.summaries:
        for st in r.folder.point(s.point).starts():
            rounds = {x.round: x for x in r.folder.point(s.point).rounds() if x.start == st.start}
            for k, x in sorted(rounds.items()):
                m = x.metrics
                # (trace.windows: a step is K rounds, one a window; each row is a round, its verdict its window's
                # alone; the step's pooled verdict is in start.json's capacity.steps)
                rows.append({"point": s.point, "start": st.start, "step": k + 1, "load": x.load, "met": x.slo_met,
                             **({"window": x.window} if x.window is not None else {}),
                             "TTFT P90 from schedule (ms)": m.get("ttft_sched_p90_ms"),
                             "ITL P99 (ms)": m.get("itl_p99_ms"),
                             "round (s)": m.get("duration_s"), "why missed": x.slo_why or ""})
    return pd.DataFrame(rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run")
    ap.add_argument("--price", type=float, help="a GPU-hour's price, for the cost per million output tokens")
    a = ap.parse_args()
    r = report.Run.load(a.run)
    pd.set_option("display.width", 250, "display.max_columns", 30, "display.max_colwidth", 60)
    if not capacity_section.is_capacity_study(r):
        fidelity = answer.fidelity_table(r)
        if fidelity is None and r.study.workload.kind != "trace":
            raise SystemExit(f"{a.run} is neither a capacity study (its study has no `capacity:`) nor a trace "
                             "replay: there is nothing for this table")
        print(fidelity.to_string() if fidelity is not None else "no round of this trace run was measured")
        return 0
    if a.price:
        r.study.gpu_hour_price = a.price  # the report reads the typed study
    print(capacity_section.capacity_answer(r), end="\n\n")
    print(capacity_section.capacity_table(r).to_string(), end="\n\n")
    fidelity = answer.fidelity_table(r)
    if fidelity is not None:
        print(fidelity.to_string(), end="\n\n")
    print(steps_table(r).round(3).to_string(index=False))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
