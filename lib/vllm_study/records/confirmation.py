"""Confirmation until resolved (the study's `confirm:`), as the run folder records it:
after the planned starts, the best config, the runner-up and the baseline get one fresh
start each per shuffled block, judged again after every block, until the best's gain
over the baseline and over the runner-up are both resolved (capacity.estimate.gain: the
ratio's 95% interval, or its bound, excludes 1, with the start-to-start spread measured:
two starts of each, or a spread pooled over the run's points) or confirmation stops for
another reason.

confirm.json in the run folder keeps each block's verdict and the reason it stopped; a
run made without `confirm:` has none, and loads as before. This module is the record;
the verdicts and the next block are analysis/confirmation.py's.
"""
from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel

from .results import RunFolder

CONFIRM = "confirm.json"
RESOLVED = "resolved"
MAX_STARTS = "max starts reached"
BUDGET = "--max-minutes budget"
FAILED = "a start failed"
NOTHING = "nothing to confirm"


class Verdict(BaseModel):
    """The run judged after a block (`block`: the manifest's last block then)."""
    block: int
    best: str | None
    runner_up: str | None
    baseline: str
    starts: dict[str, int]                 # each of the three's completed starts
    over_baseline: str | None = None       # the gain, in words (capacity.fit.Gain)
    over_runner_up: str | None = None
    best_below: bool = False               # the best's capacity is below its lowest load: every point's is
    at_highest: list[str] = []             # of the three, those that met the SLO at the highest load (a bound)
    settled: list[str] = []                # below the lowest load in each of 2+ starts: not started again
    baseline_resolved: bool = False
    runner_up_resolved: bool = False
    best_half_width: float | None = None   # the best's 95% interval, the farther end over its value (None: open)
    precise: bool = True                   # within confirm.half_width (True where none is asked)
    best_bracket_bound: bool = False       # the best's interval is its starts' bracket (capacity.fit.within_bracket)

    @property
    def resolved(self) -> bool:
        """Both gains resolved."""
        return self.baseline_resolved and self.runner_up_resolved

    @property
    def done(self) -> bool:
        """Both gains resolved, and the best's interval within confirm.half_width."""
        return self.resolved and self.precise


class ConfirmRecord(BaseModel):
    planned_blocks: int              # the manifest's blocks before confirmation: later ones are its own
    verdicts: list[Verdict] = []
    stop: str | None = None          # one of the reasons above, with its detail after ": "

    def save(self, run: RunFolder) -> None:
        (run.path / CONFIRM).write_text(self.model_dump_json(indent=2) + "\n")

    @property
    def last(self) -> Verdict | None:
        return self.verdicts[-1] if self.verdicts else None

    def record(self, v: Verdict) -> None:
        """Keep one verdict per block (a resumed run judges a block again: the later stands)."""
        self.verdicts = [x for x in self.verdicts if x.block != v.block] + [v]


def read(path: Path) -> ConfirmRecord | None:
    """The run's confirmation record; None for a run without one."""
    f = Path(path) / CONFIRM
    return ConfirmRecord.model_validate_json(f.read_text()) if f.exists() else None
