"""A search's part of the report: what its trials did, which knobs mattered, and the
decision, read from the confirmation starts (report.Run.load keeps only those in
`rounds`; the trials are in `trial_rounds` and in the run's Optuna journal)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from ..analysis import intervals
from ..vocab import metrics
from .config_search import JOURNAL, TRIAL_BLOCK, feasible
from ..define.grid import DEFAULTS_POINT
from ..vocab.figure_file import save_figure


NOT_CONFIRMED = ("Nothing is decided yet: the confirmation starts have not run (the trials' own starts are not "
                 "used to decide). Continue the search with `python -m vllm_study sweep --resume {run}`.")


def journal_study(r):
    """The run's Optuna study, read from its journal (None where the run has none)."""
    import optuna
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend
    path = r.folder.path / JOURNAL
    if not path.exists():
        return None
    return optuna.load_study(study_name=r.manifest.study, storage=JournalStorage(JournalFileBackend(str(path))))


def _kind(t) -> str:
    """What became of one proposal."""
    a = t.user_attrs
    if "rejected" in a:
        return "refused before start"
    if "like_crashed" in a:
        return "not started: like a crash"
    if "repeat_of" in a:
        return "not started: measured already"
    if "failed" in a:
        return "failed"
    if t.state.name == "RUNNING":
        return "running"
    return "measured" if feasible(t) else "measured, SLO missed"


def trials_frame(r) -> pd.DataFrame:
    """One row per proposal: its number, point, what became of it, the objective, why."""
    study = journal_study(r)
    if study is None:
        return pd.DataFrame()
    objective = r.search.objective
    rows = []
    for t in study.get_trials(deepcopy=False):
        a = t.user_attrs
        note = a.get("failed") or a.get("rejected") or a.get("like_crashed") or a.get("repeat_of") or \
            a.get("drawn_at_random") or ""
        rows.append({"trial": t.number, "point": a.get("point", ""), "what became of it": _kind(t),
                     objective: t.value, "note": note[:200]})
    return pd.DataFrame(rows)


def trials_table(r, below: str | None = None) -> pd.DataFrame | None:
    """The trials that started a server, in order (the refused and the skipped are counted
    in the answer and listed in the journal). In a capacity search each trial's capacity
    is capacity.estimate's estimate over its own start, as the rest of the report
    states capacities ('5.39 [4.80, 6.05]', or the bound '< 3.08' / '≥ 9.25' that bounds
    it). `below`: what a trial with no capacity record that missed the SLO at the lowest
    load shows (capacity_section.below_lowest_load: its 0 is a bound, not a value)."""
    df = trials_frame(r)
    if df.empty:
        return None
    started = df[df["point"] != ""].copy()
    m = metrics.get(r.search.objective)
    fitted = trial_capacities(r) if m.name in ("capacity_rps", "capacity_load") else {}
    unit = "rps" if m.name == "capacity_rps" else "load"
    started[m.name] = [fitted[p].cell(unit) if fitted.get(p) is not None else
                       ("" if pd.isna(v) else below if below and kind == "measured, SLO missed" else format(v, m.fmt))
                       for p, v, kind in zip(started["point"], started[m.name], started["what became of it"])]
    return started.set_index("trial")


def trial_capacities(r) -> dict:
    """Each trial's capacity (capacity.estimate) over the one start it ran as a trial;
    {} outside a capacity study."""
    from ..records.point_capacity import point_capacities
    if not r.study.capacity:
        return {}
    trial_start = {p: u.start for u in r.manifest.order if u.block == TRIAL_BLOCK for p in u.points}
    folders = {p: (r.folder.point(p), {k}) for p, k in trial_start.items() if r.folder.point(p).path.exists()}
    return point_capacities(folders, r.study.capacity.slo, r.study.capacity.lo)


def counts(r) -> dict[str, int]:
    df = trials_frame(r)
    return df["what became of it"].value_counts().to_dict() if not df.empty else {}


def _difference(r, a: str, b: str) -> intervals.Difference | None:
    data = intervals.MetricData.from_rounds(r.rounds, r.search.objective)
    if data is None or a not in data.starts or b not in data.starts:
        return None
    return intervals.difference(data, a, b)


def _change(d: intervals.Difference, m: metrics.Metric) -> str:
    if not (np.isfinite(d.low) and np.isfinite(d.high)):
        shown = f"{d.estimate:+.1%}" if d.relative else f"{d.estimate:+{m.fmt[1:]}}"
        return f"{shown} (no interval: too few starts and rounds to measure a spread)"
    if d.relative:
        return f"{d.estimate:+.1%} [{d.low:+.1%}, {d.high:+.1%}]"
    return f"{d.estimate:+{m.fmt[1:]}} [{d.low:+{m.fmt[1:]}}, {d.high:+{m.fmt[1:]}}] {m.unit}".rstrip()


def best(r) -> str | None:
    """The confirmed point with the best objective (its confirmation starts' value) among
    those whose confirmation starts all completed and that meet the SLO (else may meet it:
    none surely does); vLLM's defaults are confirmed whatever their SLO, so they compete
    on the same terms. None where no such point was measured."""
    m = metrics.get(r.search.objective)
    iv = r.intervals[r.intervals["metric"] == m.name] if not r.intervals.empty else pd.DataFrame()
    if iv.empty:
        return None
    ok = {s.point for s in r.summaries if s.status == "ok"}
    candidates = [p for p in iv["point"] if p in ok]
    if r.slo:
        verdicts = slo_verdicts(r)
        candidates = ([p for p in candidates if verdicts.get(p) == "meets"]
                      or [p for p in candidates if verdicts.get(p) == "not resolved"])
    if not candidates:
        return None
    iv = iv[iv["point"].isin(candidates)]
    row = iv.loc[iv["value"].idxmax() if r.search.goal == "maximize" else iv["value"].idxmin()]
    return str(row["point"])


def slo_verdicts(r) -> dict[str, str]:
    """Each confirmed point's SLO verdict in its confirmation starts (meets, misses, not
    resolved); {} without an SLO."""
    t = r.slo_verdicts()
    return t["SLO"].to_dict() if "SLO" in t else {}


def summary_line(r) -> str:
    """What the search did, in one paragraph."""
    s = r.search
    c = counts(r)
    started = sum(v for k, v in c.items() if k in ("measured", "measured, SLO missed", "failed", "running"))
    starts = sum(u.block == TRIAL_BLOCK for u in r.manifest.order)
    shared = (f"measured in {starts} server start{'s' * (starts != 1)} (live knobs: a start served up to "
              f"{s.live_batch} trials that differ only in live scheduler limits)")
    parts = [f"A search over {', '.join(s.space)} ({s.sampler}, objective {s.objective}): {started} trials "
             + ("started a server" if starts >= started else shared)]
    for kind, words in (("failed", "failed"), ("measured, SLO missed", "missed the SLO"),
                        ("refused before start", "more were refused before they started (vLLM's rules or "
                                                 "`when:`)"),
                        ("not started: like a crash", "more were not started as like a crashed one"),
                        ("not started: measured already", "more proposed a configuration already measured")):
        if c.get(kind):
            parts.append(f"{c[kind]} {words}")
    top = [u.point for u in r.manifest.order if u.block > TRIAL_BLOCK and u.point != DEFAULTS_POINT]
    top = list(dict.fromkeys(top))
    n = s.confirm_starts
    return ("; ".join(parts) + f". The best {len(top)} and vLLM's defaults ({DEFAULTS_POINT}) were then started "
            f"{n} more time{'s' * (n != 1)} each; the answer below rests on those starts only (a trial's own "
            "start was picked for looking good).")


def objective_lines(r) -> list[str]:
    """The decision by the search's objective (capacity studies say it through
    capacity_section.capacity_answer): the best with its interval, then each other confirmed point
    and vLLM's defaults against it."""
    m = metrics.get(r.search.objective)
    top = best(r)
    verdicts = slo_verdicts(r)
    if top is None:
        if verdicts:
            return ["No confirmed configuration, vLLM's defaults included, may meet the SLO with all its "
                    "confirmation starts complete: " + ", ".join(f"{p} {v}" for p, v in verdicts.items()) + "."]
        return [f"No confirmation start measured {m.name}."]
    slo_words = {"meets": "", "not resolved": ", SLO not resolved", "misses": ", misses the SLO"}
    lines = [f"{top}: {m.label} {metrics.with_interval(r.interval(top, m.name), m)} {m.unit}".rstrip()
             + (" (none surely meets the SLO)" if verdicts.get(top) == "not resolved" else "") + "."]
    for s in r.summaries:
        if s.point == top:
            continue
        d = _difference(r, s.point, top)
        if d is None:
            lines.append(f"{s.point}: not measured in its confirmation starts.")
            continue
        verdict = "not told apart from it" if not d.resolved else d.verdict()
        verdict += slo_words.get(verdicts.get(s.point), "")
        who = "vLLM's defaults" if s.point == DEFAULTS_POINT else s.point
        lines.append(f"{who} ({s.point}) against it: {_change(d, m)}, {verdict}." if who != s.point else
                     f"{s.point} against it: {_change(d, m)}, {verdict}.")
    return lines


def best_so_far(values: pd.Series, goal: str) -> pd.Series:
    """The best feasible objective up to each trial; a trial without one (failed, SLO
    missed: NaN) leaves it as it was (cummax alone gives NaN there, a gap in the line)."""
    return (values.cummax() if goal == "maximize" else values.cummin()).ffill()


def history_figure(r, out: Path | None = None, below_at: float | None = None) -> str | None:
    """The objective over the trials (failed trials marked at the bottom, the best
    feasible so far as a line) beside Optuna's parameter importances. `below_at`: in a
    capacity search, the lowest load's rate: a trial that missed the SLO there is drawn
    under it (its capacity is below it, not 0). Returns why not where nothing can be drawn."""
    import matplotlib.pyplot as plt
    df = trials_frame(r)
    if df.empty:
        return "no search journal in this run"
    obj = r.search.objective
    m = metrics.get(obj)
    started = df[df["point"] != ""].reset_index(drop=True)
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 3.6), width_ratios=[3, 2])
    x = np.arange(1, len(started) + 1)
    kinds = started["what became of it"]
    ok = kinds == "measured"
    ax.scatter(x[ok], started[obj][ok], color="tab:blue", label="measured", zorder=3)
    miss = kinds == "measured, SLO missed"
    if below_at is not None:
        ax.scatter(x[miss], [below_at] * int(miss.sum()), marker="v", color="grey", zorder=3,
                   label=f"SLO missed at the lowest load: below {below_at:.3g}")
    else:
        ax.scatter(x[miss], started[obj][miss], facecolors="none", edgecolors="grey", label="SLO missed", zorder=3)
    failed = kinds == "failed"
    # a failed start at the bottom: the lowest load in a capacity search (not a censored trial's 0)
    low = below_at if below_at is not None else np.nanmin(started[obj]) if started[obj].notna().any() else 0
    ax.scatter(x[failed], [low] * int(failed.sum()), marker="x", color="tab:red", label="failed start", zorder=3)
    vals = started[obj].where(ok)
    ax.step(x, best_so_far(vals, r.search.goal), where="post", color="tab:blue", alpha=0.5, label="best so far")
    ax.set_xticks(x, [str(t) for t in started["trial"]])  # the numbers the trial table shows
    ax.set_xlabel("trial, in the order started (a refused one never started)")
    ax.set_ylabel(f"{m.label} ({m.unit})" if m.unit else m.label)
    ax.legend(fontsize=8, loc="best")
    ax.set_title("the search, trial by trial", fontsize=10)
    imp = importances(r)
    if imp:
        names = list(imp)[::-1]
        bx.barh(names, [imp[n] for n in names], color="tab:green")
        bx.set_xlabel("importance (Optuna, PED-ANOVA; sums to 1)")
        n = len(_measured_trials(journal_study(r)))
        bx.set_title(f"which knobs mattered, over {n} measured trials"
                     + ("\n(few: where the sampler looked, not an effect)" if n < FEW_TRIALS else ""), fontsize=10)
    else:
        bx.axis("off")
        bx.text(0.5, 0.5, "too few measured trials\nfor parameter importances", ha="center", va="center")
    fig.tight_layout()
    if out:
        save_figure(fig, out, dpi=100)
    return None


# Below this many measured trials the importances are read as where the sampler looked: a
# knob TPE stopped varying early gets little weight whatever its effect, and no interval is
# given. (Tuners built on Optuna advise 30-150 trials for one objective; 20 is a loose floor.)
FEW_TRIALS = 20


def _measured_trials(study) -> list:
    """The trials of the run's Optuna study (journal_study; None: no journal) that the
    importances are computed over: each started a server and measured the objective (an
    SLO missed included)."""
    import optuna
    if study is None:
        return []
    return [t for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
            if "point" in t.user_attrs]


def importance_caveat(r) -> str:
    """What the importances rest on, for the figure's caption."""
    n = len(_measured_trials(journal_study(r)))
    words = f"over the {n} measured trial{'s' * (n != 1)}"
    if n < FEW_TRIALS:
        words += (f": with fewer than {FEW_TRIALS} they say where the sampler looked, not which knob has an "
                  "effect (they have no interval; the confirmation starts decide)")
    return words


def importances(r) -> dict[str, float]:
    """Optuna's parameter importances over the measured trials ({} where it cannot say:
    too few trials, or every one measured the same)."""
    import optuna
    study = journal_study(r)
    if len(_measured_trials(study)) < 3:
        return {}
    try:
        return optuna.importance.get_param_importances(study)
    except (ValueError, RuntimeError, ZeroDivisionError):
        return {}
