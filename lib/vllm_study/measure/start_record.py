"""A start's log: its record (start.json) in its folder. Every step of a start saves what
it learned at once, through the log, so a start that dies keeps it. A step that raises
marks the start failed with the error instead of stopping the notebook (`recorded_step`).
The launch (launcher.py) and the round protocol (rounds.py) are each handed the log."""
from __future__ import annotations

import functools
import platform
import shutil
import time
from pathlib import Path

from ..launch.server import failure_reason
from ..scheduler_plugin import steps
from ..records.results import START, Launch, StartRecord, now_utc, read_log

PB_STATS = "prefix_budget.json"  # the Prefix Reuse Budget plugin's counters, in the start's folder
STEPS_RAW = "steps.raw"          # the engine's step records, whole (the rounds keep their own cut)


def recorded_step(method):
    """A step that raises records the start as failed (with the error) instead of
    stopping the notebook: failures are data, and later steps become no-ops. The step's
    object has `log` (its StartLog) and `server` (the kit's own server, None where there
    is none yet or the kit did not start it). Where the error is a connection's and that
    server has ended, the start fails with what ended it and where (`log.doing`: "during
    priming of step 2 (window 1)"), not with the connection refused that a request to a
    dead server meets."""
    @functools.wraps(method)
    def wrapper(self, *a, **kw):
        log = self.log
        if log.failed:
            return None
        log.doing = None
        try:
            return method(self, *a, **kw)
        except Exception as e:
            if isinstance(e, OSError) and log.server_died(self.server, log.doing or f"during {method.__name__}",
                                                          wait_s=10):
                return None
            log.fail(f"{method.__name__}: {type(e).__name__}: {e}")
            return None
    return wrapper


class StartLog:
    """Keeps `record` (a StartRecord) in `dir`/start.json; `doing` says where the step
    running now is, for the words a dead server is recorded with (recorded_step)."""

    def __init__(self, start_dir: str | Path, record: StartRecord):
        self.dir, self.record = Path(start_dir), record
        self.doing: str | None = None

    @classmethod
    def begin(cls, plan, start_dir: str | Path, start: int, block: int | None, nvml) -> StartLog:
        """Start `start` of the point in `plan` (a PointPlan), its folder emptied of an
        earlier try's files (its notebook aside), its record saved at once. `nvml`: the
        start's GPUs (machine.NvmlProbe), described in the record."""
        d = Path(start_dir)
        d.mkdir(parents=True, exist_ok=True)
        for stale in d.iterdir():  # a re-run of a start starts clean (its notebook aside)
            if stale.is_file() and stale.suffix != ".ipynb":
                stale.unlink()
        shutil.rmtree(d / steps.ROUNDS_DIR, ignore_errors=True)
        point = plan.point
        log = cls(d, StartRecord(point=point.id, start=start, block=block, started_utc=now_utc(),
                                 launch=Launch(), host=platform.node(), gpus=nvml.describe(),
                                 no_gpu_reason=None if nvml.available else nvml.why,
                                 rounds_planned=plan.study.steps_per_start, warnings=list(point.warnings)))
        log.save()
        return log

    @property
    def failed(self) -> bool:
        return self.record.status == "failed"

    @property
    def pb_stats_path(self) -> Path:
        return self.dir / PB_STATS

    def fail(self, reason: str) -> None:
        self.record.status, self.record.reason = "failed", reason
        self.save()

    def server_died(self, server, when: str, wait_s: float = 0) -> bool:
        """Where `server` (the kit's own; None for none) has ended (waiting up to wait_s for
        its exit to show), fail the start with vLLM's reason from its log ("CUDA out of
        memory", "killed by SIGKILL"): a request or scrape that found nothing listening
        says none of it."""
        if not exited(server, wait_s):
            return False
        log = read_log(server.log_path.parent)  # a shared start's: its lead's folder
        self.fail(f"server died {when}: {failure_reason(log, server.proc.returncode)}")
        return True

    def save(self) -> None:
        self.record.save(self.dir / START)

    def mark(self, step: str, save: bool = False) -> None:
        self.record.timeline[step] = time.time()  # results.TIMELINE
        if save:
            self.save()


def exited(server, wait_s: float = 0) -> bool:
    """The kit's own server has ended (waiting up to wait_s for its exit to show); never
    for an endpoint it did not start (server None)."""
    return server is not None and server.exited(wait_s)
