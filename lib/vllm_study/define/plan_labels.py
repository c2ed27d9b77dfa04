"""The words the sweep and its dry run use for a study's plan: its points and starts, its
rounds (or capacity search), its search space, and which starts live knobs share."""
from __future__ import annotations

from .grid import Point, live_groups, search_live_label
from .params import Study
from .search_space import FloatRange, IntRange


def search_space_label(study: Study) -> str:
    parts = []
    for name, dim in study.search.space.items():
        if isinstance(dim, IntRange):
            parts.append(f"{name} {dim.int[0]}..{dim.int[1]}" + (" (log)" if dim.log else ""))
        elif isinstance(dim, FloatRange):
            parts.append(f"{name} {dim.float[0]:g}..{dim.float[1]:g} step {dim.step:g}")
        else:
            parts.append(f"{name} {dim}")
    return "; ".join(parts)


def plan_label(study: Study, points: list[Point]) -> str:
    s = study.search
    if s:
        return (f"a search over {', '.join(s.space)}: {s.trials} trials ({s.sampler}), then the best {s.top_k} "
                f"and vLLM's defaults {s.confirm_starts} fresh start(s) each; every start")
    return f"{len(points)} points x {study.replicates} server start(s)"


def live_label(study: Study, engine: str, points: list[Point]) -> str:
    """How many server starts a block has, and why where live knobs share none."""
    if study.search:
        return search_live_label(study, engine)
    groups, why = live_groups(study, engine, points)
    shared = [g for g in groups if len(g) > 1]
    if not shared:
        if not why:
            why = (study.server.live_off_why(engine)
                   or "no two points differ only in live limits")
        return f"live knobs: none shared ({why}); one server start a point"
    how = ("each point runs its own capacity search in turn, its limits set before every step" if study.capacity
           else "lowers them between rounds")
    return (f"live knobs: {len(groups)} server start(s) a block serve the {len(points)} points; each shared start is "
            f"launched at its points' largest limits and {how} (docs/live-knobs.md)")


def rounds_label(study: Study) -> str:
    c = study.capacity
    if c:
        lower = f", halving down to {c.floor:g} where {c.lo:g} misses" if c.floor < c.lo else ""
        return f"a capacity search over {c.over} {c.lo:g}..{c.hi:g}{lower} (up to {study.steps_per_start} rounds)"
    return f"{study.rounds} rounds"
