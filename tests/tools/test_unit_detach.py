"""tools/detach.py: a command longer than one job runs in the background; each call waits
on it at most --wait seconds and packs its folders; a call while it runs waits on it, a
call after it ended packs again and runs nothing."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import tarfile
from pathlib import Path
from paths import REPO

TOOL = REPO / "tools" / "detach.py"


def _call(state: Path, wait: str, *cmd: str, pack: Path | None = None, folder: Path | None = None):
    more = ["--pack", str(pack), "--folder", str(folder)] if pack else []
    return subprocess.run([sys.executable, str(TOOL), "--state", str(state), "--wait", wait, *more, "--", *cmd],
                          capture_output=True, text=True, timeout=120)


def test_a_command_that_ends_in_time_is_packed_with_its_status_and_not_run_again(tmp_path):
    out, pack, state = tmp_path / "out", tmp_path / "out.tar.gz", tmp_path / "state" / "job"
    script = (f"import pathlib, sys; p = pathlib.Path({str(out)!r}); p.mkdir(exist_ok=True); "
              "f = p / 'runs.txt'; f.write_text(f.read_text() + 'x' if f.exists() else 'x'); "
              "print('measured'); sys.exit(7)")
    first = _call(state, "60", sys.executable, "-c", script, pack=pack, folder=out)
    assert first.returncode == 0, first.stdout + first.stderr
    assert "started the command in the background" in first.stdout
    assert "measured" in first.stdout                       # the log's tail
    assert "it ended with exit status 7" in first.stdout    # the command's own status
    with tarfile.open(pack) as tar:
        assert "out/runs.txt" in tar.getnames()
    again = _call(state, "60", sys.executable, "-c", script, pack=pack, folder=out)
    assert again.returncode == 0 and "it ended in an earlier call" in again.stdout
    assert (out / "runs.txt").read_text() == "x"            # not run a second time


def test_a_call_while_it_runs_waits_on_it_and_says_it_still_runs(tmp_path):
    state = tmp_path / "job"
    cmd = (sys.executable, "-c", "import time; time.sleep(60)")
    first = _call(state, "1", *cmd)
    pid = int(Path(f"{state}.pid").read_text())
    try:
        assert first.returncode == 3, first.stdout + first.stderr
        assert "the same command again waits for it" in first.stdout
        second = _call(state, "1", *cmd)
        assert second.returncode == 3
        assert f"waiting on the command already running (pid {pid}" in second.stdout
        assert int(Path(f"{state}.pid").read_text()) == pid   # not started twice
    finally:
        os.killpg(pid, signal.SIGTERM)   # its own session: the id it was started with


def test_no_command_is_refused_before_anything_starts(tmp_path):
    p = subprocess.run([sys.executable, str(TOOL), "--state", str(tmp_path / "job"), "--wait", "1"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "no command: give it after --" in p.stderr
    assert not (tmp_path / "job.pid").exists()
