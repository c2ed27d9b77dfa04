"""Run a command longer than one job of a machine that ends each job after a fixed time:
in the background, in its own session, each call waiting on it at most --wait seconds and
then packing the folders it writes, so what it measured leaves the machine with every call.

    python tools/detach.py --state /tmp/sweep-speed --wait 540 --pack $OUT/sweep-speed.tar.gz \\
        --folder /tmp/sweep-speed-out -- \\
        python benchmarks/sweep_speed.py params/h200-sweep-speed.yaml --out /tmp/sweep-speed-out

The first call starts the command (its output in STATE.log); a call while it runs waits on
it instead of starting another: repeat the same command. Exit status 0: the command ended
(its own exit status is printed and kept in STATE.rc; a call after that packs again and
starts nothing); 3: it still runs. The machine must
stay up between the calls (their jobs back to back). tools/study_slice.py --wait runs a
slice this way.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import tarfile
import time
from pathlib import Path

STILL_RUNS = 3


def alive(pid: int, marker: str) -> bool:
    """`pid` is still the process started: it runs and its command line holds `marker`
    (a pid file outliving its process may name an unrelated process by then)."""
    try:
        return marker in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return False


def wait_on(child: list[str], pid_file: Path, log: Path, wait: float, marker: str, cwd: Path,
            what: str = "the command") -> bool:
    """Start `child` in the background (own session, output to `log`) unless the process
    `pid_file` names still runs; wait for it at most `wait` seconds; print what its log
    gained meanwhile. True while it still runs."""
    pid = int(pid_file.read_text()) if pid_file.exists() else None
    own = None
    if pid is not None and alive(pid, marker):
        print(f"waiting on {what} already running (pid {pid}; log {log})", flush=True)
    else:
        with open(log, "ab") as out:
            own = subprocess.Popen(child, cwd=cwd, stdout=out, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL, start_new_session=True)
        pid = own.pid
        pid_file.write_text(str(pid))
        print(f"started {what} in the background (pid {pid}; log {log})", flush=True)
    offset = log.stat().st_size if own is None and log.exists() else 0
    deadline = time.monotonic() + wait
    running = lambda: own.poll() is None if own else alive(pid, marker)  # noqa: E731
    while running() and time.monotonic() < deadline:
        time.sleep(2)
    if log.exists():
        with open(log, "rb") as f:
            f.seek(offset)
            sys.stdout.write(f.read().decode(errors="replace")[-6000:])
    return running()


def pack(folders: list[Path], to: Path, names: list[str] | None = None) -> None:
    """tar.gz of `folders`, each under its own name (or `names`); a folder not there yet is
    left out (the command may not have made it)."""
    with tarfile.open(to, "w:gz") as tar:
        for folder, name in zip(folders, names or [f.name for f in folders]):
            if folder.exists():
                tar.add(folder, arcname=name)
    print(f"packed {', '.join(map(str, folders))} into {to}", flush=True)


def _child(state: Path, cmd: list[str]) -> int:
    """The background process: the command, then its exit status in STATE.rc."""
    rc = subprocess.call(cmd)
    Path(f"{state}.rc").write_text(f"{rc}\n")
    return rc


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--state", type=Path, required=True,
                    help="STATE.pid, STATE.log and STATE.rc: the same for every call on one command")
    ap.add_argument("--wait", type=float, required=True, metavar="S", help="return within S seconds")
    ap.add_argument("--pack", type=Path, help="tar.gz each --folder here when the call returns")
    ap.add_argument("--folder", type=Path, action="append", default=[], help="a folder to pack (repeat)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("cmd", nargs=argparse.REMAINDER, help="-- the command")
    a = ap.parse_args()
    cmd = a.cmd[1:] if a.cmd[:1] == ["--"] else a.cmd
    if not cmd:
        ap.error("no command: give it after --, e.g. -- python benchmarks/sweep_speed.py ...")
    if a.pack and not a.folder:
        ap.error("--pack needs at least one --folder to pack")
    if a.child:
        return _child(a.state, cmd)
    a.state.parent.mkdir(parents=True, exist_ok=True)
    rc_file = Path(f"{a.state}.rc")
    child = [sys.executable, str(Path(__file__).resolve()), "--state", str(a.state), "--wait", "0", "--child",
             "--", *cmd]
    if rc_file.exists():   # the child's last act: it ended in an earlier call, not run twice
        print(f"it ended in an earlier call (remove {a.state}.* to run it anew)", flush=True)
        still = False
    else:
        still = wait_on(child, Path(f"{a.state}.pid"), Path(f"{a.state}.log"), a.wait, str(a.state), Path.cwd())
    if a.pack:
        pack(a.folder, a.pack)
    if still:
        print("\nit still runs: the same command again waits for it", flush=True)
        return STILL_RUNS
    print(f"\nit ended with exit status {rc_file.read_text().strip() if rc_file.exists() else 'unknown'}",
          flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
