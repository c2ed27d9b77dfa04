"""What the point notebook calls, kept light: the notebook imports only this before
its server starts, so the seconds of plotting and papermill imports (notebook_support)
are not on a server start's critical path. Tables are pandas frames."""
from __future__ import annotations

import tempfile
import warnings
from pathlib import Path

import pandas as pd
from tqdm import TqdmWarning

# transformers imports tqdm.auto, which warns (with this machine's paths) that
# ipywidgets is missing; the text progress bar is what the kit wants anyway.
warnings.filterwarnings("ignore", category=TqdmWarning)

from .define.grid import PointPlan, expand  # noqa: E402
from .define.schema import StudyError  # noqa: E402
from .define.study_file import load_study  # noqa: E402
from .measure.point import PointStart  # noqa: E402
from .measure.live_start import SharedStart  # noqa: E402
from .report.report import estimates_frame  # noqa: E402
from .records.results import PointFolder, PointSummary  # noqa: E402


def display_options() -> None:
    pd.set_option("display.width", 200)
    pd.set_option("display.max_columns", 40)
    pd.set_option("display.max_colwidth", None)  # a failure's reason is one line: show all of it


display_options()


def select_point(point_file: str, study_file: str, point_id: str, out_dir: str, start: int):
    """The sweep passes point_file (its resolved point.json). By hand: a study file and a
    point id, expanded here, into a scratch folder unless out_dir is given."""
    if point_file:
        folder = PointFolder(Path(point_file).parent)
        plan = folder.plan()
    else:
        study = load_study(study_file)
        from .sweep import study_engine  # papermill's import: only by hand
        engine = study_engine(study, None)
        by_id = {p.id: p for p in expand(study, engine)}
        if point_id and point_id not in by_id:
            raise StudyError(f"point_id {point_id!r} is not in the grid of {study_file}; "
                             f"its points are: {', '.join(by_id)}")
        point = by_id[point_id] if point_id else next(iter(by_id.values()))
        plan = PointPlan(study=study, point=point, engine=engine)
        if out_dir:
            folder = PointFolder(Path(out_dir).parent)
        else:
            scratch = Path("results") / "scratch"
            scratch.mkdir(parents=True, exist_ok=True)
            folder = PointFolder(Path(tempfile.mkdtemp(prefix=f"{point.id}-", dir=scratch)))
        folder.save_plan(plan)
    start_dir = Path(out_dir) if out_dir else folder.start_dir(start)
    return plan, start_dir


def gpu_list(gpus: str) -> list[int] | None:
    return [int(g) for g in gpus.split(",")] if gpus else None


def make_start(plan: PointPlan, start_dir: Path, start: int, block: int | None, gpus: list[int] | None,
               slot_lock: str | None, serves: str = "") -> PointStart | SharedStart:
    """This point's start, or, with `serves` (live knobs), the one start that serves those
    points: each measured into its own folder beside this one (points/<id>/s<start>)."""
    ids = [p for p in serves.split(",") if p]
    if len(ids) <= 1:
        return PointStart(plan, start_dir, start, block, gpus, slot_lock)
    if ids[0] != plan.point.id:
        raise StudyError(f"serves must list this point ({plan.point.id}) first: the start launches as it; got {serves}")
    points = Path(start_dir).resolve().parent.parent
    plans = [plan] + [PointFolder(points / pid).plan() for pid in ids[1:]]
    print(f"one server start serves {len(ids)} points, launched as {ids[0]} (their largest limits): "
          + ", ".join(ids))
    return SharedStart(plans, [Path(start_dir)] + [points / pid / Path(start_dir).name for pid in ids[1:]],
                       start, block, gpus, slot_lock)


def planned_rounds(run) -> int:
    """The rounds this start will run: the study's, for each point it serves."""
    return run.planned_rounds


def describe_point(plan: PointPlan, start: int) -> None:
    p = plan.point
    print(f"study {plan.study.name}, point {p.id}, server start {start} of {plan.planned_starts}, "
          f"engine {plan.engine}")
    if p.target:
        print(f"endpoint: {p.target.base_url} serving {p.target.model}")
    else:
        print("vllm args:", " ".join(p.engine_args.cli()))
        print("effective (where vLLM decides):", p.effective.model_dump(exclude_none=True))
    for w in p.warnings:
        print("warning:", w)


def show_launch(run: PointStart) -> None:
    rec = run.record
    if run.failed:
        print(f"FAILED: {rec.reason}")
        return
    launch = rec.launch
    if launch.target:
        print(f"endpoint {launch.target['base_url']} answers; /metrics: "
              f"{'yes' if launch.has_metrics else 'no'}, cache reset: {'yes' if launch.cache_reset else 'no'}")
    else:
        print(f"ready in {launch.startup_s:.1f} s at {run.url}")
    if launch.cache_config:
        print("cache config:", launch.cache_config)
    for w in rec.warnings:
        print("warning:", w)


def round_progress(total: int):
    from tqdm import tqdm
    bar = tqdm(total=total, unit="round")
    return lambda i: bar.update(1) or (bar.close() if i == total - 1 else None)


def _limits_label(limits: dict) -> str:
    return f"mbt={limits['max_num_batched_tokens']} mns={limits['max_num_seqs']}" + (
        f" lpt={limits['long_prefill_token_threshold']}" if limits["long_prefill_token_threshold"] else "")


SHOWN_METRICS = ("ttft_p50_ms", "ttft_p90_ms", "itl_p90_ms", "tpot_p50_ms", "output_throughput",
                 "prefix_cache_hit_rate", "output_steps", "preemptions", "kv_usage_peak")


def rounds_table(run: PointStart) -> pd.DataFrame:
    if not run.rounds:
        return pd.DataFrame({"status": [run.record.status], "reason": [run.record.reason]})
    rows = [{"round": r.round, **({"point": r.point, "limits": _limits_label(r.limits)} if r.limits else {}),
             "status": r.status, "completed": r.metrics["completed"],
             "failed": r.metrics["failed"], **{m: r.metrics.get(m) for m in SHOWN_METRICS}} for r in run.rounds]
    return pd.DataFrame(rows).set_index("round").round(3)


def summary_table(summary: PointSummary) -> pd.DataFrame:
    """The point over all its starts so far: each metric's median, interval and range."""
    print(f"point {summary.point}: {summary.status}, {summary.rounds_ok} of {summary.rounds_planned} rounds "
          f"over {summary.starts_done} of {summary.starts_planned} server start(s)")
    for r in summary.reasons:
        print("  ", r)
    return estimates_frame(summary)
