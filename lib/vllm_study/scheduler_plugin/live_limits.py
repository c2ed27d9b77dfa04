"""Live scheduler limits inside the EngineCore: a control file in, the limits in force
out (through the plugin's counters file).

Where vLLM reads them (0.26 and 0.32, vllm/v1/core/sched/scheduler.py): at __init__
the scheduler copies max_num_seqs into ``max_num_running_reqs`` (0.32 also into
``max_num_active_reqs``, the admission cap) and max_num_batched_tokens into
``max_num_scheduled_tokens``; schedule() starts every step from these attributes and
reads ``scheduler_config.long_prefill_token_threshold`` (and in 0.32
``scheduler_config.max_num_batched_tokens``, its input budget) afresh. Changing those
between two schedule() calls changes the next step's limits and nothing else. The
scheduler gets a private shallow copy of its SchedulerConfig before any change: the
model runner and the rest of the engine keep the launch values they were built for.

How a message becomes the limits in force:
- A watcher thread reads the control file (``CONTROL_ENV``) every ``POLL_S``. A
  message is handled once, by its ``seq``; a number not above the last one is ignored.
- A wrong message is refused whole (knobs.check_message): the limits do not change,
  and the counters file says ``status: refused`` with the reason.
- A valid one waits (``status: pending``) until the engine holds no request at all,
  then is applied under a lock that schedule() also holds: never inside a step, and
  every request of a round runs under one set of limits. The engine loop sleeps while
  idle (it calls schedule() only with work), hence the thread rather than a check at
  the start of schedule().
- The counters file's ``knobs`` section: launch, in_force, applied_seq, seq, status,
  reason, and since the last application the steps, the largest step in tokens and
  the most running requests: what the engine did, beside what it was told. Also
  ``requests``, the requests the engine holds (as of the last poll): vLLM's /metrics
  gauges move only when the engine steps, and a paused engine holds requests without
  stepping.
"""
from __future__ import annotations

import copy
import logging
import os
import threading
import time
from pathlib import Path

from .counters_file import StatsRecorder, stats_path_for
from .knobs import CONTROL_ENV, Limits, Refused, check_message, message_seq, parse_control

log = logging.getLogger(f"vllm.plugins.{__name__}")  # under vLLM's "vllm" logger: its handlers and format
POLL_S = 0.05


class LiveLimitsMixin:
    """Adds the control channel to a vLLM scheduler class (before PrefixBudgetMixin, if
    any). Without ``CONTROL_ENV`` in the environment it changes nothing."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        path = os.environ.get(CONTROL_ENV) or None
        self._kn_path = Path(path) if path else None
        if self._kn_path is None:
            return
        self._kn_stats, self._kn_own_stats = self._kn_recorder()
        sc = self.scheduler_config
        self.scheduler_config = copy.copy(sc)  # the scheduler's own: see the module docstring
        self._kn_launch = Limits(sc.max_num_batched_tokens, self.max_num_running_reqs,
                                 sc.long_prefill_token_threshold)
        self._kn_launch_scheduled = self.max_num_scheduled_tokens  # 0.32 may set it apart
        self._kn_launch_active = getattr(self, "max_num_active_reqs", None)  # 0.32 only
        self._kn_chunked = bool(sc.enable_chunked_prefill)
        self._kn_lock = threading.Lock()
        self._kn_seq = 0
        self._kn_pending: tuple[int, Limits] | None = None
        self._kn_last_text: str | None = None
        self._kn_held = 0
        self._kn_stop = threading.Event()
        stale = self._kn_stale()
        self._kn_stats.set_section("knobs", {
            "control_path": str(self._kn_path), "launch": self._kn_launch.to_dict(),
            "chunked_prefill": self._kn_chunked,
            "in_force": self._kn_launch.to_dict(), "applied_seq": 0, "seq": self._kn_seq,
            "status": "launch", "applied_at": time.time(),
            "reason": stale and f"message {self._kn_seq} was in the control file before this "
                                "engine started: not applied",
            "steps": 0, "peak_step_tokens": 0, "peak_running": 0, "requests": 0})
        self._kn_stats.flush()  # the kit can read the launch values as soon as the engine is up
        self._kn_thread = threading.Thread(target=self._kn_loop, name="live-limits", daemon=True)
        self._kn_thread.start()
        log.info("live limits: control %s, launch %s", self._kn_path, self._kn_launch)

    def _kn_stale(self) -> bool:
        """A message left from an earlier server start is not this engine's to apply:
        its number becomes the last one handled (the kit sends the next)."""
        try:
            text = self._kn_path.read_text()
            self._kn_seq = message_seq(parse_control(text))
        except (FileNotFoundError, Refused):
            return False
        self._kn_last_text = text
        return True

    def _kn_recorder(self) -> tuple[StatsRecorder, bool]:
        """The Prefix Reuse Budget's recorder when there is one, else a recorder of our own."""
        if getattr(self, "_pb_stats", None) is not None:
            rec, own = self._pb_stats, False
        else:
            from .prefix_budget import params_from_config
            params = params_from_config(getattr(self.vllm_config, "additional_config", {}))
            base = next((c.__name__ for c in type(self).__mro__
                         if c.__module__.startswith("vllm.v1.core.sched")), "unknown")
            rec, own = StatsRecorder(stats_path_for(params, self.vllm_config), {
                "base_class": base, "prefix_budget": False,
                "async_scheduling": bool(self.scheduler_config.async_scheduling)}), True
        if rec.path is None:
            raise ValueError(f"{CONTROL_ENV} is set but the plugin has no counters file to "
                             "report the limits in force: set VLLM_STUDY_PB_STATS (or "
                             "prefix_budget.stats_path in --additional-config)")
        return rec, own

    # -- the scheduler thread -----------------------------------------------------------
    def schedule(self, *args, **kwargs):
        if self._kn_path is None:
            return super().schedule(*args, **kwargs)
        with self._kn_lock:  # limits change between steps, never inside one
            out = super().schedule(*args, **kwargs)
            tokens, running = out.total_num_scheduled_tokens, len(self.running)
        self._kn_stats.update_section("knobs", lambda k: k.update(
            steps=k["steps"] + 1, peak_step_tokens=max(k["peak_step_tokens"], tokens),
            peak_running=max(k["peak_running"], running)))
        return out

    def shutdown(self) -> None:
        try:
            super().shutdown()
        finally:
            if self._kn_path is not None:
                self._kn_stop.set()
                self._kn_thread.join(timeout=2)
                if self._kn_own_stats:
                    self._kn_stats.close()

    # -- the watcher thread -------------------------------------------------------------
    def _kn_loop(self) -> None:
        while not self._kn_stop.wait(POLL_S):
            try:
                if self._kn_poll():
                    self._kn_stats.flush()  # answer at once, not at the next 0.2 s write
            except Exception as e:  # the engine must outlive any surprise in the channel
                log.exception("live limits: control channel error")
                self._kn_stats.set_section("knobs", {"status": "error", "reason": repr(e)})

    def _kn_poll(self) -> bool:
        """One look at the control file; True when the knobs section changed."""
        try:
            text = self._kn_path.read_text()
        except FileNotFoundError:
            text = None
        changed = False
        held = len(self.requests)
        if held != self._kn_held:  # the kit's drain check: /metrics moves only when the engine steps
            self._kn_held = held
            self._kn_stats.set_section("knobs", {"requests": held})
            changed = True
        if text is not None and text != self._kn_last_text:
            self._kn_last_text = text
            changed = self._kn_read(text)
        if self._kn_pending is not None:
            changed |= self._kn_try_apply()
        return changed

    def _kn_read(self, text: str) -> bool:
        try:
            msg = parse_control(text)
            seq = message_seq(msg)
        except Refused as e:  # no number to answer to: reported as the channel's error
            self._kn_stats.set_section("knobs", {"control_error": str(e)})
            log.warning("live limits: %s", e)
            return True
        if seq <= self._kn_seq:
            return False  # handled already (or an older message written late)
        self._kn_seq = seq
        try:
            limits = check_message(msg, self._kn_launch, self._kn_chunked)
        except Refused as e:
            self._kn_pending = None  # a newer message supersedes a pending one, refused or not
            self._kn_stats.set_section("knobs", {"seq": seq, "status": "refused",
                                                 "reason": str(e), "control_error": None})
            log.warning("live limits: message %d refused: %s", seq, e)
            return True
        self._kn_pending = (seq, limits)
        self._kn_stats.set_section("knobs", {
            "seq": seq, "status": "pending", "control_error": None,
            "reason": "waiting for the engine to hold no request"})
        return True

    def _kn_try_apply(self) -> bool:
        with self._kn_lock:
            if len(self.requests):  # not idle: a round's requests must not see two limits
                return False
            seq, new = self._kn_pending
            self._kn_pending = None
            self.max_num_scheduled_tokens = min(self._kn_launch_scheduled, new.max_num_batched_tokens)
            self.scheduler_config.max_num_batched_tokens = new.max_num_batched_tokens
            self.scheduler_config.long_prefill_token_threshold = new.long_prefill_token_threshold
            self.max_num_running_reqs = new.max_num_seqs
            if self._kn_launch_active is not None:
                self.max_num_active_reqs = min(self._kn_launch_active, new.max_num_seqs)
            self._kn_stats.set_section("knobs", {
                "in_force": new.to_dict(), "applied_seq": seq, "status": "applied",
                "reason": None, "applied_at": time.time(),
                "steps": 0, "peak_step_tokens": 0, "peak_running": 0})
        log.info("live limits: message %d applied: %s", seq, new)
        return True
