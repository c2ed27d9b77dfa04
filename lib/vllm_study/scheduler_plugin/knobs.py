"""Live scheduler limits: the control message and its checks, as pure functions (no
vLLM, no files, no clock).

vLLM's scheduler reads max_num_batched_tokens, max_num_seqs and
long_prefill_token_threshold at every step; only the launch fixes them. A server
started with the plugin and ``CONTROL_ENV`` set takes new values from a small JSON
file the kit writes, so one start can serve several values of these knobs:

    {"seq": 3, "max_num_batched_tokens": 256, "max_num_seqs": 4,
     "long_prefill_token_threshold": 0}

A key left out means its launch value: each message states every limit, whatever came
before. A message is applied only if every value is allowed (``check_message``): at
most the launch value, because what was built at launch (CUDA graphs, torch.compile's
token range, the KV cache sized for max_num_seqs) was built for the launch values and
nothing larger. A message with any wrong value is refused whole; the limits in force
do not change.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass

CONTROL_ENV = "VLLM_STUDY_KNOBS_CONTROL"  # the control file's path, read by the EngineCore
KNOBS = ("max_num_batched_tokens", "max_num_seqs", "long_prefill_token_threshold")


@dataclass(frozen=True)
class Limits:
    max_num_batched_tokens: int
    max_num_seqs: int
    long_prefill_token_threshold: int = 0  # 0: no cap on one request's prefill chunk

    def to_dict(self) -> dict:
        return asdict(self)


class Refused(ValueError):
    """A control message the engine does not apply; its text is the reason."""


def _count(msg: dict, key: str, least: int) -> int:
    value = msg[key]
    # bool is an int subclass: true/false is a typo here, not 1/0
    if isinstance(value, bool) or not isinstance(value, int):
        raise Refused(f"{key} must be an integer, got {value!r}")
    if value < least:
        raise Refused(f"{key} must be >= {least}, got {value}")
    return value


def message_seq(msg) -> int:
    """The sequence number of a control message: the engine handles each number once."""
    if not isinstance(msg, dict) or "seq" not in msg:
        raise Refused(f"a control message is a JSON object with an integer 'seq' >= 1, got {msg!r}")
    return _count(msg, "seq", 1)


def check_message(msg, launch: Limits, chunked_prefill: bool = True) -> Limits:
    """The limits a control message asks for, or Refused naming what is wrong.

    Allowed: 1 <= max_num_seqs <= its launch value; max_num_seqs <= max_num_batched_tokens
    <= its launch value (vLLM's own start-up rule: one token per sequence at least);
    long_prefill_token_threshold 0 (no cap) only if it was 0 at launch, else
    1 <= value <= the launch value (a cap of 0 lifts the launch cap: a larger value).
    Lowering max_num_batched_tokens needs chunked prefill: without it a prompt longer
    than the budget could never be scheduled.
    """
    message_seq(msg)
    unknown = sorted(set(msg) - {"seq", *KNOBS})
    if unknown:
        raise Refused(f"unknown key(s) {', '.join(unknown)}; a control message may set "
                      f"{', '.join(KNOBS)} (and carries 'seq')")
    asked = {k: _count(msg, k, 0 if k == "long_prefill_token_threshold" else 1)
             for k in KNOBS if k in msg}
    new = Limits(**{**launch.to_dict(), **asked})
    for key in ("max_num_batched_tokens", "max_num_seqs"):
        if getattr(new, key) > getattr(launch, key):
            raise Refused(f"{key} {getattr(new, key)} is above its launch value "
                          f"{getattr(launch, key)}: start the server at the largest value a "
                          "study needs, then lower it")
    if new.max_num_batched_tokens < new.max_num_seqs:
        raise Refused(f"max_num_batched_tokens {new.max_num_batched_tokens} is below "
                      f"max_num_seqs {new.max_num_seqs}: vLLM needs at least one token per sequence")
    if not chunked_prefill and new.max_num_batched_tokens != launch.max_num_batched_tokens:
        raise Refused("max_num_batched_tokens can change only with chunked prefill on (the "
                      "server runs without it): a prompt longer than the budget could not run")
    lp, lp0 = new.long_prefill_token_threshold, launch.long_prefill_token_threshold
    if lp0 > 0 and not 1 <= lp <= lp0:
        raise Refused(f"long_prefill_token_threshold {lp} is above its launch value {lp0} "
                      "(0 means no cap, the largest of all): use 1.." + str(lp0))
    return new


def parse_control(text: str):
    """The JSON in a control file, or Refused when it is not JSON."""
    try:
        return json.loads(text)
    except ValueError as e:
        raise Refused(f"the control file is not JSON ({e})") from None
