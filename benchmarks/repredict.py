"""A predict-then-confirm run's grid predicted again with the kit as it is now, from the
steps of the starts named (the run's seeds, or every measured start), and set beside
what the run measured: whether today's step model and front end would have ranked the
measured configs right, and by how much each prediction misses.

The starts not named are left out of a copy of the run folder (as if they had not run),
the copy's grid predicted as the sweep predicts it (predict/study.py: fit, predict every
point, end-to-end error, widen, rank), and the table is the report's
(report/predict_section.py) against the original run's measured capacities.

    nice -n 5 python benchmarks/repredict.py results/<run> --from seeds --workers 2 [--json out.json]
    nice -n 5 python benchmarks/repredict.py results/<run> --from all --workers 2
    nice -n 5 python benchmarks/repredict.py results/<run> --from all --drop-column prefill_attention_pairs

--drop-column removes a step-record column from the copy's starts, as a kit that did not
record it would have left them: the step model then leaves out its term
(step_model.RECORDED_LATER), so the same starts predict with and without it.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "lib"))

from vllm_study.define.study_file import load_study  # noqa: E402
from vllm_study.predict import step_model  # noqa: E402
from vllm_study.predict import study as ps  # noqa: E402
from vllm_study.scheduler_plugin import steps  # noqa: E402
from vllm_study.records.results import RunFolder, git_state  # noqa: E402
from vllm_study.report import predict_section  # noqa: E402


def keep_only(copy: Path, starts: set[str]) -> list[str]:
    """Remove from the copied run every start folder not in `starts` ("point#sN"); the
    starts kept."""
    run, kept = RunFolder(copy), []
    for pid in run.point_ids():
        folder = run.point(pid)
        for rec in folder.starts():
            name = f"{pid}#s{rec.start}"
            if name in starts:
                kept.append(name)
            else:
                shutil.rmtree(folder.start_dir(rec.start))
    return kept


def drop_column(copy: Path, column: str) -> int:
    """Rewrite every round's step records in the copied run without `column`; the rounds
    rewritten."""
    files = sorted(copy.glob(f"points/*/s*/{steps.ROUNDS_DIR}/r*.npz"))
    for f in files:
        with np.load(f) as z:
            kept = {k: z[k] for k in z.files if k != column}
        f.unlink()
        np.savez_compressed(f, **kept)
    return len(files)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run", type=Path, help="a run folder of a `predict:` study (its predictions.json)")
    ap.add_argument("--from", dest="source", default="seeds",
                    help="'seeds' (the run's seed starts), 'all' (every measured start), or point#sN,...")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--drop-column", choices=step_model.RECORDED_LATER, action="append", default=[],
                    help="predict as if the starts had not recorded this step-record column (its term left out)")
    ap.add_argument("--json", type=Path, help="write the figures here")
    a = ap.parse_args()
    commit = git_state(Path(__file__).resolve().parents[1])   # the code's, as the run starts
    original = RunFolder(a.run)
    then = ps.read(a.run)
    if then is None:
        raise SystemExit(f"{a.run}: no predictions.json (not a run of a `predict:` study)")
    study = load_study(a.run / "study.yaml")
    measured = [f"{p}#s{rec.start}" for p, _, rec in ps.measured_starts(original)]
    if a.source == "seeds":
        starts = {s for s in measured if s.split("#")[0] in then.seeds and s.endswith("#s1")}
    elif a.source == "all":
        starts = set(measured)
    else:
        starts = set(a.source.split(","))
        unknown = starts - set(measured)
        if unknown:
            raise SystemExit(f"--from names {', '.join(sorted(unknown))}: not a measured start of the run "
                             f"({', '.join(measured)})")
    capacities = ps.measured_capacities(original, study)
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(shutil.copytree(a.run, Path(tmp) / a.run.name))
        (copy / ps.PREDICTIONS).unlink()
        kept = keep_only(copy, starts)
        for column in a.drop_column:
            drop_column(copy, column)
        t = time.monotonic()
        pred = ps.predict(RunFolder(copy), study, workers=a.workers)
        wall = time.monotonic() - t
        pred.save(RunFolder(copy))
        sec = predict_section.predicted_vs_measured(copy, capacities)
    print(f"predicted again from {len(kept)} start(s): {', '.join(sorted(kept))}"
          + (f"; without the step records' {', '.join(a.drop_column)}" if a.drop_column else ""))
    if pred.model.left_out:
        print("terms left out: " + "; ".join(f"{t}: {why}" for t, why in pred.model.left_out.items()))
    print(f"{sum(p.predicted for p in pred.points)} of {len(pred.points)} points in {wall:.0f} s on "
          f"{a.workers} process(es); model {pred.model.coef}")
    print(f"end-to-end error at the starts used: +-{pred.error.widen:.0%}" if pred.error.widen is not None
          else "end-to-end error at the starts used: none measured")
    print("top 5 now: " + ", ".join(f"{p.point} {p.value:.3g}" for p in sorted(
        (p for p in pred.points if p.rank), key=lambda p: p.rank)[:5]))
    import pandas as pd
    with pd.option_context("display.width", 250, "display.max_columns", 20):
        print(sec.table.drop(columns=["OUTSIDE its measured interval"]).assign(
            flag=sec.table["OUTSIDE its measured interval"]).to_string())
    print("\n".join(sec.lines[2:5]))
    best_measured = max((k for k, v in capacities.items() if v and v.config.kind == "value"),
                        key=lambda k: capacities[k].config.value, default=None)
    top = min((p for p in pred.points if p.rank), key=lambda p: p.rank)
    print(f"best measured: {best_measured}; predicted first: {top.point}; its predicted rank now: "
          f"{next((p.rank for p in pred.points if p.point == best_measured), None)}")
    if a.json:
        a.json.write_text(json.dumps({
            "run": str(a.run), "from": sorted(kept), "dropped_columns": a.drop_column, "wall_s": wall,
            "commit": commit.sha, "dirty": commit.dirty,
            "workers": a.workers, "model": pred.model.model_dump(), "widen": pred.error.widen,
            "points": [p.model_dump() for p in pred.points],
            "errors": sec.errors, "median_error": float(np.median(list(sec.errors.values()))) if sec.errors else None,
            "tau": sec.tau, "flagged": sec.flagged}, indent=1, default=str) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
