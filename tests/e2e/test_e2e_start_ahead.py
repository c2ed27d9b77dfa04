"""A server started ahead of its slot, against a real vLLM (the CPU build): it spawns and
imports, is frozen the moment its engine logs that it initializes, stays frozen and
unhealthy while the slot is busy, and starts serving once the slot is free; a frozen
server still stops on SIGTERM. In a sweep, a slot's next server spawns during the
previous one's measurement and its engine initializes only after that one has stopped
(the fake engine, which logs vLLM's engine-init line and is held at it as vLLM is: the
sweep's scheduling of the two starts is the kit's)."""
from __future__ import annotations

import datetime as dt
import os
import re
import signal
import threading
import time

import psutil
import pytest

from e2e_support import UNI, fake_engine_study, plan_of, serve_on_a_free_port, sweep, tiny, write
from procs import group_gone
from vllm_study.define import models
from vllm_study.launch.slots import SlotLock
from vllm_study.records.results import RunFolder, read_log
from vllm_study.launch.server import ENGINE_INIT_LINE, _health, serve_command, without_colours

pytestmark = pytest.mark.e2e


def _states(pgid: int) -> set[str]:
    return {p.status() for p in psutil.process_iter() if _in_group(p, pgid)}


def _in_group(p: psutil.Process, pgid: int) -> bool:
    try:
        return os.getpgid(p.pid) == pgid
    except (ProcessLookupError, psutil.Error):
        return False


def test_a_held_server_waits_frozen_for_its_slot_then_serves(tmp_path):
    plan = plan_of(tiny())
    model, dummy = models.resolve(plan.study.model)
    busy = SlotLock(tmp_path / "slot.lock")
    busy.acquire()  # the slot's previous server, still measuring
    waiter = SlotLock(tmp_path / "slot.lock")
    made = []  # (server, when its start began): a second where the first's port was taken
    started = threading.Thread(target=serve_on_a_free_port, kwargs={
        "command": lambda port: serve_command(model, port, plan.point.engine_args.cli(), "tiny", load_dummy=dummy,
                                              extra=UNI),
        "log_path": tmp_path / "server.log", "hold": waiter.acquire, "startup_timeout_s": 600,
        "made": lambda srv: made.append((srv, time.perf_counter()))})
    started.start()
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and ENGINE_INIT_LINE.decode() not in read_log(tmp_path):
            assert started.is_alive(), read_log(tmp_path)[-2000:]
            time.sleep(0.2)
        srv, t_begin = made[-1]
        # the server's own watch may see the line after this loop does: the hold's clock
        # starts once the group is frozen (it failed once by 12 ms when timed from the line)
        while time.monotonic() < deadline and psutil.STATUS_STOPPED not in _states(srv.proc.pid):
            time.sleep(0.05)
        time.sleep(5)  # frozen: nothing moves however long the slot stays busy
        log_when_frozen = read_log(tmp_path)
        assert _states(srv.proc.pid) == {psutil.STATUS_STOPPED}
        assert not _health(srv.url)
        time.sleep(3)
        assert read_log(tmp_path) == log_when_frozen
        busy.release()
        started.join(600)
        total = time.perf_counter() - t_begin
        assert not started.is_alive() and _health(srv.url)
        assert srv.held_s >= 8 and not srv.hold_missed
        # the start-up it reports leaves out the hold: spawn to healthy, less held_s
        assert 0 < srv.startup_s and srv.startup_s + srv.held_s == pytest.approx(total, abs=1.5)
        # the engine's work after its init line came only once the slot was let go
        assert "Starting vLLM" not in log_when_frozen and "Starting vLLM" in read_log(tmp_path)
        assert _states(srv.proc.pid) <= {psutil.STATUS_SLEEPING, psutil.STATUS_RUNNING}
        # frozen again, it still stops on SIGTERM (stop() lets the group run to handle it)
        pgid = srv.proc.pid
        os.killpg(pgid, signal.SIGSTOP)
        t0 = time.monotonic()
        srv.stop(grace_s=60)
        assert group_gone(pgid) and srv.proc.returncode != -signal.SIGKILL
        assert time.monotonic() - t0 < 60
    finally:
        busy.release()
        for server, _ in made:
            server.stop()
        started.join(60)


_LOG_TIME = re.compile(r"INFO (\d\d-\d\d \d\d:\d\d:\d\d)")


def _logged(start_dir, marker: str) -> float:
    """Unix time (seconds resolution) of the first log line holding `marker`."""
    line = next(ln for ln in without_colours(read_log(start_dir)).splitlines() if marker in ln)
    stamp = dt.datetime.strptime(_LOG_TIME.search(line).group(1), "%m-%d %H:%M:%S")
    now = dt.datetime.now()
    return stamp.replace(year=now.year).timestamp()


@pytest.mark.fake_engine
def test_a_sweep_spawns_the_next_server_during_the_measurement_and_holds_it(tmp_path):
    # Rounds of ~6 s (Poisson, 0.5 req/s): the second server spawns once its notebook is
    # ready, seconds into the first one's start, and the fake engine reaches its init line in
    # about a second, while the first one still warms up or measures (~20 s).
    study = fake_engine_study(tiny(grid={"max_num_batched_tokens": [256, 512]},
                                   server={"extra_cli_args": UNI, "start_ahead": True, "live_knobs": False},
                                   workload={**tiny()["workload"], "requests_per_round": 4,
                                             "load": {"kind": "poisson", "rate": 0.5}}))
    done = sweep(write(tmp_path, study), "--results", tmp_path / "results", "--no-report")
    assert done.returncode == 0, done.stderr[-3000:]
    run = RunFolder(next((tmp_path / "results").iterdir()))
    order = run.manifest().order
    first, second = (run.point(u.point).start(u.start) for u in order)
    assert first.status == second.status == "ok"
    assert not first.launch.started_ahead  # the slot was free
    assert second.launch.started_ahead and "held" in second.timeline
    # it imported on cores of its own at nice 19, and had every core and its priority back once released
    from vllm_study.launch.server import background_cpus
    assert second.launch.ahead_cpus == background_cpus() and first.launch.ahead_cpus is None
    if os.geteuid() == 0:  # raising a priority back needs CAP_SYS_NICE
        assert second.launch.ahead_priority_restored
    # the same environment, held or not, so both share one torch.compile cache key (less the
    # start's own files, such as its step records' path, which vLLM's key does not read)
    from vllm_study.measure.launcher import PLACE_ENV
    engine_env = [{k: v for k, v in s.launch.kit_env.items() if k not in PLACE_ENV} for s in (first, second)]
    assert engine_env[0] == engine_env[1] and engine_env[0]
    assert first.launch.kit_env["VLLM_ENGINE_READY_TIMEOUT_S"] == "86400"
    t1, t2 = first.timeline, second.timeline
    assert t2["spawn"] < t1["measured"]                     # it spawned while the first one measured
    assert t2["held"] < t1["stopped"] <= t2["slot"]          # frozen until the first server was gone
    d2 = run.point(second.point).start_dir(second.start)
    # its engine's work (the line after the hold) began after the first server was gone
    assert _logged(d2, "init engine") >= int(t1["stopped"])
    # its start-up leaves the hold out
    assert second.launch.startup_s == pytest.approx(t2["ready"] - t2["spawn"] - (t2["slot"] - t2["held"]), abs=1)
    assert run.manifest().overlaps == []  # life on the slot: never two at once
    # the progress bar names the start that measures, not the one preparing beside it: each
    # bar line that counts the first start's rounds (0/4, 1/4) names the first start
    a, b = (f"{u.point} #{u.start}" for u in order)
    lines = [ln for ln in done.stderr.replace("\r", "\n").splitlines() if "round" in ln and "/4 [" in ln]
    assert any(ln.startswith(a) for ln in lines) and any(ln.startswith(b) for ln in lines), lines
    assert not [ln for ln in lines if ln.startswith(b) and ("| 0/4" in ln or "| 1/4" in ln)], lines
