"""A run folder read for the report: its manifest, point summaries, rounds and intervals,
and the SLO it is judged against."""
from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np
import pandas as pd

from ..analysis import decision, intervals as analysis
from ..vocab.axes import SCHEDULER_AXIS
from ..define import grid_spec
from ..define.search_space import Search
from ..define.params import Study
from ..define.schema import StudyError
from ..define.study_file import study_from_dict
from ..capacity.estimate import PointCapacity
from ..records.point_capacity import point_capacities
from ..records.results import Manifest, PointSummary, RunFolder


@dataclass
class Run:
    folder: RunFolder
    manifest: Manifest
    summaries: list[PointSummary]
    rounds: pd.DataFrame            # summary.csv: one row per point x start x round x group
    intervals: pd.DataFrame         # analysis.point_intervals: point x metric

    slo_override: dict[str, float] | None = None   # an SLO given at report time (parse_slo)
    trial_rounds: pd.DataFrame | None = None        # a search: its trials' rounds (one start each)

    @classmethod
    def load(cls, folder: RunFolder | str | Path, slo: dict[str, float] | None = None) -> "Run":
        """A search's Run is its confirmation: the points started again and their fresh
        starts only (the trials' own starts were selected for looking good); its trials
        are in trial_rounds."""
        folder = folder if isinstance(folder, RunFolder) else RunFolder(folder)
        rounds = pd.read_csv(folder.summary_csv) if folder.summary_csv.exists() else folder.rounds_table()
        run = cls(folder, folder.manifest(), folder.summaries(), rounds, pd.DataFrame(), slo or None)
        if run.search:
            from ..search.config_search import TRIAL_BLOCK
            confirmed = {u.point for u in run.manifest.order if u.block > TRIAL_BLOCK}
            run.trial_rounds = rounds[rounds["block"] == TRIAL_BLOCK] if not rounds.empty else rounds
            run.rounds = rounds[rounds["block"] > TRIAL_BLOCK] if not rounds.empty else rounds
            run.summaries = [s for s in run.summaries if s.point in confirmed]
        if run.study.capacity and not run.rounds.empty:
            run.rounds = _windows_at_capacity(_censored_as_missing(run.rounds, folder), folder)
        run.intervals = analysis.point_intervals(run.rounds)
        if run.study.capacity:
            run.intervals = _fitted_capacity(run)
        return run

    def capacity(self, point: str) -> PointCapacity | None:
        """The point's capacity over its completed searches (its confirmation starts, in a
        search): capacity.estimate's fit, with its interval, or a bound."""
        return self.capacities.get(point)

    @cached_property
    def capacities(self) -> dict[str, PointCapacity | None]:
        """Every point's capacity (records.point_capacities: the spread pooled over them);
        none outside a capacity study."""
        if not self.study.capacity:
            return {}
        folders = {}
        for s in self.summaries:
            starts = None
            if self.search:   # the confirmation's starts only, as the rounds are
                rows = self.rounds[self.rounds["point"] == s.point] if not self.rounds.empty else self.rounds
                starts = {int(k) for k in rows["start"].unique()} if len(rows) else set()
            folders[s.point] = (self.folder.point(s.point), starts)
        return point_capacities(folders, self.study.capacity.slo, self.study.capacity.lo)

    @cached_property
    def study(self) -> Study:
        """The study as today's kit reads it. Every committed run's manifest validates as it
        is: fields added since take their defaults, and params reads the older layouts'
        spellings itself (unset SLO bounds as null). Validation reads no
        file (a trace's path is only made absolute), so runs made elsewhere load here."""
        return study_from_dict(self.manifest.params, source=str(self.folder.manifest_path))

    @property
    def search(self) -> Search | None:
        return self.study.search

    @property
    def baseline(self) -> str | None:
        """The point every other is compared with: the study's `baseline`; for a search,
        vLLM's defaults."""
        if self.search:
            from ..define.grid import DEFAULTS_POINT
            return DEFAULTS_POINT
        return self.study.baseline

    def interval(self, point: str, metric: str) -> dict | None:
        return interval_row(self.intervals, point, metric)

    @property
    def axes(self) -> list[str]:
        """The grid's axes as the points have them: the study's grid, and the scheduler axis
        that grid.expand adds where a study sweeps the Prefix Reuse Budget's ratios."""
        grid = list(grid_spec.axes(self.study.grid) or (self.search.space if self.search else {}))
        return grid + [SCHEDULER_AXIS] if any(SCHEDULER_AXIS in s.values for s in self.summaries) else grid

    @property
    def slo(self) -> dict[str, float]:
        """The SLO given at report time, else the study's."""
        return self.slo_override or dict(self.study.slo)

    def recommendation(self, slo: dict[str, float] | None = None):
        """decision.recommend on this run: under `slo` (default: the report's), with the
        capacities. The rounds' goodput was counted against the study's own SLO at
        measurement time: under another (one given at report time) it ranks nothing."""
        slo = self.slo if slo is None else slo
        return decision.recommend(self.rounds, self.intervals, slo, self.capacities,
                                  goodput_counts=slo == dict(self.study.slo) or not slo)

    def slo_verdicts(self, slo: dict[str, float] | None = None) -> pd.DataFrame:
        """decision.slo_table on this run: points not ok, and points with failed requests,
        never meet it. Empty without an SLO or a measured interval."""
        slo = self.slo if slo is None else slo
        if not slo or self.intervals.empty:
            return pd.DataFrame()
        return decision.slo_table(self.intervals, slo, [s.point for s in self.summaries if s.status != "ok"],
                                  decision.failed_requests(self.rounds))

    @property
    def measured(self) -> list[PointSummary]:
        """Points with at least one measured round (ok or partial); a search's: in its
        confirmation starts (a summary also counts the point's trial start)."""
        done = [s for s in self.summaries if s.estimates and s.status in ("ok", "partial")]
        if self.search:
            confirmed = set(analysis.ok_rounds(self.rounds)["point"]) if not self.rounds.empty else set()
            done = [s for s in done if s.point in confirmed]
        return done


def parse_slo(text: str) -> dict[str, float]:
    """'ttft_p90_ms=2500,itl_p90_ms=100' (or with ':') -> bounds, checked as a study's slo: is.
    The one parser of report's and export's --slo: a bad one is a StudyError (the CLI's exit 2)."""
    from ..define.params import check_slo
    if not text.strip():
        return {}
    try:
        bounds = {k.strip(): float(v) for k, v in (re.split("[=:]", part, maxsplit=1) for part in text.split(","))}
    except ValueError:
        raise StudyError(f"--slo {text!r}: write it as metric=bound pairs, "
                         "e.g. ttft_p90_ms=2500,itl_p90_ms=100") from None
    try:
        return check_slo(bounds)
    except ValueError as e:
        raise StudyError(f"--slo {text!r}: {e}") from None


def _censored_as_missing(rounds: pd.DataFrame, folder: RunFolder) -> pd.DataFrame:
    """A start that missed the SLO even at its lowest load has no capacity: runs written
    before it was a bound recorded 0 in summary.csv; it is no value (capacity.estimate
    states it as a bound)."""
    if "at_capacity" not in rounds:
        return rounds
    rounds = rounds.copy()
    for pid in rounds["point"].unique():
        for st in folder.point(pid).starts():
            if st.capacity and st.capacity.censored == "below":
                at = (rounds["point"] == pid) & (rounds["start"] == st.start) & (rounds["at_capacity"] == True)  # noqa: E712
                rounds.loc[at, [c for c in ("capacity_rps", "capacity_load") if c in rounds]] = np.nan
    return rounds


def _windows_at_capacity(rounds: pd.DataFrame, folder: RunFolder) -> pd.DataFrame:
    """trace.windows: a capacity step measures every window at its load, one round each,
    and is judged on their requests pooled; summary.csv marks only the step's first round
    (window 1) at capacity. Every window's round of the step is its figures at capacity:
    the start's value is then the median over its windows (report.capacity_section shows
    the hit rate, which differs by window by design, per window)."""
    if "at_capacity" not in rounds or "window" not in rounds or not rounds["window"].notna().any():
        return rounds
    rounds = rounds.copy()
    for pid in rounds["point"].unique():
        for st in folder.point(pid).starts():
            c = st.capacity
            if not c or c.at_round is None:
                continue
            firsts = sorted(s["round"] for s in c.steps if s.get("round") is not None)
            nxt = next((f for f in firsts if f > c.at_round), np.inf)
            mine = (rounds["point"] == pid) & (rounds["start"] == st.start)
            load = rounds.loc[mine & (rounds["round"] == c.at_round), "load"]
            if load.empty:
                continue
            step = mine & (rounds["round"] >= c.at_round) & (rounds["round"] < nxt) & \
                np.isclose(rounds["load"].astype(float), float(load.iloc[0]))
            rounds.loc[step, "at_capacity"] = True
    return rounds


def _fitted_capacity(r: Run) -> pd.DataFrame:
    """The intervals frame with each point's capacity (req/s and the search's unit) from
    capacity.estimate: its value and 95% interval (an end beyond the loads measured
    is open: nan); a point whose capacity is a bound has no row (the tables state it)."""
    iv = r.intervals
    keep = ~iv["metric"].isin(["capacity_rps", "capacity_load"]) if not iv.empty else []
    rows = []
    for pid in dict.fromkeys(r.rounds["point"]) if not r.rounds.empty else []:
        pc = r.capacity(pid)
        if pc is None or pc.config.kind != "value":
            continue
        c = pc.config
        scales = {"capacity_load": lambda v: v}
        if pc.rps_per_load:
            scales["capacity_rps"] = pc.rps
        elif not iv.empty:   # closed loop: req/s is the throughput measured at capacity, kept as it was
            keep = keep | (iv["metric"] == "capacity_rps")
        for name, f in scales.items():
            rows.append({"point": pid, "metric": name, "value": f(c.value),
                         "ci_low": f(c.low) if c.low is not None else np.nan,
                         "ci_high": f(c.high) if c.high is not None else np.nan,
                         "next_start_low": np.nan, "next_start_high": np.nan, "starts": c.starts,
                         "rounds": c.starts, "scale": "log", "df": np.nan, "method": "capacity fit"})
    out = iv[keep] if not iv.empty else iv
    return pd.concat([out, pd.DataFrame(rows, columns=analysis.INTERVAL_COLUMNS)], ignore_index=True) \
        if rows else out.reset_index(drop=True)


def interval_row(iv: pd.DataFrame, point: str, metric: str) -> dict | None:
    """One point x metric row of an intervals frame, or None."""
    if iv.empty:
        return None
    row = iv[(iv["point"] == point) & (iv["metric"] == metric)]
    return row.iloc[0].to_dict() if len(row) else None


def per_start_work(s: Study) -> str:
    c = s.capacity
    if not c:
        return f"{s.rounds} rounds"
    bounds = ", ".join(f"{k} <= {v:g}" for k, v in c.slo.items())
    return f"a capacity search over {c.over} {c.lo:g}..{c.hi:g} (at most {c.max_steps} rounds) under {bounds}"


def planned_words(study: Study, s: PointSummary) -> str:
    """'2 of its 3 planned rounds', or in a capacity study, where a start's figures are one
    search of up to steps_per_start rounds: '0 of its 1 planned capacity searches (one a
    server start, each up to 6 rounds)'."""
    if not study.capacity:
        return f"{s.rounds_ok} of its {s.rounds_planned} planned rounds"
    n = s.rounds_planned
    return (f"{s.rounds_ok} of its {n} planned capacity search{'es' * (n != 1)} (one a server start, each up "
            f"to {study.steps_per_start} rounds)")


def status_label(s: PointSummary) -> str:
    if s.status == "partial":
        return f"partial {s.rounds_ok}/{s.rounds_planned}"
    return s.status
