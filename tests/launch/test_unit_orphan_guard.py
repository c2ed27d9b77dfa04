"""orphan_guard on a fake Ray worker: a process that starts the guard, then a tree shaped
like a start's (a "papermill" in its own session, a "kernel" in another, a "server" in a
third whose group id is in a pgid file, as VllmServer writes it). Killed, the worker's
tree is stopped and its scratch folder removed; a worker that ends its task normally
leaves both alone; one whose task raised has the guard stop what is left."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

# each process starts the next in a session of its own (start_new_session), as
# run_unit, jupyter_client and VllmServer do; the last one records its group id
SERVER = "import time; time.sleep(600)"
KERNEL = ("import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', {server!r}], "
          "start_new_session=True); open(sys.argv[1], 'w').write(str(p.pid)); time.sleep(600)")
PAPERMILL = ("import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {kernel!r}, sys.argv[1]], "
             "start_new_session=True); time.sleep(600)")
WORKER = """
import json, subprocess, sys, time
from pathlib import Path
from vllm_study.launch import orphan_guard
scratch = Path(sys.argv[1])
guard = orphan_guard.launch(scratch)
nb = subprocess.Popen([sys.executable, "-c", sys.argv[2], sys.argv[3]], start_new_session=True)
print(json.dumps({"guard": guard.pid, "papermill": nb.pid}), flush=True)
how = sys.stdin.readline().strip()
orphan_guard.release(guard, done=how == "done")
print(json.dumps({"guard_rc": guard.returncode}), flush=True)
time.sleep(600)
"""


def _gone(p: psutil.Process) -> bool:
    try:
        return not p.is_running() or p.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _wait_gone(procs, timeout=15.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(_gone(p) for p in procs):
            return True
        time.sleep(0.1)
    return False


@pytest.fixture
def fake_start(tmp_path):
    """The fake worker, its guard, and the start's three processes once all run."""
    scratch = tmp_path / "vllm-study-x"
    pgid_file = scratch / "points" / "p" / "s1" / "server.pgid"
    pgid_file.parent.mkdir(parents=True)
    papermill = PAPERMILL.format(kernel=KERNEL.format(server=SERVER))
    worker = subprocess.Popen([sys.executable, "-c", WORKER, str(scratch), papermill, str(pgid_file)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    started = [worker]
    try:
        pids = json.loads(worker.stdout.readline())
        deadline = time.monotonic() + 20
        while not pgid_file.exists() or not pgid_file.read_text():
            assert time.monotonic() < deadline, "the fake server never started"
            time.sleep(0.05)
        nb = psutil.Process(pids["papermill"])
        tree = [nb, *nb.children(recursive=True)]
        assert len(tree) == 3 and len({os.getpgid(p.pid) for p in tree}) == 3  # three process groups
        started += tree
        time.sleep(1.5)  # the guard has looked at the tree at least once
        yield scratch, worker, psutil.Process(pids["guard"]), tree
    finally:
        for p in reversed(started):
            try:
                p.kill()
            except (psutil.NoSuchProcess, ProcessLookupError):
                pass
        worker.wait()


def test_a_killed_worker_has_its_tree_stopped_and_its_scratch_removed(fake_start):
    scratch, worker, guard, tree = fake_start
    os.kill(worker.pid, signal.SIGKILL)
    worker.wait()
    assert _wait_gone(tree), [p.pid for p in tree if not _gone(p)]
    assert _wait_gone([guard])
    assert not scratch.exists()


def test_a_worker_that_ends_its_task_leaves_the_tree_and_scratch_alone(fake_start):
    scratch, worker, guard, tree = fake_start
    worker.stdin.write("done\n")
    worker.stdin.flush()
    assert json.loads(worker.stdout.readline()) == {"guard_rc": 0}
    assert not any(_gone(p) for p in tree) and scratch.exists()  # ray_start itself removes the scratch folder


def test_a_task_that_raised_has_the_guard_stop_what_is_left(fake_start):
    scratch, worker, guard, tree = fake_start
    worker.stdin.write("raised\n")
    worker.stdin.flush()
    assert json.loads(worker.stdout.readline()) == {"guard_rc": 0}
    assert _wait_gone(tree) and not scratch.exists()
    assert worker.poll() is None  # the worker itself is not the guard's to stop
