"""A space of configurations predicted on the host's CPU cores: chunk size x max_num_seqs
x prefix caching x long_prefill_token_threshold (150 configurations) of a capacity
study, each one's capacity predicted by vLLM's own scheduler in virtual time
(vllm_study.predict) with a step-time model fitted to a measured run's step records,
in parallel processes (predict/study.py: predict_all). Prints configurations a minute,
the top 3 and what was not predicted (with why); writes space.json into --out.

--confirm then measures the top 3 and vLLM's defaults in real starts: a study of those
four points (baseline: the defaults, confirm until resolved) swept by the kit, its
report setting each prediction beside the measurement. On a loaded two-core machine a
real start takes minutes: give --max-minutes.

    nice -n 5 python benchmarks/predict_space.py \\
        results/predict-vs-measured/20261206-cpu/runs/20261206T213256Z-cpu-predict-vs-measured-6e57094 \\
        --out /tmp/predict-space [--workers 2] [--confirm --max-minutes 20]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "lib"))

from vllm_study.define.grid import PointPlan, expand  # noqa: E402
from vllm_study.define.params import Study  # noqa: E402
from vllm_study.define.study_file import load_study  # noqa: E402
from vllm_study.predict import step_model, study as ps  # noqa: E402
from vllm_study.records.results import RunFolder  # noqa: E402

# within the measured run's fitted range of the kernel settings (max_num_batched_tokens
# 256..4096, max_num_seqs 4..16): the model refuses what lies outside
SPACE = {"max_num_batched_tokens": [256, 512, 1024, 2048, 4096], "max_num_seqs": [4, 6, 8, 12, 16],
         "enable_prefix_caching": [True, False], "long_prefill_token_threshold": [0, 256, 1024]}
AXES = ("max_num_batched_tokens", "max_num_seqs", "enable_prefix_caching", "long_prefill_token_threshold")


def space_study(base: Study, space: dict) -> Study:
    d = base.model_dump(mode="json")
    d["engine_args"] = {k: v for k, v in d["engine_args"].items() if k not in space}
    kv = base.grid.get("kv_cache_memory_bytes") if isinstance(base.grid, dict) else None
    if kv:   # the measured run's one KV pool, fixed
        d["engine_args"]["kv_cache_memory_bytes"] = kv[0]
    d.update(grid=space, baseline=None, confirm=None, predict=None, name=f"{base.name}-space")
    return Study.model_validate(d)


def defaults_values(study: Study) -> dict:
    """vLLM's own values of the space's axes on this engine (a point that sets none of them)."""
    d = study.model_dump(mode="json")
    d["grid"] = [{"long_prefill_token_threshold": 0}]
    (p,) = expand(Study.model_validate(d), "cpu")
    return {"max_num_batched_tokens": p.effective.max_num_batched_tokens, "max_num_seqs": p.effective.max_num_seqs,
            "enable_prefix_caching": True, "long_prefill_token_threshold": 0}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run", type=Path, help="a capacity run folder whose starts recorded their steps")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--workers", type=int, default=os.cpu_count(), help="processes (default: every core)")
    ap.add_argument("--confirm", action="store_true", help="measure the top 3 and vLLM's defaults in real starts")
    ap.add_argument("--max-minutes", type=float, help="with --confirm: the sweep's budget")
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    run = RunFolder(a.run)
    base = load_study(run.study_path)
    study = space_study(base, SPACE)
    plans = [PointPlan(study=study, point=p, engine="cpu") for p in expand(study, "cpu")]
    t0 = time.perf_counter()
    models = step_model.fit_run(run.path)
    todo, refused = ps.tasks(run, models, plans)
    t1 = time.perf_counter()
    done = ps.predict_all(todo, a.workers)
    wall = time.perf_counter() - t1
    points = done + refused
    ranked = ps.rank(points)
    per_min = len(done) / wall * 60
    print(f"{len(plans)} configurations: {len(done)} predicted, {len(refused)} not, in {wall:.0f} s on "
          f"{a.workers} process(es) ({per_min:.0f} configurations a minute; the model fitted in {t1 - t0:.1f} s "
          f"from {sum(m.steps for m in models)} steps of {run.path.name}); one config's simulation "
          f"{min(p.sim_wall_s for p in done):.1f}..{max(p.sim_wall_s for p in done):.1f} s")
    for p in refused[:5]:
        print(f"  not predicted {p.point}: {p.verdict}")
    print(f"predicted capacity over {done[0].over if done else '?'} (no interval: this benchmark measures no "
          "end-to-end error; a predict study's does):")
    for p in ranked[:10]:
        print(f"  {p.rank:3d}. {p.point:55s} {('>= ' if p.censored == 'above' else '') + f'{p.value:.3g}':>8s}")
    top = ranked[:3]
    record = {"run": str(run.path), "configs": len(plans), "predicted": len(done), "not_predicted": len(refused),
              "workers": a.workers, "predict_wall_s": wall, "configs_per_minute": per_min,
              "top": [p.model_dump() for p in top], "points": [p.model_dump() for p in points]}
    (a.out / "space.json").write_text(json.dumps(record, indent=1, default=float))
    print(f"top 3: {', '.join(p.point for p in top)}; written {a.out / 'space.json'}")
    if not a.confirm:
        return 0
    defaults = defaults_values(study)
    grid = [{k: p.values.get(k, defaults[k]) for k in AXES} for p in top]
    grid = [g for g in grid if g != defaults] + [defaults]
    d = study.model_dump(mode="json")
    confirm_study = Study.model_validate({**d, "name": f"{base.name}-space-confirm", "grid": grid,
                                          "confirm": {"until": "resolved", "max_starts": 2}})
    base_id = expand(confirm_study, "cpu")[-1].id
    path = a.out / "confirm.yaml"
    path.write_text(yaml.safe_dump({**confirm_study.model_dump(mode="json"), "baseline": base_id}, sort_keys=False))
    cmd = [sys.executable, "-m", "vllm_study", "sweep", str(path), "--results", str(a.out / "runs")]
    cmd += ["--max-minutes", str(a.max_minutes)] if a.max_minutes else []
    print("+", " ".join(cmd), flush=True)
    return subprocess.run(cmd).returncode


if __name__ == "__main__":
    sys.exit(main())
