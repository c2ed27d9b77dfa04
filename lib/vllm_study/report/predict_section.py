"""The report's section for a `predict:` study (predict/study.py): for every measured
config, its predicted capacity beside its measured one, both with their intervals; a
prediction outside its measured interval flagged; the rank agreement of the two orders
(Kendall's tau) over the measured configs; and the model's error so far.

    section = predicted_vs_measured(run_path, capacities)   # None: the run predicted nothing
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
from scipy import stats

from ..capacity.fit import ConfigCapacity
from ..predict import study as predicted


def outside(value: float, measured: ConfigCapacity, censored: str | None = None) -> bool | None:
    """Whether a predicted capacity contradicts the measured one: a value outside the
    measured interval (or on the wrong side of a measured bound); a predicted bound
    (`censored` "below": the capacity is under `value`; "above": at least `value`) only
    where no capacity it allows lies in the measured interval. None where the measured
    starts disagree (no interval to lie in)."""
    if measured.kind == "unresolved":
        return None
    lo, hi = {"below": (None, measured.value), "at_least": (measured.value, None)}.get(
        measured.kind, (measured.low, measured.high))
    if censored == "below":     # predicted: somewhere under value
        return lo is not None and value <= lo
    if censored == "above":     # predicted: value or more
        return hi is not None and value >= hi
    if measured.kind == "below":
        return value >= measured.value
    if measured.kind == "at_least":
        return value < measured.value
    return (lo is not None and value < lo) or (hi is not None and value > hi)


def _interval(low, high) -> str:
    if low is None and high is None:
        return "no interval (no error measured yet)"
    return f"[{'below' if low is None else f'{low:.3g}'}, {'above' if high is None else f'{high:.3g}'}]"


def _predicted_words(p: predicted.PointPrediction) -> str:
    if p.censored == "above":
        return f"at least {p.value:.3g}"
    if p.censored == "below":
        return f"below {p.value:.3g}"
    return f"{p.value:.3g}"


def _when_chosen(pred: predicted.Predictions, point: str, m: ConfigCapacity) -> tuple[dict, float | None]:
    """The pass that first sent `point` to a real start and what it predicted then (before
    any start of the point was in the model's fit): the prediction a user would have
    acted on. Its columns, and predicted / measured - 1 where both are values."""
    k = None if point in pred.seeds else pred.chosen_in(point)   # a seed's starts came before any pass
    then = pred.passes[k - 1].of(point) if k else None
    if then is None or not then.predicted:
        return {"chosen in pass": "seed" if point in pred.seeds else "", "predicted when chosen": "",
                "error when chosen": "n/a"}, None
    err = then.value / m.value - 1 if m.kind == "value" and not then.censored else None
    return {"chosen in pass": str(k), "predicted when chosen": _predicted_words(then),
            "error when chosen": "n/a" if err is None else f"{err:+.0%}"}, err


def _pass_lines(pred: predicted.Predictions, errs: list[float]) -> list[str]:
    """One line a pass (where there were several), and the error (|predicted / measured -
    1|, `errs`) of the predictions made before their points were measured."""
    if len(pred.passes) < 2:
        return []
    lines = [f"pass {i}: fitted on {len(p.model.starts)} start(s), end-to-end error "
             + (f"+-{p.error.widen:.0%}" if p.error.widen is not None else "not measured")
             + f", chose {', '.join(p.chosen)}" for i, p in enumerate(pred.passes, 1)]
    lines.append("the error of each prediction made before its config was measured (the pass that chose it): "
                 + (f"median {np.median(errs):.0%}, max {max(errs):.0%} over {len(errs)} config(s)" if errs
                    else "no config with both a value predicted then and a value measured"))
    return lines


@dataclass
class Section:
    table: pd.DataFrame                  # one row a measured config with a prediction
    tau: float | None                    # Kendall's tau, measured against predicted (None: fewer than 2)
    tau_p: float | None
    errors: dict[str, float]             # |predicted / measured - 1| where both are values
    flagged: list[str]                   # configs predicted outside their measured interval
    not_predicted: dict[str, str] = field(default_factory=dict)   # point -> why
    lines: list[str] = field(default_factory=list)


def predicted_vs_measured(run_path: str | Path, capacities: dict) -> Section | None:
    """The section's table and figures from predictions.json and the measured capacities
    (report.Run.capacities); None for a run without predictions."""
    pred = predicted.read(run_path)
    if pred is None:
        return None
    rows, pairs, errors, flagged, errors_then = [], [], {}, [], []
    for p in pred.points:
        pc = capacities.get(p.point)
        if pc is None or not p.predicted:
            continue
        m = pc.config
        out = outside(p.value, m, p.censored)
        if out:
            flagged.append(p.point)
        if m.kind == "value" and not p.censored:
            errors[p.point] = abs(p.value / m.value - 1)
        if m.kind != "unresolved":
            pairs.append((m.value, p.value))
        rows.append({"point": p.point, "predicted rank": p.rank, "predicted": _predicted_words(p),
                     "predicted interval": _interval(p.low, p.high), "measured": str(m).split(" [")[0],
                     "measured interval": _interval(m.low, m.high) if m.kind == "value" else "a bound",
                     "starts": m.starts, "error": f"{p.value / m.value - 1:+.0%}" if p.point in errors else "n/a",
                     "OUTSIDE its measured interval": {True: "FLAGGED", False: "", None: "n/a"}[out],
                     "seed": "yes" if p.point in pred.seeds else ""})
        if len(pred.passes) > 1:   # the prediction made before the point was measured, beside the latest
            cols, err = _when_chosen(pred, p.point, m)
            rows[-1].update(cols)
            if err is not None:
                errors_then.append(abs(err))
    tau = tau_p = None
    if len(pairs) >= 2:
        t = stats.kendalltau([a for a, _ in pairs], [b for _, b in pairs])
        tau, tau_p = (None, None) if np.isnan(t.statistic) else (float(t.statistic), float(t.pvalue))
    sec = Section(pd.DataFrame(rows).set_index("point") if rows else pd.DataFrame(), tau, tau_p, errors, flagged,
                  {p.point: p.verdict for p in pred.points if not p.predicted})
    last = pred.refits[-1] if pred.refits else pred.model
    n_pred = sum(p.predicted for p in pred.points)
    sec.lines = _pass_lines(pred, errors_then) + [
        f"{n_pred} of {len(pred.points)} points predicted from the step records of {len(pred.model.starts)} "
        + ("seed " if len(pred.passes) == 1 else "") + f"start(s) ({pred.model.steps} steps, {pred.model.rounds} "
        "round(s)); each predicted interval carries the end-to-end error measured then: "
        + (f"+-{pred.error.widen:.0%} (capacity errors at the "
           + ("seeds " if len(pred.passes) == 1 else "configs measured then ")
           + (", ".join(f"{k} {v:.0%}" for k, v in pred.error.capacity.items()) or "none")
           + f"; replay of {pred.error.replay_rounds} measured round(s), P90 error of the SLO's figures "
           + (f"{pred.error.replay_p90:.0%})" if pred.error.replay_p90 is not None else "n/a)")
           if pred.error.widen is not None else "none measured (no interval)"),
        f"measured in real starts on this prediction: {', '.join(pred.chosen)}",
        "rank agreement over the measured configs: "
        + (f"Kendall tau {tau:+.2f} (p = {tau_p:.2f}, {len(pairs)} configs)" if tau is not None
           else f"not defined ({len(pairs)} config(s) with both, or all tied)"),
        "the model's error so far (|predicted / measured - 1| of capacity): "
        + (f"median {np.median(list(errors.values())):.0%}, max {max(errors.values()):.0%} over {len(errors)} "
           "config(s)" if errors else "no config with both a value predicted and a value measured"),
        f"{len(flagged)} prediction(s) outside the measured interval" + (f": {', '.join(flagged)}" if flagged else ""),
        f"the model now: {last.steps} steps of {last.rounds} rounds from {len(last.starts)} start(s) (refitted "
        f"after each real start: {len(pred.refits)} refit(s))"
        + (f"; its held-out per-step error median {last.held_out_median:.0%}, P90 {last.held_out_p90:.0%}"
           if last.held_out_median is not None else "")
        + "".join(f"; {term} left out: {why}" for term, why in last.left_out.items()),
        "Export takes measured configs only: a config with a prediction and no measured start is never exported.",
    ]
    return sec
