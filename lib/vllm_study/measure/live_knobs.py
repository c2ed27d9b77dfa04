"""Change a running server's scheduler limits between rounds, and read back what the
engine used (the kit's side of scheduler_plugin/live_limits.py; docs/live-knobs.md).

The server runs the plugin's scheduler (``SCHEDULER_CLS``, or PrefixBudgetScheduler)
with ``launch_env(control, stats)`` in its environment, launched at the largest values
the rounds need. Before a round:

    limits = set_limits(url, stats, control, max_num_batched_tokens=256, max_num_seqs=4)
    ...run the round...
    used = limits_used(stats, limits["seq"])  # raises if the limits changed meanwhile

set_limits waits until the server holds no request, writes the control message, and
returns only once the engine reports that message's limits in force: no round starts
under the wrong limits. A message the engine refuses raises Refused with its reason.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

from . import counters
from ..scheduler_plugin.counters_file import STATS_ENV, read_stats
from ..scheduler_plugin.knobs import CONTROL_ENV, KNOBS, Limits, Refused, check_message

SCHEDULER_CLS = "vllm_study.scheduler_plugin.LiveLimitsScheduler"
POLL_S = 0.05
__all__ = ["SCHEDULER_CLS", "KnobsError", "Refused", "launch_env", "knobs_state", "wait_drained",
           "send_message", "set_limits", "limits_used", "Channel"]


class KnobsError(RuntimeError):
    """The control channel did not answer as it must (no plugin, timeout, mismatch)."""


def launch_env(control_path: str | os.PathLike, stats_path: str | os.PathLike) -> dict[str, str]:
    """The environment a server needs for live limits (the EngineCore inherits it)."""
    return {CONTROL_ENV: str(control_path), STATS_ENV: str(stats_path)}


def knobs_state(stats_path: str | os.PathLike) -> dict:
    """The ``knobs`` section of the plugin's counters file."""
    state = read_stats(stats_path).get("knobs")
    if state is None:
        raise KnobsError(f"{stats_path} has no live-limits section: start the server with "
                         f"--scheduler-cls {SCHEDULER_CLS} and {CONTROL_ENV} in its environment "
                         "(launch_env)")
    return state


def wait_drained(url: str, timeout_s: float = 120.0, api_key: str | None = None,
                 stats_path: str | os.PathLike | None = None) -> None:
    """Until vLLM's /metrics shows no running and no waiting request and, with
    stats_path, the plugin reports the engine holds none (the gauges move only when
    the engine steps; a paused engine holds requests without stepping)."""
    deadline = time.monotonic() + timeout_s
    while True:
        v = counters.scrape(url, api_key)["values"]
        busy = v.get("vllm:num_requests_running", 0) + v.get("vllm:num_requests_waiting", 0)
        if busy == 0 and stats_path is not None:
            busy = knobs_state(stats_path).get("requests", 0)
        if busy == 0:
            return
        if time.monotonic() > deadline:
            raise KnobsError(f"{url} still holds {busy:g} request(s) after {timeout_s:g} s: the "
                             "limits change only between rounds; wait for the round to end (or "
                             "abort its requests) before setting new ones")
        time.sleep(POLL_S)


def _write(control_path: Path, message: dict) -> None:
    # tmp + os.replace: the engine's watcher never reads half a message
    tmp = control_path.with_name(f".{control_path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(message))
    os.replace(tmp, control_path)


def send_message(url: str, stats_path: str | os.PathLike, control_path: str | os.PathLike,
                 message: dict, timeout_s: float = 60.0, drain_timeout_s: float = 120.0,
                 api_key: str | None = None) -> dict:
    """Drain, write ``message`` (its seq is added) and wait for the engine's answer.

    Returns the knobs section once the engine has applied it; raises Refused with the
    engine's reason if it refused, KnobsError on a timeout. The message goes as given:
    set_limits checks it here first.
    """
    state = knobs_state(stats_path)
    wait_drained(url, drain_timeout_s, api_key, stats_path)
    seq = int(state["seq"]) + 1
    _write(Path(control_path), {**message, "seq": seq})
    deadline = time.monotonic() + timeout_s
    while True:
        state = knobs_state(stats_path)
        if state["seq"] == seq and state["status"] == "refused":
            raise Refused(f"the engine refused control message {seq} ({message}): "
                          f"{state['reason']}; the limits in force stay {state['in_force']}")
        if state["seq"] == seq and state["status"] == "applied":
            if state["applied_seq"] != seq:
                raise KnobsError(f"message {seq} reported applied, but the limits in force are "
                                 f"message {state['applied_seq']}'s: {state}")
            return state
        if time.monotonic() > deadline:
            where = (f"the engine has not read it (last handled: {state['seq']}; is "
                     f"{CONTROL_ENV} of the server {control_path}?)" if state["seq"] < seq
                     else f"it is {state['status']}: {state['reason']}")
            raise KnobsError(f"control message {seq} not in force after {timeout_s:g} s: {where}"
                             + (f"; the control file: {state['control_error']}"
                                if state.get("control_error") else ""))
        time.sleep(POLL_S)


def set_limits(url: str, stats_path: str | os.PathLike, control_path: str | os.PathLike,
               *, max_num_batched_tokens: int | None = None, max_num_seqs: int | None = None,
               long_prefill_token_threshold: int | None = None, timeout_s: float = 60.0,
               drain_timeout_s: float = 120.0, api_key: str | None = None) -> dict:
    """The limits for the next round (None: the launch value); returns those in force
    with the control message's ``seq``, as the engine reports them."""
    asked = {k: v for k, v in zip(KNOBS, (max_num_batched_tokens, max_num_seqs,
                                          long_prefill_token_threshold)) if v is not None}
    state = knobs_state(stats_path)
    # The engine's own check, here first: a wrong value fails before any wait or write
    check_message({"seq": 1, **asked}, Limits(**state["launch"]), state.get("chunked_prefill", True))
    state = send_message(url, stats_path, control_path, asked, timeout_s, drain_timeout_s, api_key)
    expected = {**state["launch"], **asked}
    if state["in_force"] != expected:
        raise KnobsError(f"the engine reports {state['in_force']} in force, not {expected}")
    return {"seq": state["applied_seq"], **state["in_force"]}


def limits_used(stats_path: str | os.PathLike, seq: int) -> dict:
    """After a round: the limits the engine ran it under, with what it did (steps, its
    largest step in tokens, most running requests) since message ``seq`` was applied.
    Raises if another message was applied since: the round did not run under one set."""
    state = knobs_state(stats_path)
    if state["applied_seq"] != seq:
        raise KnobsError(f"the limits changed during the round: message {state['applied_seq']} "
                         f"is in force, the round started under message {seq}")
    return {"seq": seq, **state["in_force"], "steps": state["steps"],
            "peak_step_tokens": state["peak_step_tokens"], "peak_running": state["peak_running"]}


class Channel:
    """The control channel of one server start that serves several points (the sweep's
    live knobs): before each round its point's limits, in force; after it, the limits
    the engine ran it under. `url` (and `api_key`) are the server's, once it is up."""

    def __init__(self, stats_path: str | os.PathLike, control_path: str | os.PathLike):
        self.stats, self.control = Path(stats_path), Path(control_path)
        self.url: str | None = None
        self.api_key: str | None = None

    def env(self) -> dict[str, str]:
        return launch_env(self.control, self.stats)

    def enter(self, limits: dict[str, int | None]) -> dict:
        """Set `limits` (None: the launch value) for the next round; raises Refused or
        KnobsError rather than let a round run under other limits."""
        return set_limits(self.url, self.stats, self.control, api_key=self.api_key, **limits)

    def used(self, entered: dict) -> dict:
        return limits_used(self.stats, entered["seq"])
