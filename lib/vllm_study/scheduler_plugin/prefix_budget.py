"""The Prefix Reuse Budget rule as pure functions: no vLLM, no clock, no state.

A waiting request joins the running batch when the share of its prompt already in
the prefix cache is at least ``min_reuse_ratio``. Requests below it are deferred,
never dropped: they pass once they have been deferred for ``max_defer_ms``, or on a
step where no other waiting request could use the budget instead (the idle rule:
deferring then would only leave the token budget unused).
"""
from __future__ import annotations

import enum
import math
from dataclasses import asdict, dataclass

CONFIG_KEY = "prefix_budget"  # the key inside --additional-config


class Decision(str, enum.Enum):
    """What the plugin does with one waiting request on one scheduling step."""
    RATIO = "ratio"  # cached share >= min_reuse_ratio: passes to vLLM's default scheduling
    AGE = "age"      # below the ratio, but deferred for max_defer_ms already: passes
    IDLE = "idle"    # below the ratio, but no other waiting request is eligible: passes
    DEFER = "defer"  # held back this step

    @property
    def admits(self) -> bool:
        return self is not Decision.DEFER


def decide(cached_share: float, waited_ms: float, others_eligible: bool,
           min_reuse_ratio: float, max_defer_ms: float) -> Decision:
    """The admission rule for one waiting request on one step.

    cached_share: cached prompt tokens / prompt tokens (full blocks only, as vLLM's
        own prefix-cache lookup counts them).
    waited_ms: how long the plugin has deferred this request so far (0 if never).
    others_eligible: whether another waiting request passes on its own this step
        (meets the ratio, reached the age bound, or is not subject to the rule).
    With min_reuse_ratio 0 every request meets the ratio: nothing is ever deferred.
    """
    if cached_share >= min_reuse_ratio:
        return Decision.RATIO
    if waited_ms >= max_defer_ms:
        return Decision.AGE
    if not others_eligible:
        return Decision.IDLE
    return Decision.DEFER


def passes_alone(cached_share: float, waited_ms: float, min_reuse_ratio: float,
                 max_defer_ms: float) -> bool:
    """Whether a request passes whatever else waits: what makes it an 'eligible other'
    for the idle rule of every other waiting request."""
    return decide(cached_share, waited_ms, True, min_reuse_ratio, max_defer_ms).admits


@dataclass(frozen=True)
class Params:
    min_reuse_ratio: float = 0.8   # share of the prompt that must already be cached
    max_defer_ms: float = 500.0    # longest the plugin holds a request back
    stats_path: str | None = None  # where the EngineCore writes its counters (JSON)

    def to_dict(self) -> dict:
        return asdict(self)


def _how_to_set(key: str, example) -> str:
    return (f"set it in --additional-config '{{\"{CONFIG_KEY}\": "
            f"{{\"{key}\": {example}}}}}'")


def _number(section: dict, key: str, default: float) -> float:
    value = section.get(key, default)
    # bool is an int subclass: true/false is a typo for a number here, not 1/0
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{CONFIG_KEY}.{key} must be a finite number, got {value!r}; "
                         + _how_to_set(key, default))
    return float(value)


def params_from_config(additional_config) -> Params:
    """Read and validate the plugin's section of vllm_config.additional_config.

    A missing section gives the defaults. Unknown keys, a ratio outside [0, 1] or a
    negative max_defer_ms raise ValueError naming the key and how to set it: the
    engine then fails at start-up instead of serving with a silently ignored typo.
    """
    if additional_config is None:
        additional_config = {}
    if not isinstance(additional_config, dict):
        # vLLM also allows an object with compute_hash(); this plugin needs a dict
        raise ValueError(f"additional_config must be a JSON object, got "
                         f"{type(additional_config).__name__}; pass --additional-config "
                         f"'{{\"{CONFIG_KEY}\": {{...}}}}'")
    section = additional_config.get(CONFIG_KEY, {})
    if section is None:
        section = {}
    if not isinstance(section, dict):
        raise ValueError(f"additional_config[{CONFIG_KEY!r}] must be a JSON object such as "
                         f"{{\"min_reuse_ratio\": 0.8, \"max_defer_ms\": 500}}, got {section!r}")
    known = {"min_reuse_ratio", "max_defer_ms", "stats_path"}
    unknown = sorted(set(section) - known)
    if unknown:
        raise ValueError(f"unknown key(s) {', '.join(CONFIG_KEY + '.' + k for k in unknown)}; "
                         f"the known keys are {', '.join(sorted(known))}")
    defaults = Params()
    ratio = _number(section, "min_reuse_ratio", defaults.min_reuse_ratio)
    if not 0.0 <= ratio <= 1.0:
        raise ValueError(f"{CONFIG_KEY}.min_reuse_ratio must be in [0, 1] (a share of the "
                         f"prompt), got {ratio}; " + _how_to_set("min_reuse_ratio", 0.8)
                         + " (0 turns deferral off)")
    max_defer = _number(section, "max_defer_ms", defaults.max_defer_ms)
    if max_defer < 0:
        raise ValueError(f"{CONFIG_KEY}.max_defer_ms must be >= 0 (milliseconds), got "
                         f"{max_defer:g}; " + _how_to_set("max_defer_ms", 500)
                         + " (0 turns deferral off)")
    stats_path = section.get("stats_path")
    if stats_path is not None and (not isinstance(stats_path, str) or not stats_path):
        raise ValueError(f"{CONFIG_KEY}.stats_path must be a file path (string), got "
                         f"{stats_path!r}; " + _how_to_set("stats_path", '"/tmp/pb.json"'))
    return Params(min_reuse_ratio=ratio, max_defer_ms=max_defer, stats_path=stats_path)
