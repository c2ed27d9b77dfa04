"""Confirmation until resolved (the study's `confirm:`), decided: every point judged over
its completed starts, the best config, the runner-up and the baseline ranked, each gain
told apart (capacity.estimate.told_apart), the next shuffled block of fresh starts or the
reason to stop, and the report's sentence. What it keeps (each block's verdict, the reason
it stopped) is records/confirmation.py's ConfirmRecord.
"""
from __future__ import annotations

import random

from ..capacity.estimate import PointCapacity, one_start_words, told_apart
from ..define.grid import Unit
from ..define.params import Study
from ..records.confirmation import MAX_STARTS, NOTHING, RESOLVED, ConfirmRecord, Verdict
from ..records.point_capacity import point_capacities
from ..records.results import RunFolder


def block_verdict(run: RunFolder, study: Study, block: int) -> Verdict:
    """Every point's capacity over all its completed starts (as the report reads a grid
    run), ranked: the best is the highest (a bound where it met at the highest load), the
    runner-up the next; each gain as capacity.estimate.gain states it."""
    base = study.baseline
    caps = point_capacities({p: (run.point(p), None) for p in run.point_ids()}, study.capacity.slo,
                            study.capacity.lo)
    # a capacity below the lowest load ranks under every measured one; its bound orders the rest
    ranked = sorted((pid for pid, pc in caps.items() if pc is not None),
                    key=lambda pid: (caps[pid].config.kind != "below", caps[pid].config.value or 0.0), reverse=True)
    best = ranked[0] if ranked else None
    runner = ranked[1] if len(ranked) > 1 else None
    # in this order (not a set's, which changes from one process to the next): the report names them so
    starts = {p: len(caps[p].starts) if caps.get(p) else 0 for p in dict.fromkeys((best, runner, base)) if p}
    v = Verdict(block=block, best=best, runner_up=runner, baseline=base, starts=starts)
    if best is None:
        return v
    v.best_below = caps[best].config.kind == "below"
    v.at_highest = [p for p in starts if caps.get(p) is not None and caps[p].config.kind == "at_least"]
    # a gain over a config below the floor in every start is the best's lower end over that
    # floor (capacity.fit.gain), whatever its next start says unless that one meets: after
    # two such starts, confirmation spends its time on the comparisons it can still move
    v.settled = [p for p in starts if p != best and caps.get(p) is not None
                 and caps[p].config.kind == "below" and caps[p].config.starts >= 2]
    if caps.get(base) is not None and base != best:
        v.over_baseline, v.baseline_resolved = _told_apart(caps[best], caps[base])
    elif base == best:   # the baseline is the best: only the runner-up is left to tell apart
        v.over_baseline, v.baseline_resolved = "the best is the baseline", True
    if runner is not None:
        v.over_runner_up, v.runner_up_resolved = _told_apart(caps[best], caps[runner])
    v.best_half_width = caps[best].config.half_width
    v.best_bracket_bound = caps[best].config.bracket_bound
    want = study.confirm.half_width if study.confirm else None
    v.precise = want is None or (v.best_half_width is not None and v.best_half_width <= want)
    return v


def _told_apart(a: PointCapacity, b: PointCapacity) -> tuple[str, bool]:
    """a's gain over b in words, and whether it is resolved (capacity.estimate.told_apart)."""
    t = told_apart(a, b)
    if t.gain.resolved and not t.resolved:
        return f"{t.gain}; not resolved yet: {one_start_words(t.unmeasured)}", False
    if t.gain.kind == "unresolved":   # say which side lacks an end, not a generic "both are bounds"
        return f"unresolved: {_open_side(b)} and {_open_side(a)}", False
    return str(t.gain), t.resolved


def _open_side(pc: PointCapacity) -> str:
    """A capacity as far as it bounds a ratio: a bound, an interval open on one side, or
    one closed on both (capacity.fit.ConfigCapacity, in the search's unit)."""
    c = pc.config
    if c.kind == "below":
        return f"{pc.point}'s capacity is a bound, below {c.value:.3g} (it missed the SLO at the lowest load)"
    if c.kind == "at_least":
        return f"{pc.point}'s capacity is a bound, at least {c.value:.3g} (it met the SLO at the highest load)"
    if c.kind == "unresolved":
        return f"{pc.point}'s capacity is unresolved (its starts disagree)"
    if c.low is None and c.high is None:
        return f"{pc.point}'s interval is open on both sides (beyond every load measured)"
    if c.low is None:
        return f"{pc.point}'s interval is open below (it reaches below every load measured; at most {c.high:.3g})"
    if c.high is None:
        return f"{pc.point}'s interval is open above (it reaches above every load measured; at least {c.low:.3g})"
    return f"{pc.point}'s interval is {c.value:.3g} [{c.low:.3g}, {c.high:.3g}]"


def current(run: RunFolder, study: Study, rec: ConfirmRecord) -> Verdict | None:
    """The verdict on the starts the folder holds now: a run stopped inside a block has
    starts its record's last verdict never judged (that block's verdict comes at its end)."""
    last_block = max(u.block for u in run.manifest().order)
    if rec.last is None or rec.last.block == last_block:
        return rec.last
    return block_verdict(run, study, last_block)


def next_block(run: RunFolder, study: Study, v: Verdict) -> list[Unit] | str:
    """One shuffled block of fresh starts of the best, the runner-up and the baseline,
    appended to the manifest's order (so --resume runs it too); or the reason to stop.
    Each is a start of its point alone, launched at its own limits (no `serves`), even
    where the planned starts served it in a group (live knobs): a confirmation start is a
    fresh server of that config, numbered after every start that served the point. A
    config below the lowest load in each of 2+ starts (Verdict.settled) is left out. Once
    both gains are resolved and only confirm.half_width is left, a block is the best alone."""
    if v.done:
        return RESOLVED
    if v.best is None or v.runner_up is None:
        return f"{NOTHING}: fewer than two points have a capacity"
    if v.best_below:   # more starts would only repeat "below the lowest load": lower the floor instead
        return f"{NOTHING}: every point's capacity is below its lowest load (capacity.floor)"
    if v.over_baseline is None:
        return f"{NOTHING}: the baseline {v.baseline} has no capacity (no start completed)"
    # two capacities that are both "at least the highest load" never part, however many starts:
    # stop once every comparison left open is such a pair (the others may still resolve)
    open_ = [p for p, ok in ((v.baseline, v.baseline_resolved), (v.runner_up, v.runner_up_resolved))
             if not ok and p != v.best]
    if open_ and all({v.best, p} <= set(v.at_highest) for p in open_):
        return (f"{NOTHING}: {v.best} and {' and '.join(open_)} met the SLO at the highest load, so more "
                "starts cannot tell their capacities apart: raise capacity.hi")
    if v.resolved and v.best_bracket_bound:   # only half_width is left, and starts do not move a bracket
        return (f"{NOTHING}: {v.best}'s interval reaches its starts' bracket (the loads measured either side "
                "of its capacity), which more starts do not narrow: a finer capacity.precision (with the "
                "max_steps to reach it) does")
    if v.resolved and v.best in v.at_highest:
        return (f"{NOTHING}: {v.best} met the SLO at the highest load, so its capacity is a bound with no "
                "interval to narrow: raise capacity.hi")
    manifest = run.manifest()
    starts: dict[str, int] = {}
    for u in manifest.order:  # every point a start served (live knobs: a group's, not only its lead's)
        for p in u.points:
            starts[p] = max(starts.get(p, 0), u.start)
    points = [v.best] if v.resolved else \
        [p for p in dict.fromkeys([v.best, v.runner_up, v.baseline]) if p not in v.settled]
    full = [p for p in points if starts.get(p, 0) >= study.confirm.max_starts]
    if full:
        return f"{MAX_STARTS}: {', '.join(full)} {'has' if len(full) == 1 else 'have'} " \
               f"{study.confirm.max_starts} starts (confirm.max_starts)"
    block = max(u.block for u in manifest.order) + 1
    random.Random(f"{study.order_seed}/{block}").shuffle(points)
    extra = [Unit(point=p, start=starts.get(p, 0) + 1, block=block) for p in points]
    manifest.order += extra
    manifest.save(run.manifest_path)
    return extra


def stop_words(rec: ConfirmRecord, v: Verdict | None = None) -> str | None:
    """The report's sentence: which comparisons were resolved, and why confirmation stopped;
    `v`: the verdict to state (current()), by default the record's last."""
    v = v or rec.last
    if v is None or v.best is None or v.best_below:
        return f"Confirmation until resolved stopped: {rec.stop or 'not run'}." if rec.stop else None
    blocks = v.block - rec.planned_blocks
    parts = []
    if v.baseline != v.best:
        also = ", also the runner-up," if v.runner_up == v.baseline else ""   # one comparison, said once
        parts.append(f"over the baseline {v.baseline}{also} {'resolved' if v.baseline_resolved else 'not resolved'} "
                     f"({v.over_baseline or 'no capacity'})")
    if v.runner_up and v.runner_up != v.baseline:
        parts.append(f"over the runner-up {v.runner_up} {'resolved' if v.runner_up_resolved else 'not resolved'} "
                     f"({v.over_runner_up})")
    if not v.precise:
        parts.append("its interval " + (f"+-{v.best_half_width:.0%}" if v.best_half_width is not None else "open")
                     + " of its value, wider than confirm.half_width")
    each = ", ".join(f"{p} {n}" for p, n in v.starts.items())
    settled = (f" Not started again, below the lowest load in each start: {', '.join(v.settled)} (a gain over it "
               "rests on the best's interval alone)." if v.settled else "")
    return (f"Confirmation until resolved, {blocks} block(s) begun after the planned starts (starts judged: "
            f"{each}): the best {v.best}'s gain " + "; ".join(parts)
            + f". It stopped: {rec.stop or 'not finished (--resume goes on)'}." + settled)
