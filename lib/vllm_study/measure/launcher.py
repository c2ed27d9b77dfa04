"""A start's launch: its GPU slot (taken, or waited for while started ahead), the vLLM
server with the kit's measurement flags (or a connection to an endpoint target), and
the workload (start_workload.py), built while vLLM starts. What it hands the round
protocol: the server (`Served`) and the workload."""
from __future__ import annotations

import ast
import atexit
import json
import os
import re
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from . import client, counters
from ..define import models
from ..launch.machine import vllm_accepts
from ..records.results import LOG, compress_log, now_utc, read_log
from ..scheduler_plugin.knobs import CONTROL_ENV
from ..scheduler_plugin.scheduler import STATS_ENV as PB_STATS_ENV
from ..scheduler_plugin.steps import STEPS_ENV
from ..launch.slots import SlotLock, compile_cache_env
from ..launch.deployment import Endpoint, VllmServe
from ..launch.flags import Flags
from ..launch.server import (ServerStartError, VllmServer, engine_init_visible, pgid_path, vllm_program,
                             stop_group_from_file)
from .live_knobs import SCHEDULER_CLS as LIVE_SCHEDULER_CLS
from .start_record import STEPS_RAW, StartLog, recorded_step
from .start_workload import StartWorkload


def _non_default_args(log_text: str) -> dict | None:
    """vLLM logs the engine args it was given as a Python dict literal at startup."""
    m = re.search(r"non-default args: (\{.*\})", log_text)
    try:
        return ast.literal_eval(m.group(1)) if m else None
    except (ValueError, SyntaxError):
        return None


# What _start_server sets for this start's place, not for the engine: its slot's GPUs and
# compile cache, the plugin's counter file, control file and step records, a start ahead's
# ready timeout. Recorded in launch.kit_env with the rest; an exported config leaves them
# out (export.py).
PLACE_ENV = frozenset({"CUDA_VISIBLE_DEVICES", "VLLM_CACHE_ROOT", PB_STATS_ENV, CONTROL_ENV, STEPS_ENV,
                       "VLLM_ENGINE_READY_TIMEOUT_S"})
BUDGET_SCHEDULER_CLS = "vllm_study.scheduler_plugin.PrefixBudgetScheduler"
STEPS_SCHEDULER_CLS = "vllm_study.scheduler_plugin.StepRecordsScheduler"
# The kit's scheduler classes as --scheduler-cls names them: (today's path, the path it had
# before the plugin's package was renamed from vllm_study.prefix_budget). Runs made before
# the rename record the old paths (start.json's and summary.json's launch.command), so code
# that reads a committed run's command matches both (report/export.py).
KIT_SCHEDULER_PATHS = (
    (BUDGET_SCHEDULER_CLS, "vllm_study.prefix_budget.PrefixBudgetScheduler"),
    (LIVE_SCHEDULER_CLS, "vllm_study.prefix_budget.LiveLimitsScheduler"),
    (STEPS_SCHEDULER_CLS, "vllm_study.prefix_budget.StepRecordsScheduler"),
)


@dataclass
class Served:
    """The server a start measures, as its launch hands it to the round protocol: where
    requests go (URL, model name, API key, proxy), the kit's own server (`server`, the
    deployment's handle: pgid, log, metrics URL, stop(); None for an endpoint target,
    which has no process of the kit's to stop or watch) and the file of its engine's
    step records (None where it keeps none). Filled in as the launch goes: the server
    at its spawn, the rest once it answers."""
    url: str | None = None
    model_name: str | None = None
    api_key: str | None = None
    proxy: str | None = None
    server: VllmServer | None = None
    steps_raw: Path | None = None


class Launcher:
    """A start's launch, writing through its StartLog `log`: takes the GPU slot
    (`slot_lock`, a path: slots.SlotLock), starts the point's server (or connects to its
    endpoint target) and builds the workload; `served` and `work` are what it hands on.
    `live`: the control channel (live_knobs.Channel) where the server serves several
    points, launched so that every chunk size in `served_chunks` is counted."""

    def __init__(self, plan, log: StartLog, gpu_indices: list[int] | None = None,
                 slot_lock: str | Path | None = None, live=None, served_chunks: tuple[int, ...] = ()):
        self.plan, self.study, self.point, self.log = plan, plan.study, plan.point, log
        self.gpu_indices = gpu_indices
        self.slot_lock = SlotLock(slot_lock) if slot_lock else None
        self.live, self.served_chunks = live, served_chunks
        self.served, self.work = Served(), StartWorkload(plan)

    @property
    def server(self) -> VllmServer | None:
        """The kit's own server once spawned (recorded_step watches it)."""
        return self.served.server

    @recorded_step
    def launch(self) -> None:
        """Start this point's vLLM, or, for an endpoint target, check that it answers.
        Under the sweep it first takes its slot (the previous server there has stopped),
        or, started ahead (server.start_ahead), spawns at once and is held at its engine's
        init until it has the slot. The tokenizer and the workload (seconds of CPU:
        the tokenizer, the word pieces, a round's prompts) are built
        while vLLM starts."""
        model, dummy = models.resolve(self.study.model)  # also the tokenizer that sizes prompts for targets
        planned_kv_block = self.point.effective.block_size if self.point.effective else None
        ahead = self._start_ahead_wanted() and not self._take_slot(wait=False)
        if not ahead:
            self._take_slot()
        with ThreadPoolExecutor(1) as pool:
            built = pool.submit(self._build_workload, model, planned_kv_block)
            if self.point.target:
                self._connect(self.point.target)
            else:
                self._start_server(model, dummy, ahead)
            expected = built.result()
        record = self.log.record
        kv_block = int(record.launch.cache_config.get("block_size") or planned_kv_block or 0)
        if kv_block and kv_block != planned_kv_block:  # the server chose another block size than planned
            expected = self.work.expected_hit_rate(kv_block)
        if not self.log.failed:
            record.expected_prefix_hit_rate = expected
        self.log.save()

    def stop(self) -> None:
        """Stop the server (a target's is not the kit's) and hand the slot on as soon as it
        is gone; its log compressed, the engine's whole step records dropped (the rounds
        kept their own: steps/r<k>.npz; the rest is warm-up, priming and gaps)."""
        server, log = self.served.server, self.log
        if server:
            log.mark("stop")
            server.stop()
            log.mark("stopped")
        if self.slot_lock:
            self.slot_lock.release()
        if server:
            compress_log(log.dir)
        (log.dir / STEPS_RAW).unlink(missing_ok=True)

    def _take_slot(self, wait: bool = True) -> bool:
        """Wait for the slot's previous start to stop its server (wait=False: take the
        slot only if it is free now, and say whether it was); a server whose start died
        holding the slot (its pgid still in the lock file) is stopped first."""
        lock, record = self.slot_lock, self.log.record
        if lock is None or lock.held:
            return True
        t0 = time.monotonic()
        if not lock.acquire(wait):
            return False
        record.launch.slot_wait_s = time.monotonic() - t0
        previous = lock.path.read_text().strip()  # the previous holder's server pgid file
        if previous and stop_group_from_file(Path(previous)):
            record.warnings.append(f"stopped a server that the slot's previous start left running ({previous})")
        lock.path.write_text(str(pgid_path(self.log.dir / LOG).resolve()))
        record.started_utc = now_utc()  # the slot's time starts here, not at the wait
        self.log.mark("slot", save=True)  # the sweep reads it: the slot's next start may now prepare
        return True

    def _start_ahead_wanted(self) -> bool:
        """server.start_ahead, where there is a slot to wait for and vLLM will log the
        line the hold is timed by."""
        s = self.study.server
        if not s.ahead_on(self.plan.engine) or self.slot_lock is None or self.point.target:
            return False
        why = engine_init_visible({**os.environ, **s.env})
        if why:
            self.log.record.warnings.append(f"not started ahead of its slot: {why}")
        return why is None

    def _hold_for_slot(self) -> None:
        """The server started ahead is frozen at its engine's init: wait for the slot."""
        self.log.mark("held", save=True)
        self._take_slot()

    def _build_workload(self, model: str, kv_block: int | None) -> float | None:
        """The tokenizer and the workload; returns the expected hit rate at KV-cache block
        size `kv_block`."""
        self.work.build(model, self.log.record)
        return self.work.expected_hit_rate(kv_block) if kv_block else None

    def _connect(self, t) -> None:
        target = Endpoint(t.name, t.base_url, t.model, t.api_key_env, t.proxy)
        handle = target.start()  # served.server stays None: there is no process of the kit's to stop or watch
        served, record = self.served, self.log.record
        served.url, served.model_name, served.proxy = handle.base_url, target.served_name, target.proxy
        # Only the variable's name is recorded; the key stays in memory.
        record.launch.target = target.record()
        if t.api_key_env:
            served.api_key = os.environ.get(t.api_key_env)
            if not served.api_key:
                self.log.fail(f"environment variable {t.api_key_env} (the API key of target "
                              f"{t.name}) is not set; export it before the run")
                return
        try:
            client.check_endpoint(served.url, served.model_name, served.api_key, proxy=served.proxy)
        except client.EndpointError as e:
            self.log.fail(f"target {t.name}: {e}")
            return
        api = counters.probe_server_api(served.url, served.api_key, served.proxy)
        self.log.mark("ready")
        record.launch.has_metrics = api.snapshot is not None
        record.launch.cache_reset = api.cache_reset
        if api.snapshot is not None:
            record.launch.cache_config = counters.cache_config(api.snapshot)
        record.warnings += api.notes

    def _start_server(self, model: str, dummy: bool, ahead: bool = False) -> None:
        s, log = self.study, self.log
        env = dict(s.server.env)
        if self.gpu_indices is not None:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, self.gpu_indices))
            env.update(compile_cache_env(self.gpu_indices))
        if self.point.prefix_budget:
            # the plugin's counters, per start; by environment so vLLM's compile cache key stays put
            env[PB_STATS_ENV] = str(log.pb_stats_path)
        if self.live:  # the plugin's control file, and its counters file that answers it
            env.update(self.live.env())
        self.served.steps_raw = step_records_env(s, log.dir, env, log.record.warnings)
        if s.server.ahead_on(self.plan.engine):
            # on every start of the study, held or not: VLLM_ENGINE_READY_TIMEOUT_S is in
            # vLLM's torch.compile cache key (envs.compile_factors), so setting it on held
            # starts only would make each config's first held start compile again
            env.update(VllmServer.ahead_env({**os.environ, **env}))
        # a search's shared start is launched at its trials' largest live limits (plan.launch)
        args = self.point.engine_args.model_copy(update=self.plan.launch or {})
        program = s.server.program()  # None: vLLM's own entrypoint
        deployment = VllmServe(model, s.model.served_name, dummy, engine=args.flags(),
                               extra=Flags.parse(s.server.extra_cli_args),
                               measuring=Flags.parse(self.measurement_flags()), env=env,
                               startup_timeout_s=s.server.startup_timeout_s, program=program or vllm_program())
        log.record.launch.program = list(program) if program else None
        try:
            deployment.start(log.dir / LOG, hold=self._hold_for_slot if ahead else None,
                             spawned=lambda server: self._spawned(server, env, ahead))
            log.mark("ready")
            reason = None
        except ServerStartError as e:
            reason = e.reason
        self._started(reason)

    def _spawned(self, server: VllmServer, env: dict, ahead: bool) -> None:
        """A server spawned (its command fixed, not yet healthy): recorded, and stopped if
        the kernel dies mid-point."""
        launch = self.log.record.launch
        self.served.server = server
        launch.command = server.cmd
        launch.started_ahead = ahead
        launch.kit_env = {**{k: v for k, v in env.items() if k not in self.study.server.env}, **server.uni_env}
        atexit.register(server.stop)  # a kernel that dies mid-point stops its server
        self.log.mark("spawn", save=True)  # with "slot", the sweep lets the slot's next start prepare

    def _started(self, reason: str | None) -> None:
        """What the start recorded once its server is up (or why it is not)."""
        s, server, served, record = self.study, self.served.server, self.served, self.log.record
        record.launch.ahead_cpus = server.ahead_cpus
        record.launch.ahead_priority_restored = server.priority_restored
        if server.priority_restored is False:
            record.warnings.append("started ahead at nice 19, and its priority could not be raised back once "
                                   "released (that needs CAP_SYS_NICE): it measured at nice 19")
        if server.hold_missed:
            record.timeline.pop("held", None)  # never frozen: its life on the GPU began at its spawn
            record.warnings.append("started ahead, but vLLM was healthy before its engine-init line was seen: "
                                   "its GPU start-up ran beside the slot's previous server")
        record.warnings += server.notes
        record.launch.vllm_non_default_args = _non_default_args(read_log(self.log.dir))
        if reason:
            self.log.fail(f"server did not start: {reason}")
            return
        record.launch.server_pgid = server.pgid
        record.launch.startup_s = server.startup_s
        served.url, served.model_name = server.base_url, s.model.served_name
        if self.live:  # the control channel (live knobs) talks to this server
            self.live.url = served.url
        record.launch.cache_config = counters.cache_config(counters.scrape(served.url))
        client.check_endpoint(served.url, s.model.served_name)

    def measurement_flags(self) -> list[str]:
        return measurement_flags(self.plan, self.live is not None, self.served_chunks)


def step_records_off(study) -> str | None:
    """Why a study's starts record no engine steps, or None where they do."""
    if study.targets:
        return "a targets study measures servers the kit does not launch"
    if not study.server.step_records:
        return "server.step_records is false"
    if "scheduler-cls" in Flags.parse(study.server.extra_cli_args):
        return ("server.extra_cli_args sets --scheduler-cls: steps are recorded by the kit's own scheduler "
                "plugin, which that class replaces (set server.step_records: false to say so and silence this)")
    return None


def step_records_env(study, start_dir: Path, env: dict, warnings: list[str]) -> Path | None:
    """The raw file of the start's engine step records (scheduler_plugin/step_records.py; the
    rounds cut it, rounds.save_steps), named in `env`; None, with a warning where the study
    wants records its own scheduler class cannot write."""
    off = step_records_off(study)
    if off is None:
        env[STEPS_ENV] = str(start_dir / STEPS_RAW)
        return start_dir / STEPS_RAW
    if study.server.step_records:
        warnings.append(f"no step records: {off}")
    return None


def measurement_flags(plan, live: bool, served_chunks: tuple[int, ...] = ()) -> list[str]:
    """Flags that make the server count what the report needs, where this vLLM takes
    them and the study does not set them itself: a histogram bound at the chunk budget
    (counters.long_prefills) and, on a GPU, vLLM's FLOP and byte estimates (machine.py);
    the kit's scheduler plugin where the point uses the Prefix Reuse Budget, `live` (the
    start's limits change at runtime) or the start records its engine steps."""
    flags = []
    pb = plan.point.prefix_budget
    if pb:
        flags += ["--scheduler-cls", BUDGET_SCHEDULER_CLS, "--additional-config",
                  json.dumps({"prefix_budget": {"min_reuse_ratio": pb.min_reuse_ratio,
                                                "max_defer_ms": pb.max_defer_ms}})]
    elif live:  # the Prefix Reuse Budget scheduler above takes the control file too
        flags += ["--scheduler-cls", LIVE_SCHEDULER_CLS]
    elif step_records_off(plan.study) is None:  # both above record steps too
        flags += ["--scheduler-cls", STEPS_SCHEDULER_CLS]
    mbt = plan.point.effective.max_num_batched_tokens
    return flags + counting_flags(plan.engine, (mbt, *served_chunks) if mbt else (), plan.study.server.extra_cli_args)


def counting_flags(engine: str, chunks: tuple[int, ...], extra_cli_args: list[str]) -> list[str]:
    """The counting half of measurement_flags: histogram bounds at the chunk budgets
    (`chunks`, the launch's first) and, on a GPU, vLLM's per-step FLOP and byte estimates.
    A flag in `extra_cli_args` (the study's) is the study's: --no-enable-mfu-metrics there
    leaves the estimates out."""
    given = Flags.parse(extra_cli_args)  # --a_b, --a-b and --no-a-b are all the study's a-b
    flags = []
    if chunks and "custom-histogram-buckets" not in given and vllm_accepts("--custom-histogram-buckets"):
        flags += ["--custom-histogram-buckets", json.dumps(counters.budget_buckets(*chunks))]
    if engine == "gpu" and "enable-mfu-metrics" not in given and vllm_accepts("--enable-mfu-metrics"):
        flags.append("--enable-mfu-metrics")
    return flags
