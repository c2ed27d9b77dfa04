"""A server start's record (start.json) and its writer: every step of a start saves
what it learned at once, so a start that dies keeps it. A step that raises marks the
start failed with the error instead of stopping the notebook (`recorded_step`)."""
from __future__ import annotations

import functools
import time

from ..launch.server import failure_reason
from ..records.results import START, read_log


def recorded_step(method):
    """A step that raises records the start as failed (with the error) instead of
    stopping the notebook: failures are data, and later steps become no-ops. Where the
    error is a connection's and the kit's own server has ended, the start fails with
    what ended it and where (`_doing`: "during priming of step 2 (window 1)"), not with
    the connection refused that a request to a dead server meets."""
    @functools.wraps(method)
    def wrapper(self, *a, **kw):
        if self.failed:
            return None
        self._doing = None
        try:
            return method(self, *a, **kw)
        except Exception as e:
            if isinstance(e, OSError) and self._server_died(self._doing or f"during {method.__name__}", wait_s=10):
                return None
            self._fail(f"{method.__name__}: {type(e).__name__}: {e}")
            return None
    return wrapper


class StartWriter:
    """Keeps `self.record` (a StartRecord) in `self.dir`/start.json: the launcher, the
    round protocol and the point notebook write through it."""
    steps_raw = None  # Path of the engine's step records, set at launch where the start records them

    @property
    def failed(self) -> bool:
        return self.record.status == "failed"

    def _fail(self, reason: str) -> None:
        self.record.status, self.record.reason = "failed", reason
        self._save()

    def _server_exited(self, wait_s: float = 0) -> bool:
        """The kit's own server has ended (waiting up to wait_s for its exit to show); never
        for an endpoint it did not start."""
        server = getattr(self, "server", None)
        return server is not None and server.exited(wait_s)

    def _server_died(self, when: str, wait_s: float = 0) -> bool:
        """Where the kit's own server has ended, fail the start with vLLM's reason from its
        log ("CUDA out of memory", "killed by SIGKILL"): a request or scrape that found
        nothing listening says none of it."""
        if not self._server_exited(wait_s):
            return False
        log = read_log(self.server.log_path.parent)  # a shared start's: its lead's folder
        self._fail(f"server died {when}: {failure_reason(log, self.server.proc.returncode)}")
        return True

    def _save(self) -> None:
        self.record.save(self.dir / START)

    def _mark(self, step: str, save: bool = False) -> None:
        self.record.timeline[step] = time.time()  # results.TIMELINE
        if save:
            self._save()
