"""The results layout (DESIGN.md section 5) and what is written at run level:

    results/<UTC>-<study>-<sha7>/
      manifest.json   study.yaml   summary.csv   report.ipynb   figures/*.png
      points/<point id>/  point.ipynb  server.log  rounds.jsonl  requests.jsonl.gz  summary.json
"""
from __future__ import annotations

import datetime as dt
import importlib.metadata
import json
import os
import platform
import subprocess
from pathlib import Path

import pandas as pd
import yaml

from . import __version__
from .counters import NvmlProbe
from .params import Study

POINTS, MANIFEST = "points", "manifest.json"


def _git(*args: str, cwd: Path) -> str | None:
    try:
        return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def git_state(repo: Path) -> dict:
    sha = _git("rev-parse", "HEAD", cwd=repo)
    if sha is None and os.environ.get("VLLM_STUDY_GIT_SHA"):
        # A copy of the checkout without its history (a lent GPU machine): the caller
        # says which commit it is.
        return {"sha": os.environ["VLLM_STUDY_GIT_SHA"], "dirty": None, "source": "VLLM_STUDY_GIT_SHA"}
    dirty = _git("status", "--porcelain", "--untracked-files=no", cwd=repo)
    return {"sha": sha, "dirty": bool(dirty) if dirty is not None and sha else None}


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def versions() -> dict:
    from .server import vllm_distribution
    dist = vllm_distribution()
    return {"vllm_distribution": dist, "vllm": _version(dist) if dist else None,
            "torch": _version("torch"), "vllm_study": __version__,
            "python": platform.python_version()}


def new_run_dir(results: Path, study: Study, repo: Path) -> Path:
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    sha = (git_state(repo)["sha"] or "nogit")[:7]
    run = Path(results) / f"{stamp}-{study.name}-{sha}"
    (run / POINTS).mkdir(parents=True)
    return run


def machine(nvml: NvmlProbe | None = None) -> dict:
    """Which machine this is: host name and GPUs (or why there are none). The manifest,
    each resume and each point record it, so a run spread over machines shows it."""
    nvml = nvml or NvmlProbe()
    return {"host": platform.node(), "gpu": nvml.describe() or nvml.why}


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


def _save_manifest(run: Path, manifest: dict) -> None:
    (run / MANIFEST).write_text(json.dumps(manifest, indent=2))


def write_manifest(run: Path, study: Study, engine: str, points, repo: Path) -> None:
    _save_manifest(run, {
        "study": study.name, "created_utc": _now(),
        "git": git_state(repo), "versions": versions(), "engine": engine, **machine(),
        "cpu": {"machine": platform.machine(), "cores": os.cpu_count()},
        "points": [p.id for p in points],
        "warnings": {p.id: p.warnings for p in points if p.warnings},
        "params": study.model_dump(mode="json"),
    })
    # The exact study the points ran, as YAML: `--resume` and the notebooks read it.
    (run / "study.yaml").write_text(yaml.safe_dump(study.model_dump(mode="json"), sort_keys=False))


def read_manifest(run: Path) -> dict | None:
    f = Path(run) / MANIFEST
    return json.loads(f.read_text()) if f.exists() else None


def record_resume(run: Path, repo: Path, point_ids: list[str]) -> None:
    """A resumed run may span days, commits and machines: each resume appends which
    code and versions ran which points, so the manifest never claims one commit for all."""
    manifest = read_manifest(run) or {}
    manifest.setdefault("resumes", []).append({
        "utc": _now(), "git": git_state(repo), "versions": versions(), **machine(),
        "points_left": point_ids})
    _save_manifest(run, manifest)


def read_point(point_dir: Path) -> dict | None:
    f = point_dir / "summary.json"
    return json.loads(f.read_text()) if f.exists() else None


def read_rounds(point_dir: Path) -> list[dict]:
    f = point_dir / "rounds.jsonl"
    return [json.loads(line) for line in f.read_text().splitlines() if line.strip()] if f.exists() else []


def summary_table(run: Path) -> pd.DataFrame:
    """One row per point x round, then one 'median' row per point (status and reason
    on every row, so a failed point with no rounds still has its line)."""
    rows = []
    order = (read_manifest(run) or {}).get("points", [])
    dirs = [d for d in (Path(run) / POINTS).iterdir() if d.is_dir()]
    # grid order (as the manifest lists the points), not the alphabetical order of ids
    dirs.sort(key=lambda d: (order.index(d.name) if d.name in order else len(order), d.name))
    for pdir in dirs:
        s = read_point(pdir)
        if s is None:
            continue
        base = {"point": s["point"], **s["values"], "status": s["status"], "reason": s["reason"],
                "startup_s": s.get("startup_s"),
                "effective_max_num_seqs": s.get("effective", {}).get("max_num_seqs"),
                # what a cache that never evicts would hit (shared_prefix workloads)
                "expected_prefix_hit_rate": (s.get("workload") or {}).get("expected_prefix_hit_rate")}
        for r in read_rounds(pdir):
            rows.append({**base, **{k: v for k, v in r.items() if k not in ("errors", "status")},
                         "round": str(r["round"]), "round_status": r.get("status")})
        med = {k: v for k, v in (s.get("medians") or {}).items() if "__" not in k}
        rows.append({**base, **med, "round": "median"})
    return pd.DataFrame(rows)


def write_summary_csv(run: Path) -> pd.DataFrame:
    df = summary_table(run)
    df.to_csv(Path(run) / "summary.csv", index=False)
    return df
