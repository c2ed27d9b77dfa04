"""A configuration search's space and settings, as the study file writes them: integer and
float ranges, conditions between dimensions, the sampler and the trial budget
(search/config_search.py runs it)."""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (Discriminator, Field, Tag,
                      model_validator)

from .schema import EngineArgs, Strict, did_you_mean


# -- a search instead of a grid (config_search.py) --------------------------------------
def _low_below_high(kind: str, pair: tuple):
    if pair[0] >= pair[1]:
        raise ValueError(f"{kind} range {list(pair)} needs low < high")
    return pair


class IntRange(Strict):
    """Whole numbers from low to high: {int: [256, 8192], log: true} or {int: [8, 256], step: 8}."""
    int: tuple[int, int]
    log: bool = False
    step: int = Field(1, ge=1)

    @model_validator(mode="after")
    def _ok(self):
        lo, hi = _low_below_high("int", self.int)
        if self.log and (lo < 1 or self.step != 1):
            raise ValueError("a log-scaled int range needs low >= 1 and no step (Optuna's rule)")
        return self


class FloatRange(Strict):
    """Reals from low to high on a grid of `step` (point ids show two decimals, so the
    default step is 0.01): {float: [0.80, 0.95], step: 0.05}."""
    float: tuple[float, float]
    step: float = Field(0.01, gt=0)

    @model_validator(mode="after")
    def _ok(self):
        _low_below_high("float", self.float)
        return self


def _dimension_form(value) -> str:
    """Which form a knob's values take, read off its keys: a mistake in one form is then
    reported against that form alone, not against every member of the union."""
    if isinstance(value, (IntRange, FloatRange)):
        return type(value).__name__
    if isinstance(value, dict):
        return "FloatRange" if "float" in value else "IntRange"
    return "list"


# A knob's values: a list (categorical: no order assumed), or an int or float range.
Dimension = Annotated[Annotated[IntRange, Tag("IntRange")] | Annotated[FloatRange, Tag("FloatRange")]
                      | Annotated[list[Any], Tag("list")], Discriminator(_dimension_form)]
CONDITION = r"^\s*([A-Za-z_]\w*|[-+]?\d+(?:\.\d+)?)\s*(<=|>=|==|!=|<|>)\s*([A-Za-z_]\w*|[-+]?\d+(?:\.\d+)?)\s*$"
SAMPLERS = ("tpe", "random", "gp", "qmc", "nsga2")


class Search(Strict):
    """Search a space of engine arguments instead of measuring a grid: `trials`
    configurations measured (or until `minutes`), each one Optuna's `sampler` proposes from
    what the earlier ones measured, judged by `objective` (capacity_rps in a capacity
    study; otherwise any metric with a direction). Then the `top_k` best and vLLM's
    defaults get `confirm_starts` fresh server starts each, in shuffled blocks: the
    decision rests on those, not on one lucky trial. `when`: conditions a configuration
    must meet before it starts ("max_num_seqs <= max_num_batched_tokens"); vLLM's own
    rules are checked too. `first`: configurations to try before the sampler's own.
    `live_batch`: with live knobs on, one start serves up to that many trials that
    differ only in live scheduler limits (config_search.TrialSource)."""
    space: dict[str, Dimension]
    when: list[str] = []
    objective: str | None = None
    direction: Literal["maximize", "minimize"] | None = None
    trials: int = Field(20, ge=2)
    minutes: float | None = Field(None, gt=0)
    sampler: Literal[SAMPLERS] = "tpe"
    startup_trials: int | None = Field(None, ge=1, description="random trials before the model-based "
                                       "sampler takes over (default: a third of the trials, 2 to 10)")
    seed: int = 0
    first: list[dict[str, Any]] = []
    top_k: int = Field(3, ge=1)
    confirm_starts: int = Field(3, ge=1)
    live_batch: int = Field(3, ge=1, description="trials one server start measures where live knobs are on "
                            "(server.live_knobs): the sampler's proposal, then proposals that differ from it only "
                            "in the limits the kit's plugin changes at runtime; 1: a start a trial")

    @model_validator(mode="after")
    def _check(self):
        import re
        known = set(EngineArgs.model_fields)
        if not self.space:
            raise ValueError("search.space is empty: name at least one engine argument and its values")
        for name, dim in self.space.items():
            if name not in known:
                raise ValueError(f"search.space: {name!r} is not an engine argument the kit knows"
                                 f"{did_you_mean(name, known)}; knobs: {', '.join(sorted(known))}")
            if isinstance(dim, list) and (len(dim) < 2 or len(set(map(repr, dim))) != len(dim)):
                raise ValueError(f"search.space.{name}: a list needs two or more distinct values (got {dim})")
        for cond in self.when:
            m = re.match(CONDITION, cond)
            if not m:
                raise ValueError(f"search.when: {cond!r} is not a comparison the kit reads; write "
                                 "<knob or number> <op> <knob or number>, e.g. max_num_seqs <= max_num_batched_tokens")
            for side in (m.group(1), m.group(3)):
                if side[0].isalpha() or side[0] == "_":
                    if side not in known:
                        raise ValueError(f"search.when: {side!r} in {cond!r} is not an engine argument"
                                         f"{did_you_mean(side, known)}")
        for i, cfg in enumerate(self.first):
            extra = set(cfg) - set(self.space)
            if extra:
                raise ValueError(f"search.first[{i}]: {sorted(extra)} not in search.space; a first "
                                 "configuration gives values of the space's knobs")
        from ..vocab.metrics import REGISTRY  # metrics imports pandas; the CLI reads a study before it needs it
        if self.objective is not None:
            if self.objective not in REGISTRY:
                raise ValueError(f"search.objective {self.objective!r} is not a metric the kit reports"
                                 f"{did_you_mean(self.objective, REGISTRY)}")
            if self.direction is None and REGISTRY[self.objective].better is None:
                raise ValueError(f"search.objective {self.objective!r} has no better direction; "
                                 "set search.direction: maximize or minimize")
        return self

    @property
    def goal(self) -> str:
        """maximize or minimize: search.direction, else the objective's better direction."""
        from ..vocab.metrics import get  # metrics imports pandas; the CLI reads a study before it needs it
        return self.direction or ("maximize" if get(self.objective).better == "higher" else "minimize")

    @property
    def n_startup(self) -> int:
        return self.startup_trials or max(2, min(10, self.trials // 3))
