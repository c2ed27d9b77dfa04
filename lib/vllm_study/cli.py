"""Command line: `python -m vllm_study sweep params/default.yaml` and friends."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

# Each command imports what it needs inside main(): pandas (records, report) and papermill
# (sweep) take a second to import, and --help or a mistyped command answer at once.
from .executors import EXECUTORS
from .define.schema import StudyError


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m vllm_study", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    sw = sub.add_parser("sweep", help="run a study: every grid point, then the report")
    sw.add_argument("params", nargs="*", help="study YAML file(s); later ones override earlier keys")
    sw.add_argument("--results", default="results", help="where run folders go (default: results)")
    sw.add_argument("--engine", choices=["auto", "cpu", "gpu"],
                    help="overrides the study's server.engine (auto: gpu where NVML sees one)")
    sw.add_argument("--dry-run", action="store_true", help="list the points and their vLLM args; start nothing")
    sw.add_argument("--max-minutes", type=float, help="stop cleanly between points after this long")
    sw.add_argument("--resume", type=Path, help="a run folder to complete (finished points are skipped)")
    sw.add_argument("--retry-failed", action="store_true", help="with --resume: run failed points again")
    sw.add_argument("--executor", choices=list(EXECUTORS), default="local",
                    help="who runs the server starts (docs/scale-out.md). local: one at a time; gpus: one per "
                    "free GPU set of this host; ray: Ray tasks")
    sw.add_argument("--ray-address", help="with --executor ray: the cluster (default: a local Ray)")
    sw.add_argument("--parallel", type=int, help="at most this many server starts at once")
    sw.add_argument("--no-report", action="store_true",
                    help="skip the report (render it later with `report`, e.g. where nbconvert is missing)")
    rep = sub.add_parser("report", help="re-render a run folder's summary.csv, report notebook and report.html")
    rep.add_argument("run", type=Path)
    rep.add_argument("--slo", default="", help="an SLO for this report, e.g. ttft_p90_ms=2500,itl_p90_ms=100")
    rep.add_argument("--overwrite", action="store_true",
                     help="a run whose report git tracks: render into it (by default into a copy, so the "
                          "checkout stays clean)")
    ex = sub.add_parser("export", help="write a `vllm serve --config` file for a point, with its evidence")
    ex.add_argument("run", type=Path)
    which = ex.add_mutually_exclusive_group()
    which.add_argument("--point", help="a point id (default: the report's recommendation)")
    which.add_argument("--best", action="store_true", help="the report's recommendation (the default)")
    ex.add_argument("--out", type=Path, default=Path("."), help="folder for the config and its notes")
    ex.add_argument("--slo", default="", help="judge the points under this SLO instead of the study's")
    ex.add_argument("--force", action="store_true",
                    help="exit 0 where the point does not surely meet the SLO (by default: exit 3; the files "
                         "are written either way)")
    cmp = sub.add_parser("compare", help="two runs side by side: per point and metric, the change with its interval")
    cmp.add_argument("run_a", type=Path)
    cmp.add_argument("run_b", type=Path)
    cmp.add_argument("--out", type=Path, help="also write compare.csv and compare.png here")
    doc = sub.add_parser("doctor", help="check GPU, vLLM, port, proxies, model, disk; print fixes")
    doc.add_argument("params", nargs="*", help="a study file, to check its model and tokenizer too")
    doc.add_argument("--port", type=int, default=8000)
    doc.add_argument("--results", type=Path, default=Path("results"))
    args = ap.parse_args(argv)

    if args.cmd == "doctor":
        from . import doctor
        try:
            findings = doctor.diagnose(args.params, args.port, args.results)
        except StudyError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        for f in findings:
            print(f)
        return 1 if any(f.status == doctor.FAIL for f in findings) else 0

    if args.cmd in ("export", "compare"):
        return _decide(args)

    from . import sweep as sw_mod  # papermill import is slow; keep --help fast
    from .records.results import RunFolder
    try:
        if args.cmd == "report":
            run = RunFolder(args.run)
            from .report.run import parse_slo
            parse_slo(args.slo)  # a bad SLO is refused before the notebook runs
            run = sw_mod.report_folder(run, args.overwrite)
            sw_mod.render_report(run, args.slo)
            return _conclude(run)
        if not args.params and not args.resume:
            ap.error("give a params file (e.g. params/default.yaml) or --resume RUN_FOLDER")
        if args.dry_run:
            sw_mod.dry_run(args.params, args.engine)
            return 0
        outcome = sw_mod.sweep(args.params, Path(args.results), args.engine, args.resume,
                               args.max_minutes, args.retry_failed, report=not args.no_report,
                               executor=args.executor, ray_address=args.ray_address, parallel=args.parallel)
    except (StudyError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    if args.no_report:
        print(f"\nrun folder: {outcome.run.path} (no report: render it with `report {outcome.run.path}`)")
        return 0
    return _conclude(outcome.run)


def _conclude(run) -> int:
    """The run folder and its short table; exit 1 when no point measured anything (the
    report then shows only why each point failed)."""
    from .report import report
    from .report import capacity_section
    r = report.Run.load(run)
    print(f"\nrun folder: {run.path}\nreport: {run.path / 'report.html'}\n")
    if report.study_failed(r):
        print("the study failed: no point measured a round.\n")
        print(report.failures(r).to_string())
        return 1
    if r.search and not r.measured:
        from .search import search_report
        print(capacity_section.search_trials(r).to_string())
        print("\n" + search_report.NOT_CONFIRMED.format(run=run.path))
        return 0
    print(report.short_table(r).to_string())
    return 0


def _decide(args) -> int:
    import pandas as pd
    try:
        if args.cmd == "export":
            from .report.export import EXIT_SLO_NOT_MET, export_point
            from .report.run import parse_slo
            e = export_point(args.run, args.point, args.out, parse_slo(args.slo))
            print(f"{e.config}\n{e.notes}\n")
            print(e.notes.read_text())
            if e.shortfall:
                whose = ("the study's capacity.slo (judged by its capacity)" if e.by_capacity else
                         ("the SLO given with --slo" if e.slo_given else "the study's slo")
                         + " (its 95% interval does not lie within every bound)")
                print(f"{'warning' if args.force else 'error'}: {e.point} does not surely meet {whose}: "
                      f"{e.shortfall}. The files were written all "
                      f"the same: {e.config} and {e.notes}"
                      + (" (--force: exit 0)." if args.force else
                         f"; exit {EXIT_SLO_NOT_MET} (--force exports it with exit 0)."), file=sys.stderr)
                return 0 if args.force else EXIT_SLO_NOT_MET
            return 0
        from .report.compare import compare_runs
        with pd.option_context("display.width", 250, "display.max_columns", 20, "display.max_colwidth", 60):
            head, side_by_side, line = compare_runs(args.run_a, args.run_b, args.out)
            print(head + "\n")
            print(side_by_side.to_string())
            print(line)
        return 0
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
