"""The few calls the notebooks make, so each notebook cell stays one or two lines.

Functions that draw return None (and show the figure) so cells emit no stray
`<Figure ...>`/`<Axes ...>` text: nbval compares text outputs, and a trailing `;`
no longer hides them (nbval issue 194).
"""
from __future__ import annotations

import json
import tempfile
import warnings
from pathlib import Path

import matplotlib.pyplot as plt
import pandas as pd
from tqdm import TqdmWarning

# transformers imports tqdm.auto, which warns (with this machine's paths) that
# ipywidgets is missing; the text progress bar is what the kit wants anyway.
warnings.filterwarnings("ignore", category=TqdmWarning)

from . import plots, report, runfolder
from .params import load_study
from .point import PointRun  # noqa: F401  (re-exported for the point notebook)
from .sweep import resolve_engine

pd.set_option("display.width", 200)
pd.set_option("display.max_columns", 40)

RESULTS = Path(__file__).resolve().parents[2] / "results"


# -- point notebook ----------------------------------------------------------
def select_point(study_file: str, point_id: str, point_dir: str, engine: str):
    from .params import expand
    study = load_study(study_file)
    engine = resolve_engine(engine)
    points = expand(study, engine)
    by_id = {p.id: p for p in points}
    if point_id and point_id not in by_id:
        raise ValueError(f"point_id {point_id!r} is not in the grid of {study_file}; "
                         f"its points are: {', '.join(by_id)}")
    point = by_id[point_id] if point_id else points[0]
    if not point_dir:
        scratch = RESULTS / "scratch"
        scratch.mkdir(parents=True, exist_ok=True)
        point_dir = tempfile.mkdtemp(prefix=f"{point.id}-", dir=scratch)
    return study, point, engine, Path(point_dir)


def describe_point(study, point, engine, point_dir) -> None:
    print(f"study {study.name}, point {point.id}, engine {engine}")
    print("vllm args:", " ".join(point.engine_args.cli()))
    print("effective (where vLLM decides):", point.effective)
    for w in point.warnings:
        print("warning:", w)


def show_launch(run: PointRun) -> None:
    s = run.summary
    if run.failed:
        print(f"FAILED: {s['reason']}")
        return
    print(f"ready in {s['startup_s']:.1f} s at {run.server.url}")
    print("cache config:", s["effective"].get("cache_config"))


def round_progress(total: int):
    from tqdm import tqdm
    bar = tqdm(total=total, unit="round")
    return lambda i: bar.update(1) or (bar.close() if i == total - 1 else None)


_ROUND_COLS = ["round", "status", "completed", "failed", "ttft_p50_ms", "ttft_p90_ms", "itl_p90_ms",
               "tpot_p50_ms", "output_throughput", "prefix_cache_hit_rate", "engine_steps",
               "preemptions", "kv_usage_peak"]


def rounds_table(run: PointRun) -> pd.DataFrame:
    if not run.rounds:
        return pd.DataFrame({"status": [run.summary["status"]], "reason": [run.summary["reason"]]})
    df = pd.DataFrame(run.rounds)
    return df[[c for c in _ROUND_COLS if c in df.columns]].round(3)


def summary_table(summary: dict) -> pd.DataFrame:
    med = {k: v for k, v in (summary.get("medians") or {}).items() if "__" not in k}
    head = {"status": summary["status"], "reason": summary["reason"], "startup_s": summary.get("startup_s")}
    return pd.Series({**head, **med}, name=summary["point"]).to_frame()


# -- report notebook ---------------------------------------------------------
def resolve_run(run_dir: str) -> Path:
    if run_dir:
        return Path(run_dir)
    runs = sorted(RESULTS.glob(f"*/{runfolder.MANIFEST}"))
    if not runs:
        raise FileNotFoundError(f"no run folder under {RESULTS}; run a sweep first "
                                "(make study) or set run_dir")
    return max(runs, key=lambda p: p.parent.name).parent


def load_run(run: Path):
    return report.load_manifest(run), report.load_summary(run)


def describe_run(m: dict) -> None:
    v = m["versions"]
    print(f"study {m['study']} created {m['created_utc']}  git {str(m['git']['sha'])[:12]}"
          f"{' (dirty)' if m['git']['dirty'] else ''}")
    print(f"engine {m['engine']}: {v['vllm_distribution']} {v['vllm']}, torch {v['torch']}, "
          f"python {v['python']}, kit {v['vllm_study']}")
    gpu = m["gpu"]
    print("GPU:", ", ".join(f"{g['name']} {g['memory_total_bytes'] / 2**30:.0f} GiB driver {g['driver']}"
                            for g in gpu) if isinstance(gpu, list) else gpu)
    p = m["params"]
    w = p["workload"]
    print(f"grid: {json.dumps(p['grid'])}  x {p['rounds']} rounds")
    print(f"workload: {w['kind']} via {w['api']}, {w['system_prompt_tokens']}-token shared prefix "
          f"+ {w['question_tokens']}-token question, {w['output_tokens']} output tokens, "
          f"concurrency {w['concurrency']}, {w['requests_per_round']} requests/round")
    print("fixed engine args:", json.dumps(p["engine_args"], sort_keys=True))


def headline_table(df, manifest) -> pd.DataFrame:
    return report.headline_table(df, manifest)


def target_comparison(df, manifest) -> pd.DataFrame | None:
    """Endpoint studies: each target's medians and what it adds over the first target
    (e.g. the same vLLM behind a gateway vs its port directly)."""
    return report.target_comparison(df, manifest)


def group_table(df) -> pd.DataFrame | None:
    return report.group_table(df)


def failures(df) -> pd.DataFrame:
    f = report.failures(df)
    return f if len(f) else pd.DataFrame({"reason": ["(none: every point completed)"]}, index=["-"])


HEATMAPS = {
    "ttft_p90_ms": ("TTFT P90 (ms)", ".0f"), "itl_p90_ms": ("ITL P90 (ms)", ".1f"),
    "tpot_p50_ms": ("TPOT P50 (ms)", ".1f"), "output_throughput": ("output tokens/s", ".0f"),
    "prefix_cache_hit_rate": ("prefix-cache hit rate", ".2f"), "engine_steps": ("engine steps / round", ".0f"),
    "kv_usage_peak": ("KV usage peak", ".1%"), "preemptions": ("preemptions / round", ".0f"),
    "gpu_mem_peak_frac": ("GPU memory peak (share)", ".2f"),
}


def _xy(manifest):
    axes = report.axes(manifest) or [None]
    return axes[0], (axes[1] if len(axes) > 1 else None)


def _figdir(run: Path) -> Path:
    d = Path(run) / "figures"
    d.mkdir(exist_ok=True)
    return d


def draw_heatmaps(run, df, manifest) -> None:
    x, y = _xy(manifest)
    med = report.medians(df)
    if y is None:  # a one-axis study has no heatmap; its trend lines say it all
        print("no second grid axis: no heatmap" + ("; see the trend lines below" if x else ""))
        return
    plots.heatmap_grid(med, HEATMAPS, x, y, out=_figdir(run) / "heatmaps.png")
    plt.show()


def draw_trends(run, df, manifest) -> None:
    x, y = _xy(manifest)
    if x is None:
        print("an endpoint study has no grid axis: see the target comparison above")
        return
    plots.trend_vs_axis(report.medians(df), {"ttft_p90_ms": "TTFT P90 (ms)", "itl_p90_ms": "ITL P90 (ms)",
                                             "output_throughput": "output tokens/s"},
                        x, y, out=_figdir(run) / "trends.png")
    plt.show()


def draw_round_trend(run, df) -> None:
    plots.round_trend(report.rounds(df), out=_figdir(run) / "ttft_p90_by_round.png")
    plt.show()
