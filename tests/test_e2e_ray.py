"""The ray executor on this machine's own Ray (ray.init() starts a local cluster): a
two-point CPU study runs as two Ray tasks, side by side; each task's start folder
comes back into the run folder, and the manifest records that the starts overlapped."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from e2e_support import tiny
from procs import group_gone
from vllm_study.results import RunFolder

pytestmark = pytest.mark.e2e
REPO = Path(__file__).resolve().parents[1]


def test_a_two_point_study_runs_as_ray_tasks(tmp_path):
    study = tiny(grid={"max_num_batched_tokens": [128, 256]}, rounds=1,
                 workload={**tiny()["workload"], "requests_per_round": 4, "warmup_requests": 1})
    params = tmp_path / "study.yaml"
    params.write_text(yaml.safe_dump(study, sort_keys=False))
    r = subprocess.run([sys.executable, "-m", "vllm_study", "sweep", str(params),
                        "--results", str(tmp_path / "results"), "--executor", "ray", "--parallel", "2", "--no-report"],
                       cwd=REPO, capture_output=True, text=True, timeout=1500)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "executor ray: 2 server start(s) at a time" in r.stdout
    (path,) = (tmp_path / "results").iterdir()
    run = RunFolder(path)
    summaries = run.summaries()
    assert [s.status for s in summaries] == ["ok", "ok"], [s.reasons for s in summaries]
    for s in summaries:
        (start,) = run.point(s.point).starts()
        assert start.rounds_ok == 1 and (run.point(s.point).start_dir(1) / "point.ipynb").exists()
        assert group_gone(start.launch.server_pgid)
    m = run.manifest()
    assert m.executor == "ray"
    assert len(m.overlaps) == 1 and m.overlaps[0]["seconds"] > 0  # the two starts ran side by side
