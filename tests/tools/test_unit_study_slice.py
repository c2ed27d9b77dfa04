"""tools/study_slice.py --wait: a slice longer than one job runs in the background, each
call waits for it at most --wait seconds and packs what the runs folder holds; a call
while it runs waits on it instead of starting another."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import tarfile
from pathlib import Path
from paths import REPO

TOOL = REPO / "tools" / "study_slice.py"
STUDY = REPO / "params" / "default.yaml"


def _slice(runs: Path, pack: Path, *more: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": f"{REPO / 'lib'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    return subprocess.run([sys.executable, str(TOOL), str(STUDY), "--runs", str(runs), "--pack", str(pack),
                           "--carried", str(runs / "none"), *more],
                          capture_output=True, text=True, env=env, timeout=120)


def test_a_detached_slice_that_ends_in_time_is_waited_for_and_packed(tmp_path):
    runs, pack = tmp_path / "runs", tmp_path / "runs.tar.gz"
    # 0 minutes: the slice starts no server and ends at once (its decision is in its log)
    p = _slice(runs, pack, "--minutes", "0", "--wait", "60")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "started the slice in the background" in p.stdout
    assert "the next server start waits for the next slice" in p.stdout   # the log's tail, shown
    assert f"packed {runs} into {pack}" in p.stdout
    with tarfile.open(pack) as tar:
        assert tar.getnames()[0] == "runs"


def test_a_call_while_the_slice_runs_waits_on_it_and_says_it_still_runs(tmp_path):
    runs, pack = tmp_path / "runs", tmp_path / "runs.tar.gz"
    runs.mkdir()
    (runs / "kept.txt").write_text("measured")
    # a running slice: a process whose command line names the tool
    slow = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "study_slice"],
                            start_new_session=True)
    try:
        Path(f"{runs}.slice.pid").write_text(str(slow.pid))
        p = _slice(runs, pack, "--minutes", "16", "--wait", "1")
        assert p.returncode == 3, p.stdout + p.stderr
        assert f"waiting on the slice already running (pid {slow.pid}" in p.stdout
        assert "the same command again waits for it" in p.stdout
        assert slow.poll() is None   # not started twice, not stopped
        with tarfile.open(pack) as tar:
            assert "runs/kept.txt" in tar.getnames()
    finally:
        os.killpg(slow.pid, signal.SIGTERM)
        slow.wait()


def test_finding_the_run_names_the_runs_it_passed_over_only_when_it_takes_none(tmp_path, capsys):
    """A GPU snapshot carries every committed run: the one to continue is named, the rest
    are named only where none was taken (then they say why the study starts anew)."""
    import importlib.util

    from synthetic_run import make_run
    sys.path.insert(0, str(TOOL.parent))   # as when it runs as a script: it imports tools/detach.py
    spec = importlib.util.spec_from_file_location("study_slice", TOOL)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    runs = tmp_path / "runs"
    ours = make_run(runs, {"mbt=256": {"ttft_p90_ms": 100.0}})
    name = ours.manifest().study
    make_run(runs, {"mbt=256": {"ttft_p90_ms": 100.0}}, study_over={"name": "another-study"})
    assert tool.find_run(runs, name, say=True) == ours.path
    assert capsys.readouterr().out == ""
    assert tool.find_run(runs, "a-third-study", say=True) is None
    out = capsys.readouterr().out
    assert "a run of another-study, not of a-third-study" in out and f"a run of {name}, not of" in out
    assert "no run of a-third-study under" in out
