"""What the end-to-end tests share: the tiny study, KV sizes in tokens whatever dtype
this CPU runs, one server start of a point through the kit's own steps, and the sweep
command run as a user runs it."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import yaml

from vllm_study.define.grid import PointPlan, expand
from vllm_study.launch.machine import cpu_dtype
from vllm_study.define.models import kv_bytes_per_token
from vllm_study.define.study_file import study_from_dict
from vllm_study.measure.point import PointStart
from vllm_study.launch.server import ServerStartError, VllmServer, free_port
from vllm_study.launch.deployment import PORT_TRIES
from paths import FAKE_ENGINE, REPO  # noqa: F401  (tests import them from here too)


def kv_bytes(tokens: int) -> int:
    """KV-cache bytes holding `tokens` of the tiny model in the dtype this CPU runs (the
    kit picks float32 without native bf16): tests then mean the same cache everywhere."""
    return tokens * kv_bytes_per_token("tiny-qwen2", 2 if cpu_dtype().dtype == "bfloat16" else 4)


# The model in the engine-core process: no worker process to spawn, ~17 s less per start
# (server.cpu_uni_env). The eviction, exported-config and prefix-budget tests keep vLLM's
# CPU default (a worker process of its own), so both launch paths stay covered.
UNI = ["--distributed-executor-backend", "uni"]


def tiny(**over) -> dict:
    study = {"name": "e2e", "model": {"card": "tiny-qwen2", "served_name": "tiny"},
             "engine_args": {"max_model_len": 2048, "enable_prefix_caching": True, "enforce_eager": True,
                             "kv_cache_memory_bytes": kv_bytes(16384)},
             "grid": {"max_num_batched_tokens": [256]},
             "workload": {"system_prompt_tokens": 512, "question_tokens": 16, "output_tokens": 16,
                          "concurrency": 4, "requests_per_round": 8, "warmup_requests": 2},
             "rounds": 2, "server": {"extra_cli_args": UNI}}
    return {**study, **over}


def fake_engine_study(study: dict, **env: str) -> dict:
    """`study` served by the fake engine (tests/fake_engine.py, through server.command)
    in place of vLLM: for tests of the kit's own control flow, marked `fake_engine`.
    Step records off: they are written by the kit's scheduler plugin inside vLLM, which
    the fake does not run. `env`: the fake's own knobs (FAKE_ENGINE_INIT_S=...)."""
    server = dict(study.get("server", {}))
    server.update(command=["python", str(FAKE_ENGINE)], step_records=False,
                  env={**server.get("env", {}), **env})
    return {**study, "server": server}


def plan_of(study: dict, index: int = 0) -> PointPlan:
    s = study_from_dict(study)
    return PointPlan(study=s, point=expand(s, "cpu")[index], engine="cpu")


def measure(plan: PointPlan, start_dir: Path, start: int = 1):
    """launch, warm up, rounds, finish: the point notebook's steps."""
    run = PointStart(plan, start_dir, start)
    run.launch()
    run.warmup()
    run.run_rounds()
    return run, run.finish()


def no_proxy_env() -> dict:
    return {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}


def sweep(*args, timeout=1500) -> subprocess.CompletedProcess:
    """`python -m vllm_study sweep ARGS` from the repository root."""
    return subprocess.run([sys.executable, "-m", "vllm_study", "sweep", *map(str, args)], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)


def write(tmp_path: Path, study: dict) -> Path:
    f = tmp_path / "study.yaml"
    f.write_text(yaml.safe_dump(study, sort_keys=False))
    return f


def serve_on_a_free_port(command, log_path: Path, hold=None, made=None, **kw) -> VllmServer:
    """A started VllmServer for `command(port)` on a port free_port picked, started again
    on another where the port was taken before vLLM bound it, as the kit's launcher does
    (free_port cannot rule that out: servers of other tests start beside this one).
    `hold` goes to start(); `made(server)` is told of each server before it starts (a
    caller that starts it in a thread watches it while it is held)."""
    for attempt in range(PORT_TRIES):
        port = free_port()
        srv = VllmServer(command(port), port, log_path, **kw)
        if made:
            made(srv)
        try:
            return srv.start(hold=hold)
        except ServerStartError as e:
            if not e.reason.startswith("port in use") or attempt == PORT_TRIES - 1:
                raise
    raise AssertionError("unreachable")
