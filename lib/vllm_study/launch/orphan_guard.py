"""Stops a Ray start's processes when the worker running it dies.

A Ray task (executors.ray_cluster.ray_start) runs papermill, which runs the kernel, which runs the
vLLM server: each in a session of its own (start_new_session), so none of them dies with
the worker. Killed (kill -9, Ray's memory monitor, a crash), the worker runs no cleanup
and would leave the whole tree measuring beside whatever runs next on its GPUs.

The guard is a small process in its own session, started by the task, that outlives the
worker. Its stdin is a pipe whose write end only the worker holds: the task writes "done"
once its start folder is packed (the guard then exits and touches nothing); end of file
without it means the worker is gone, or the task raised. The pipe, not the worker's pid,
is the signal: it needs no polling to notice and cannot be fooled by a reused pid (the
pid is watched too, in case something the worker forked without exec holds the pipe).

While the worker lives, the guard remembers the worker's descendants every half second
(the tree hangs off the worker by parent pid, whichever process group each leads). Once
the worker is gone it freezes (SIGSTOP) what it remembered and then looks again under
those frozen processes (a frozen process cannot fork: what the last look missed is found
then), kills (SIGKILL) every process and every process group led by one of them, then the server
groups recorded in the scratch folder's pgid files (server.stop_group_from_file, the
sweep's own safety net: a server whose kernel died first is no one's child), and removes
the scratch folder. Nothing is found by name.
"""
from __future__ import annotations

import os
import select
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from .server import stop_group_from_file

DONE = b"done"
POLL_S = 0.5


def launch(scratch: Path) -> subprocess.Popen:
    """A guard for this process (the Ray worker) and its start's scratch folder; started
    before anything it may have to stop."""
    return subprocess.Popen([sys.executable, "-m", "vllm_study.launch.orphan_guard", str(os.getpid()), str(scratch)],
                            stdin=subprocess.PIPE, start_new_session=True)


def release(guard: subprocess.Popen, done: bool, timeout_s: float = 60) -> None:
    """The task has ended. done: its start folder is packed and nothing of it runs (the
    guard exits); else (the task raised) the guard stops what is left and removes the
    scratch folder. Waits for it either way."""
    try:
        if done:
            guard.stdin.write(DONE + b"\n")
        guard.stdin.close()
    except OSError:  # the guard is already gone
        pass
    try:
        guard.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        guard.kill()
        guard.wait()


def _remember(worker: psutil.Process, tree: dict[int, psutil.Process]) -> None:
    try:
        kids = worker.children(recursive=True)
    except psutil.Error:
        return
    for p in kids:
        if p.pid != os.getpid() and not (p.pid in tree and tree[p.pid].is_running()):
            tree[p.pid] = p  # psutil.Process keeps its create time: a reused pid is never taken for it


def stop_tree(tree: dict[int, psutil.Process], scratch: Path) -> None:
    """Freeze, find what was forked since the last look, kill; see the module's doc."""
    frozen: dict[int, psutil.Process] = {}
    todo = [p for p in tree.values() if p.pid != os.getpid()]
    while todo:
        p = todo.pop()
        if p.pid in frozen or p.pid == os.getpid():
            continue
        try:
            p.suspend()  # is_running() checked first: never a process that reused the pid
            frozen[p.pid] = p
            todo += p.children(recursive=True)
        except psutil.Error:
            pass
    for p in frozen.values():
        try:
            pgid = os.getpgid(p.pid)
            if pgid == p.pid and p.is_running():  # a group this tree made (start_new_session)
                os.killpg(pgid, signal.SIGKILL)
            p.kill()
        except (psutil.Error, OSError):
            pass
    for pgid_file in scratch.rglob("*.pgid"):
        stop_group_from_file(pgid_file)
    deadline = time.monotonic() + 10  # gone before the scratch folder is removed (none writes there after)
    while any(_alive(p) for p in frozen.values()) and time.monotonic() < deadline:
        time.sleep(0.05)


def _alive(p: psutil.Process | None) -> bool:
    try:  # a zombie (dead, not yet reaped by the raylet) counts as gone
        return p is not None and p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def guard(worker_pid: int, scratch: Path) -> int:
    """The guard's life: watch the worker and its tree until "done", or stop the tree."""
    try:
        worker = psutil.Process(worker_pid)
    except psutil.NoSuchProcess:
        worker = None
    tree: dict[int, psutil.Process] = {}
    while _alive(worker):
        ready, _, _ = select.select([sys.stdin.buffer], [], [], POLL_S)
        if ready:
            got = os.read(sys.stdin.fileno(), 64)
            if got.startswith(DONE):
                return 0
            if not got:
                break  # the worker is gone, or its task raised
        _remember(worker, tree)
    stop_tree(tree, scratch)
    shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(guard(int(sys.argv[1]), Path(sys.argv[2])))
