"""The study's `predict:` key: predict every point of the grid from a few measured ones,
then measure the best few and the baseline in real starts until resolved (the study's
`confirm:`). What it needs of the rest of the study is checked here, before anything
starts; the stage itself is predict/study.py.

    predict:
      seed: [defaults, mbt=1024__mns=16]   # point ids measured first ('defaults': the baseline)
      # or seed: 2                          # the baseline and points spread over the grid
      confirm_top: 3                        # the best predicted, measured in real starts
      passes: 2                             # predictions in all: after the top's first starts the model
                                            # is refitted, the grid predicted again, its new top measured
      draws: 3                              # streams of the step model's spread a leading point is
                                            # simulated over (its capacity: their median)
      workers: 4                            # processes predicting at once (default: every core)
"""
from __future__ import annotations

import os
from typing import Annotated

from pydantic import Field

from ..launch.flags import Flags
from .schema import Strict, did_you_mean

DEFAULTS = "defaults"   # a seed: the study's baseline (vLLM's defaults, by the kit's convention)


class Predict(Strict):
    seed: list[Annotated[str, Field(min_length=1)]] | Annotated[int, Field(ge=1)] = [DEFAULTS]
    confirm_top: int = Field(3, ge=1)
    passes: int = Field(2, ge=1)
    draws: int = Field(3, ge=1)
    workers: int | None = Field(None, ge=1)   # None: os.cpu_count()

    @property
    def processes(self) -> int:
        return self.workers or os.cpu_count() or 1


def check(study) -> None:
    """Raise ValueError (naming the key and the fix) where `study` cannot be predicted. (A
    multi_turn workload, which the simulator refuses, has no capacity search: capacity's own
    check refuses it first.)"""
    p = study.predict
    if study.search or study.targets:
        raise ValueError("predict: predicts a grid's points (a search space given as a grid: its axes); "
                         "give the space as `grid:` (leave search/targets out)")
    if not study.capacity:
        raise ValueError("predict: ranks the points by their predicted capacity: it needs `capacity:` (a "
                         "capacity study). Predicting a study's round metrics without one is not supported yet")
    if not study.baseline:
        raise ValueError("predict: measures the best predicted points and the baseline in real starts: name the "
                         "baseline with `baseline:` (a point id as --dry-run lists them, e.g. vLLM's defaults)")
    if not study.confirm:
        raise ValueError("predict: hands its top configs to confirmation until resolved: add `confirm:` "
                         "(e.g. {until: resolved, max_starts: 3})")
    if not study.server.step_records:
        raise ValueError("predict: fits its step-time model from the real starts' step records: remove "
                         "server.step_records: false")
    if "scheduler-cls" in Flags.parse(study.server.extra_cli_args):
        raise ValueError("predict: the simulator steps vLLM's own scheduler (or the kit's Prefix Reuse Budget); "
                         "server.extra_cli_args sets --scheduler-cls, a class it cannot simulate: remove it, or "
                         "leave predict out")
    if isinstance(p.seed, list) and len(set(p.seed)) != len(p.seed):
        raise ValueError(f"predict.seed repeats a point: {p.seed}")


def seed_points(study, point_ids: list[str]) -> list[str]:
    """The seed's point ids in `point_ids` (the grid's order); a count is the baseline and
    points spread evenly over the rest. Raises ValueError naming an unknown id."""
    seed, base = study.predict.seed, study.baseline
    if isinstance(seed, int):
        rest = [p for p in point_ids if p != base]
        n = min(seed - 1, len(rest))
        picked = [rest[round(i * (len(rest) - 1) / max(n - 1, 1))] for i in range(n)] if n else []
        return list(dict.fromkeys([base] + picked))
    ids = [base if s == DEFAULTS else s for s in seed]
    unknown = [s for s in ids if s not in point_ids]
    if unknown:
        raise ValueError(f"predict.seed names {', '.join(map(repr, unknown))}, not a point of the grid"
                         f"{did_you_mean(unknown[0], point_ids)}; its points: {', '.join(point_ids)}")
    return list(dict.fromkeys(ids))
