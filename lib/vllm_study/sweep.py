"""Run a study: check it, lay out its run folder, then one papermill execution of the
point notebook per unit (one server start of one point) in the run's randomized block
order, then the report. A unit that fails is recorded and the sweep goes on; a time
budget stops cleanly between units; `resume` runs what is not finished.
"""
from __future__ import annotations

import contextlib
import datetime as dt
import os
import random
import shlex
import shutil
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import papermill as pm
import yaml
from tqdm import tqdm

from . import doctor, executors
from .define.grid import Point, PointMaker, PointPlan, Unit, expand, live_groups, run_order
from .launch.machine import cpu_dtype, describe, resolve_engine, versions
from .define.plan_labels import live_label, plan_label, rounds_label, search_space_label
from .define.params import Study
from .define.schema import StudyError
from .define.study_file import load_study
from .define.traces import TraceError
from .analysis import confirmation as confirming
from .records import confirmation, point_capacity
from .records.results import (NO_COMMIT, ROUNDS, Manifest, RunFolder, git_output, git_state, now_utc, on_gpu,
                              read_rounds, resume_hint, write_atomic)
from .launch.slots import SLOT_LOCKS
from .measure.point import summarize
from .measure.primer import model_departure
from .measure.unit import POINT_PARAMS, STOPPING, notebook, stop_leftover_server
from .analysis.intervals import point_intervals, relative_width
from .define.timing import estimate_minutes, priming_s
from .report.page import export_html

REPO = Path(__file__).resolve().parents[2]  # a source checkout: its git state


REPORT_PARAMS = {"run_dir", "slo"}


def check_parameters(nb: Path, names) -> None:
    """papermill only warns about parameters a notebook does not declare; a typo would
    then silently run the default. Refuse instead."""
    declared = pm.inspect_notebook(str(nb))
    unknown = sorted(set(names) - set(declared))
    if unknown:
        raise ValueError(f"{nb.name} has no parameter(s) {unknown}; it declares {sorted(declared)}")


def study_engine(study: Study, requested: str | None) -> str:
    """The command line's --engine wins, then the study's server.engine; auto = gpu where
    NVML sees one."""
    return resolve_engine(requested or study.server.engine)


def prepare(study: Study, engine: str) -> list[Point]:
    """Everything checked before anything starts: the grid against vLLM's rules, the
    model, its tokenizer and chat template, each endpoint target. Raises StudyError
    listing what to fix; prints what will not stop the study but changes what it
    measures (a target's rounds that start warm, missing server counters)."""
    points = expand(study, engine)
    for line in windows_statements(study, points):
        print(line)
    found = doctor.study_findings(study, stop_at_target_fail=True)
    _refuse([f for f in found if f.status == doctor.FAIL])
    for f in found:
        if f.status == doctor.WARN:  # said here, before it starts, not only in start.json
            print(f)
    check_parameters(notebook("point.ipynb"), POINT_PARAMS)
    check_parameters(notebook("report.ipynb"), REPORT_PARAMS)
    return points


def windows_statements(study: Study, points: list[Point]) -> list[str]:
    """A trace study's windows (trace.windows), cut and checked before anything starts:
    what they are, and a StudyError where they cannot be cut or a window cannot run."""
    if study.workload.kind != "trace" or not study.workload.trace.windows:
        return []
    from .workload import windows
    try:
        return windows.study_statements(study, {p.effective.max_model_len for p in points if p.effective})
    except TraceError as e:
        raise StudyError(f"workload.trace: {e}") from None


def _refuse(problems: list) -> None:
    if problems:
        raise StudyError("the study cannot run on this machine:\n" + "\n".join(
            f"  {f.check}: {f.detail}" + (f"\n    fix: {f.fix}" if f.fix else "") for f in problems))


def create_run(results: Path, study: Study, engine: str, points: list[Point]) -> RunFolder:
    git = git_state(REPO)
    if git.sha is None:   # said before the run, and kept in its manifest
        print(f"warning: {NO_COMMIT}", file=sys.stderr)
    measured = predicted_seeds(study, points)   # predict: only its seeds are planned; the rest are predicted
    groups, _ = live_groups(study, engine, measured)
    run = RunFolder.create(results, study.name, git)
    write_atomic(run.study_path, yaml.safe_dump(study.model_dump(mode="json"), sort_keys=False))
    choice = cpu_dtype() if engine == "cpu" and study.engine_args.dtype is None and not study.targets else None
    Manifest(study=study.name, created_utc=now_utc(), git=git, versions=versions(), engine=engine,
             machine=describe(), cpu_dtype=choice.model_dump() if choice else None,
             points=[p.id for p in points],
             # a search's order grows as its trials are proposed (config_search.TrialSource)
             order=[] if study.search else run_order(measured, study.replicates, study.order_seed, groups),
             warnings={p.id: p.warnings for p in points if p.warnings},
             notes=[NO_COMMIT] if git.sha is None else [],
             params=study.model_dump(mode="json")).save(run.manifest_path)
    for p in points:
        run.point(p.id).save_plan(PointPlan(study=study, point=p, engine=engine))
    return run


def predicted_seeds(study: Study, points: list[Point]) -> list[Point]:
    """The points the planned starts measure: every one, or with `predict:` its seeds."""
    if not study.predict:
        return points
    from .define.predict_spec import seed_points
    try:
        ids = seed_points(study, [p.id for p in points])
    except ValueError as e:
        raise StudyError(str(e)) from None
    return [p for p in points if p.id in ids]


def unit_finished(run: RunFolder, unit: Unit, retry_failed: bool = False) -> bool:
    """Every point the unit's start serves has its start's outcome (with retry_failed: a good one)."""
    recs = [run.point(p).start(unit.start) for p in unit.points]
    if any(rec is None or rec.status == "running" for rec in recs):
        return False
    return not (retry_failed and any(rec.status == "failed" for rec in recs))


# -- the study ----------------------------------------------------------------------
@dataclass
class SweepOutcome:
    run: RunFolder
    units_left: int
    stop_note: str | None = None
    lengths: executors.UnitLengths | None = None  # the longest units so far: the next dispatch's time budget uses them


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def _stop_children() -> None:
    """Stop what this process started and is still running (papermill's kernel)."""
    import psutil
    kids = psutil.Process().children(recursive=True)
    for k in kids:
        k.terminate()
    _, alive = psutil.wait_procs(kids, timeout=10)
    for k in alive:
        k.kill()


def sweep(params_files: list[str], results: Path, engine: str | None = None, resume: Path | None = None,
          max_minutes: float | None = None, retry_failed: bool = False, report: bool = True,
          executor: str = "local", ray_address: str | None = None, parallel: int | None = None) -> SweepOutcome:
    t0 = time.monotonic()
    if resume:
        run = RunFolder(resume)
        study = load_study(run.study_path)
        engine = engine or run.manifest().engine
    else:
        study = load_study(*params_files)
    if study.confirm and study.search:   # refused before anything starts
        raise StudyError("confirm: (confirmation until resolved) runs after a grid's planned starts; after a "
                         "search's confirmation it is not run yet: leave confirm out of a search:, or give the "
                         "search's top configs and vLLM's defaults as a grid with baseline: and confirm:")
    engine = study_engine(study, engine)
    points = prepare(study, engine)  # raises StudyError before anything starts
    if not resume:
        run = create_run(results, study, engine, points)
    order = run.manifest().order
    todo = [u for u in order if not unit_finished(run, u, retry_failed)]
    if resume and todo:
        run.record_resume(REPO, [f"{u.point}#s{u.start}" for u in todo])
    print(f"run: {run.path}\n{plan_label(study, points)} x {rounds_label(study)}, engine {engine}; "
          f"{len(order) - len(todo)} of {len(order)} starts already finished")
    print(live_label(study, engine, predicted_seeds(study, points)))
    for p in points:
        for w in p.warnings:
            print(f"  warning {p.id}: {w}")
    # SIGTERM (a scheduler, `kill`) ends the sweep the way Ctrl-C does: the current
    # unit's server is stopped, finished units stay, --resume completes the rest.
    runner = executors.make(executor, run, study, engine, points, ray_address, parallel)
    print(f"executor {executor}: {len(runner.slots)} server start(s) at a time")
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    STOPPING.clear()
    seen = executors.recorded_lengths(run)  # a resumed run's earlier starts bound the budget's next ones
    if todo and seen.before:  # what --max-minutes has to hold
        print("starts left, at their points' longest so far: " + ", ".join(
            f"{u.point}#s{u.start} {seen.bound(False, u.point) / 60:.1f} min" for u in todo))
    try:
        if study.search:
            outcome = _search(run, study, engine, todo, t0, max_minutes, runner, seen)
        else:
            outcome = _run_units(run, todo, study, t0, max_minutes, runner, seen)
        refit = None
        if study.predict and not outcome.stop_note:
            outcome, refit = _predicted(run, study, t0, max_minutes, runner, outcome)
        while study.precision and not outcome.stop_note:
            extra = more_starts(run, study)
            if not extra:
                break
            print(f"precision: block {extra[0].block}, {len(extra)} more server start(s) for "
                  f"{sum(len(u.points) for u in extra)} point(s), start {extra[0].start}+")
            outcome = _run_units(run, extra, study, t0, max_minutes, runner, outcome.lengths)
        if study.confirm:
            outcome = confirm_until_resolved(run, study, outcome, lambda units, o: _run_units(
                run, units, study, t0, max_minutes, runner, o.lengths, on_done=refit))
    except KeyboardInterrupt:
        STOPPING.set()
        _stop_children()
        for u in run.manifest().order:
            stop_leftover_server(run.point(u.point).start_dir(u.start))
        for p in points:
            folder = run.point(p.id)
            if folder.starts():
                summarize(folder, folder.plan())
        point_capacity.write_summary_csv(run)
        print(f"\ninterrupted: finished rounds are kept in {run.path}; complete the run with:\n  "
              f"{resume_hint(run)}", flush=True)
        raise
    finally:
        signal.signal(signal.SIGTERM, previous)
        for lock_file in run.path.glob(SLOT_LOCKS):
            lock_file.unlink(missing_ok=True)
    record_overlaps(run, executor)
    if outcome.stop_note:
        print(f"{outcome.stop_note}; continue with:\n  {resume_hint(run)}")
    if report:
        render_report(run)
    else:
        point_capacity.write_summary_csv(run)
    return outcome


def _search(run: RunFolder, study: Study, engine: str, todo: list[Unit], t0: float, max_minutes: float | None,
            runner: executors.Executor, seen: executors.UnitLengths) -> SweepOutcome:
    """A search: the trials Optuna proposes (first any a stopped run left unfinished), one
    start each, within search.minutes; then fresh starts of the best and of vLLM's
    defaults (config_search.py)."""
    from .search import config_search as cs  # optuna (0.6 s to import) only where a run searched
    maker = PointMaker(study, engine)
    loop = cs.SearchLoop.in_run(run.path, study, cs.checker(maker))
    source = cs.TrialSource(loop, run, study, maker, engine)
    spec = study.search
    budget = min((m for m in (max_minutes, spec.minutes) if m), default=None)
    outcome = SweepOutcome(run, 0, lengths=seen)
    for pid, number in loop.running_points().items():  # ended, but stopped before its outcome was told
        if unit_finished(run, Unit(point=pid, start=1, block=cs.TRIAL_BLOCK)):
            loop.record(number, cs.outcome_of(run.point(pid).summary(), study, run.point(pid)))
    unfinished = [u for u in todo if u.block == cs.TRIAL_BLOCK]
    if unfinished:
        outcome = _run_units(run, unfinished, study, t0, budget, runner, seen, on_done=source.done)
    # once the confirmation is planned (a resumed run), its top k stand: no more trials
    confirming = any(u.block > cs.TRIAL_BLOCK for u in run.manifest().order)
    if not outcome.stop_note and len(source) and not confirming:
        print(f"search: {len(source)} trial(s) left of {spec.trials}, sampler {spec.sampler}, objective "
              f"{spec.objective}")
        outcome = _run_units(run, source, study, t0, budget, runner, outcome.lengths, on_done=source.done)
    if loop.stop_note:
        print(f"search: {loop.stop_note}")
    if outcome.stop_note and (max_minutes and (not spec.minutes or max_minutes <= spec.minutes)):
        return outcome  # the run's own budget is spent: --resume goes on with the search
    top = loop.top(spec.top_k)
    units = [u for u in todo if u.block > cs.TRIAL_BLOCK] or cs.confirmation_units(run, study, top)
    if not top:
        print("search: no trial met the SLO (or none completed); only vLLM's defaults are confirmed")
    if units:
        print(f"confirmation: {', '.join(top) or 'no trial'} and {cs.DEFAULTS_POINT}, "
              f"{spec.confirm_starts} fresh server start(s) each, in shuffled blocks")
    return _run_units(run, units, study, t0, max_minutes, runner, outcome.lengths) if units else outcome


def _predicted(run: RunFolder, study: Study, t0: float, max_minutes: float | None, runner: executors.Executor,
               outcome: SweepOutcome):
    """`predict:` once its seeds are measured: every point predicted (predict/study.py),
    then a first start of the top configs and the baseline; then, pass by pass, the grid
    predicted again and a first start of its new top. The model is refitted after each of
    those starts, and (the on_done returned) after each confirmation start."""
    from .predict import study as predicted
    on_ray = runner.kind == "ray"   # the cluster's cores, as its starts are

    def refit(unit, summary):
        v = predicted.refit(run, study)
        if v:
            tqdm.write(f"  predict: model refitted on {v.steps} steps of {len(v.starts)} start(s)")
    while not outcome.stop_note and (n := predicted.next_pass(run, study)) is not None:
        print(f"predict: pass {n} of {study.predict.passes}: fitting the step model on "
              + ("the seeds' steps" if n == 1 else "every measured start's steps")
              + f"; predicting {len(run.manifest().points)} points "
              + ("as Ray tasks" if on_ray else f"on {study.predict.processes} process(es)"))
        t = time.monotonic()
        try:
            units = predicted.plan_confirmation(run, study, on_ray=on_ray)
        except ValueError as e:   # e.g. no seed start completed: nothing to fit; the seeds' records stay
            return SweepOutcome(run, 0, f"predict: not run: {e}", outcome.lengths), None
        pred = predicted.read(run.path)
        print(f"predict: {sum(p.predicted for p in pred.points)} of {len(pred.points)} points predicted in "
              f"{time.monotonic() - t:.0f} s (model: {pred.model.steps} steps of {pred.model.rounds} round(s)); "
              f"end-to-end error so far {_pct(pred.error.widen)}; its choice {', '.join(pred.chosen)}"
              + (f"; new real starts for {', '.join(u.point for u in units)}" if units else
                 "; every one of them measured already"))
        if n == 1:
            for p in pred.points:
                if not p.predicted:
                    print(f"  {p.point}: {p.verdict}")
        if not units:
            break
        outcome = _run_units(run, units, study, t0, max_minutes, runner, outcome.lengths, on_done=refit)
    return outcome, refit


def _pct(x: float | None) -> str:
    return "not measured" if x is None else f"+-{x:.0%}"


def _run_units(run: RunFolder, todo, study: Study, t0: float, max_minutes: float | None,
               runner: executors.Executor, lengths: executors.UnitLengths | None = None, on_done=None) -> SweepOutcome:
    """Run `todo` (a list of units, or a search's TrialSource) on the runner's slots;
    on_done(unit, summary) is told each unit's result as it ends."""
    # miniters=1: redraw on every round (tqdm's adaptive miniters would otherwise wait for
    # several rounds after a fast first one, and the bar would sit still for minutes).
    # a start that serves several points (live knobs) runs the rounds of each
    served = sum(len(u.points) for u in todo) if isinstance(todo, list) else len(todo)
    with tqdm(total=served * study.steps_per_start, unit="round", dynamic_ncols=True, miniters=1) as bar:
        lock = threading.Lock()
        failed = []

        def work(u: Unit, slot, release):
            if not runner.rounds_live:  # elsewhere the start's watcher names it once it measures
                with lock:
                    bar.set_description(u.label)
            s = runner(u, slot, bar, release)
            if on_done:
                on_done(u, s)
            recs = {p: run.point(p).start(u.start) for p in u.points}
            with lock:
                # the watcher counted the rounds that landed here; a Ray task's arrive at once
                on_disk = sum(len(read_rounds(run.point(p).start_dir(u.start) / ROUNDS)) for p in u.points)
                if not runner.rounds_live:
                    bar.update(on_disk)
                # rounds that never ran (a capacity search that stopped short of max_steps, a failed
                # start) leave the total: the bar counts the rounds measured, and still ends at 100%
                bar.total -= max(0, study.steps_per_start * len(u.points) - on_disk)
                bar.refresh()
                for p in u.points:
                    for flag in model_flags(run.point(p).start_dir(u.start) / ROUNDS):
                        tqdm.write(f"  {p} start {u.start}: {flag}")
                bad = {p: rec for p, rec in recs.items() if rec is not None and rec.status == "failed"}
                for p, rec in bad.items():
                    tqdm.write(f"  {p} start {u.start}: FAILED: {rec.reason}")
                if not bad and s.status == "failed":
                    tqdm.write(f"  {u.point}: FAILED: {'; '.join(s.reasons)}")
                if bad or s.status == "failed":
                    # its rounds that never ran left the total; the postfix says how many starts failed
                    failed.append(u)
                    bar.set_postfix_str(f"{len(failed)} of {len(todo)} starts FAILED", refresh=True)

        left, lengths = executors.Dispatcher(runner.slots, work, t0, max_minutes, lengths).run(todo)
    if left:
        elapsed = time.monotonic() - t0
        note = (f"stopped after {elapsed / 60:.1f} of {max_minutes:g} minutes: the next server start would not fit "
                f"(the longest on a free slot so far took {lengths.free / 60:.1f} min, the longest queued "
                f"behind another {lengths.behind / 60:.1f} min, the run's longest recorded before "
                f"{lengths.before / 60:.1f} min); {left} of {len(todo)} starts left")
        return SweepOutcome(run, left, note, lengths)
    return SweepOutcome(run, 0, lengths=lengths)


def model_flags(rounds_path: Path) -> list[str]:
    """A trace start's rounds whose measured prefix-cache hit rate departs from the cache
    model's by more than primer.MODEL_TOLERANCE, in words."""
    out = []
    for r in read_rounds(rounds_path):
        flag = model_departure(r.metrics, f"round {r.round + 1}" + (f" (window {r.window})" if r.window else ""))
        if flag:
            out.append(flag)
    return out


def record_overlaps(run: RunFolder, executor: str) -> None:
    """Which server starts ran at the same time, where (host, GPUs): the manifest keeps it,
    so a neighbour's effect on a point can be looked for in the data. A start's span is
    its server's life on the GPU where recorded (a slot's next start prepares, and a
    server started ahead imports, while the previous one finishes: that is no overlap),
    else its notebook's."""
    spans = []
    for pid in run.point_ids():
        for s in run.point(pid).starts():
            if s.served_by:  # measured on another point's start: that one's span is the server's
                continue
            t = s.timeline
            if "spawn" in t and "stopped" in t:
                spans.append((s, dt.datetime.fromtimestamp(on_gpu(t), dt.timezone.utc),
                              dt.datetime.fromtimestamp(t["stopped"], dt.timezone.utc)))
            elif s.started_utc and s.finished_utc and s.started_utc[0].isdigit():
                spans.append((s, dt.datetime.fromisoformat(s.started_utc), dt.datetime.fromisoformat(s.finished_utc)))
    overlaps = []
    for i, (a, a0, a1) in enumerate(spans):
        for b, b0, b1 in spans[i + 1:]:
            seconds = (min(a1, b1) - max(a0, b0)).total_seconds()
            if seconds > 0:
                overlaps.append({"a": f"{a.point}#s{a.start}", "b": f"{b.point}#s{b.start}", "seconds": seconds,
                                 "hosts": sorted({a.host, b.host}),
                                 "gpus": [[g.index for g in a.gpus], [g.index for g in b.gpus]]})
    m = run.manifest()
    m.executor, m.overlaps = executor, overlaps
    m.save(run.manifest_path)


def more_starts(run: RunFolder, study: Study) -> list[Unit]:
    """One more block for the points whose interval of `precision.metric` is wider than
    asked and that have fewer than `precision.max_starts` starts; appended to the
    manifest's order (so --resume runs it too). Empty when every point is precise
    enough or at its cap. A start that serves several points (live knobs) comes again
    whole where any of its points is wide: each point's starts stay of one kind, and the
    points of a group stay compared within each start."""
    prec = study.precision
    manifest = run.manifest()
    iv = point_intervals(run.rounds_table(), [prec.metric])
    starts: dict[str, int] = {}       # every point a start served: its last start's number
    group: dict[str, tuple] = {}      # and the points of the first start that served it (lead first)
    for u in manifest.order:
        for p in u.points:
            starts[p] = max(starts.get(p, 0), u.start)
            group.setdefault(p, tuple(u.points))
    wide = [row.point for row in iv.itertuples() if relative_width(row) > prec.relative_width]
    last = {g: max(starts.get(p, 0) for p in g) for g in dict.fromkeys(group.get(p, (p,)) for p in wide)}
    groups = [g for g, n in last.items() if n < prec.max_starts]
    if not groups:
        return []
    block = max(u.block for u in manifest.order) + 1
    random.Random(f"{study.order_seed}/{block}").shuffle(groups)
    extra = [Unit(point=g[0], start=last[g] + 1, block=block, serves=list(g) if len(g) > 1 else []) for g in groups]
    manifest.order += extra
    manifest.save(run.manifest_path)
    return extra


def confirm_until_resolved(run: RunFolder, study: Study, outcome: SweepOutcome, run_block) -> SweepOutcome:
    """`confirm:` after the planned starts: judge the run, append one shuffled block of the
    best, the runner-up and the baseline (analysis.confirmation.next_block), run it with
    run_block(units, outcome), and judge again, until resolved or stopped. Each verdict and
    the reason it stopped go to confirm.json. A block is appended only once every unit in
    the manifest has run, so --resume finishes an appended block before judging again."""
    rec = confirmation.read(run.path)
    if outcome.stop_note and rec is None:   # the planned starts are not done: no confirmation yet
        return outcome
    order = run.manifest().order
    rec = rec or confirmation.ConfirmRecord(planned_blocks=max(u.block for u in order))
    while True:
        order = run.manifest().order
        last = max(u.block for u in order)
        if outcome.stop_note:
            rec.stop = f"{confirmation.BUDGET}: {outcome.stop_note}"
            break
        bad = [f"{p}#s{u.start}" for u in order if u.block == last > rec.planned_blocks for p in u.points
               if (s := run.point(p).start(u.start)) is not None and s.status == "failed"]
        if bad:
            rec.stop = f"{confirmation.FAILED}: {', '.join(bad)} (--resume --retry-failed starts it again)"
            break
        v = confirming.block_verdict(run, study, last)
        rec.record(v)
        over = [(v.baseline, v.over_baseline)] + ([(v.runner_up, v.over_runner_up)] if v.runner_up != v.baseline
                                                    else [])   # the runner-up is the baseline: said once
        if v.best_below:   # ranked by their bounds, but none has a capacity to call best
            print("confirm: no best: every point's capacity is below its lowest load")
        else:
            print(f"confirm: best {v.best}; " + "; ".join(f"over {p} {words}" for p, words in over)
                  + (f"; its interval +-{v.best_half_width:.0%}" if v.best_half_width is not None else ""))
        step = confirming.next_block(run, study, v)
        if isinstance(step, str):
            rec.stop = step
            break
        rec.stop = None
        rec.save(run)
        print(f"confirm: block {step[0].block}: {', '.join(f'{u.point}#s{u.start}' for u in step)}")
        outcome = run_block(step, outcome)
    rec.save(run)
    print(f"confirm: stopped: {rec.stop}")
    return outcome


def report_folder(run: RunFolder, overwrite: bool = False) -> RunFolder:
    """Where `report` renders: the run itself, unless git tracks its report (a committed
    run) and overwrite is not asked; then a copy in the system temp folder, so that
    re-rendering (summary.csv, the notebook's timestamps, figures) leaves the checkout
    clean and later runs are not stamped with uncommitted changes."""
    if overwrite or git_output("ls-files", "--error-unmatch", "report.ipynb", cwd=run.path) is None:
        return run
    # under its parent's name too, so the report names the run as it is named where it is committed
    copy = Path(tempfile.mkdtemp(prefix="vllm-study-report-")) / run.path.resolve().parent.name / run.path.name
    shutil.copytree(run.path, copy)
    print(f"{run.path} is committed (git tracks its report): rendering into {copy}; "
          "`report --overwrite` renders into the run itself", file=sys.stderr)
    return RunFolder(copy)


@contextlib.contextmanager
def _kernel_chatter_held():
    """The report's kernel writes to this process's stderr (fd 2) itself: ipykernel's
    "Kernel is running over TCP without encryption" on every run, and its KeyboardInterrupt
    notice at shutdown. They say nothing about the study; hold them back, and print them
    only where the report failed. An fd-level redirect: the kernel is another process."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            yield
        except BaseException:
            os.dup2(saved, 2)
            held.seek(0)
            sys.stderr.write(held.read().decode(errors="replace"))
            raise
        finally:
            os.dup2(saved, 2)
            os.close(saved)


def render_report(run: RunFolder, slo: str = "") -> Path:
    """summary.csv, report.ipynb and report.html; `slo` replaces the study's SLO for
    the report (e.g. to ask a finished study a new question)."""
    point_capacity.write_summary_csv(run)
    out = run.path / "report.ipynb"
    with _kernel_chatter_held():
        pm.execute_notebook(str(notebook("report.ipynb")), str(out), parameters={"run_dir": ".", "slo": slo},
                            cwd=str(run.path), progress_bar=False, kernel_name="python3")
    export_html(run)
    return out


def predict_plan(study: Study, engine: str, points: list[Point], gpu: str, priming: float,
                 grid_minutes: float) -> list[str]:
    """--dry-run's lines for `predict:`: the real starts it takes (its seeds, then a first
    start of the top configs and the baseline, then confirmation's blocks) in GPU-minutes,
    against the whole grid's."""
    seeds = predicted_seeds(study, points)
    spec = study.predict
    first = len(seeds) * study.replicates + spec.confirm_top + (study.baseline not in {p.id for p in seeds})
    # each later pass measures at most its new top; confirmation then adds blocks of up to 3 points
    most = first + spec.confirm_top * (spec.passes - 1) + 3 * (study.confirm.max_starts - 1)
    gpus = study.engine_args.tensor_parallel_size or 1
    each = estimate_minutes(study, engine, 1, gpu, None, priming)
    unit = "GPU-minutes" if engine == "gpu" else "server-minutes (the CPU engine: no GPU)"
    return [f"predict: {len(seeds)} seed point(s) measured ({', '.join(p.id for p in seeds)}), every one of the "
            f"{len(points)} points predicted on {study.predict.processes} process(es) (seconds of CPU a point: "
            f"results/predict-space/20261207-cpu), then the top {spec.confirm_top} and {study.baseline} "
            "measured" + (f", the grid predicted again after them with the model refitted ({spec.passes} passes in "
                          "all), each pass's new top measured" if spec.passes > 1 else ""),
            f"predict: {first} to {most} real starts (later passes and confirmation until resolved may add up to "
            f"{most - first}): about {first * each * gpus:.0f} to {most * each * gpus:.0f} {unit}, against "
            f"{grid_minutes * gpus:.0f} for the whole grid measured once"]


# More tokens than a chat template's own frame (Qwen2.5's is 19, with its default system
# prompt): a trace whose prompts are all this long cannot have one under the floor, and
# the dry run skips reading the tokenizer.
FRAME_BOUND = 256


def _shortest_prompt(study: Study) -> int:
    from .define.traces import read_trace, read_whole
    spec = study.workload.trace  # (windows: the whole trace's, which holds every window's)
    return min((r.input_tokens for r in (read_whole(spec) if spec.windows else read_trace(spec)).requests
                if r.prompt is None),
               default=FRAME_BOUND)


def dry_run(params_files: list[str], engine: str | None = None) -> list[Point]:
    study = load_study(*params_files)
    engine = study_engine(study, engine)
    points = expand(study, engine)
    lines = windows_statements(study, points)  # (before the estimate: it reads the first window)
    gpus = describe().gpus
    groups, _ = live_groups(study, engine, points) if not study.search else ([[p] for p in points], None)
    gpu = gpus[0].name if gpus else "NVIDIA H100"
    history = None
    if study.workload.kind == "trace" and study.workload.trace.prime == "history":
        from .workload import windows
        history = windows.history_tokens(study.workload.trace, study.workload.seed)
    primed = [priming_s(study, p.engine_args, engine, gpu, gpus[0].memory_total_bytes if gpus else None, history)
              for p in points]
    priming = sum(primed) / len(primed) if primed else 0.0
    minutes = estimate_minutes(study, engine, len(points), gpu, len(groups), priming)
    print(f"study {study.name}: {plan_label(study, points)} x {rounds_label(study)}, "
          f"engine {engine}; roughly {minutes:.0f} min (a rough model: lib/vllm_study/define/timing.py)")
    if priming:
        kv = ("the KV size from kv_cache_memory_bytes" if engine != "gpu" else f"the KV size modelled on its {gpu}"
              if gpus else f"the KV size modelled on an {gpu}: this machine has no GPU")
        print(f"  of which priming: about {max(primed):.0f} s before each round of a point with prefix caching "
              f"({sum(1 for x in primed if x)} of {len(points)} points): its KV cache's size prefilled, or its "
              f"window's history where that holds less ({kv})")
    if study.server.command and not study.targets:
        print(f"  served by `{shlex.join(study.server.command)}` (server.command), not vLLM: no figure will be vLLM's")
    if study.search:
        print(f"  space: {search_space_label(study)}; objective {study.search.objective}")
    if study.predict:
        for line in predict_plan(study, engine, points, gpu, priming, minutes):
            print(f"  {line}")
    if study.confirm:
        print(f"  {study.confirm_plan}")
    if study.search:
        print(f"  {live_label(study, engine, points)}")
    if not study.search and not study.targets:
        print(live_label(study, engine, points))
        if any(len(g) > 1 for g in groups):
            for i, g in enumerate(groups, 1):
                print(f"  start {i} launches as {g[0].id}" + (f" and serves: {', '.join(p.id for p in g)}"
                                                             if len(g) > 1 else ""))
    for p in points:
        # the point's own args, then server.extra_cli_args (every start's), as the launch gives them
        print(f"\n{p.id}\n  vllm args: {shlex.join(p.engine_args.cli() + list(study.server.extra_cli_args))}")
        if p.prefix_budget:
            print(f"  scheduler: Prefix Reuse Budget, min_reuse_ratio {p.prefix_budget.min_reuse_ratio:g}, "
                  f"max_defer_ms {p.prefix_budget.max_defer_ms:g}")
        if p.effective:
            print(f"  effective: {p.effective.model_dump(exclude_none=True)}")
        for w in p.warnings:
            print(f"  warning: {w}")
    if lines:
        print("\ntrace windows:\n" + "\n".join(f"  {line}" for line in lines))
    if study.workload.kind == "trace" and not study.targets and _shortest_prompt(study) < FRAME_BOUND:
        # a prompt may be under the chat template's floor: its tokenizer is read (seconds), and
        # what it finds is said here as the sweep will say it (the sweep refuses a FAIL)
        for f in doctor.model_findings(study):
            if f.status != doctor.OK:
                print(f"\n{f}")
    # the targets are asked (about a second) as the sweep will ask them; the model is not loaded here
    found = doctor.target_findings(study)
    if found:
        print("\ntargets:")
        for f in found:
            print(f)
    _refuse([f for f in found if f.status == doctor.FAIL])
    return points
