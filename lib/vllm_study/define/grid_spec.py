"""A study's `grid:` as written: axes whose values cross (a mapping of axis -> values, the
product of all), or the points themselves (a list of mappings, each one server
configuration, as `vllm bench sweep serve --serve-params` takes them). A list compares
configurations that are no product of anything, e.g. vLLM's defaults against a searched
best with and without prefix caching, without measuring the other combinations."""
from __future__ import annotations

import itertools
from typing import Any

from .schema import EngineArgs, did_you_mean

Grid = dict[str, list[Any]] | list[dict[str, Any]]


def axes(grid: Grid) -> dict[str, list[Any]]:
    """Each axis with its values in the order first given (a list's: over its points)."""
    if isinstance(grid, dict):
        return grid
    out: dict[str, list[Any]] = {}
    for point in grid:
        for axis, value in point.items():
            seen = out.setdefault(axis, [])
            if not any(repr(v) == repr(value) for v in seen):
                seen.append(value)
    return out


def combos(grid: Grid) -> list[dict[str, Any]]:
    """The points' values: the product of a mapping's axes (in its order), or the list."""
    if isinstance(grid, list):
        return [dict(p) for p in grid]
    names = list(grid)
    return [dict(zip(names, c)) for c in itertools.product(*(grid[a] for a in names))]


def check(grid: Grid, engine_args: EngineArgs) -> None:
    """Every axis an engine argument not also fixed in engine_args; no axis without values
    or repeating one; a list's points all give the same axes and no two are the same."""
    known = set(EngineArgs.model_fields)
    for axis, values in axes(grid).items():
        if axis not in known:
            raise ValueError(f"grid axis {axis!r} is not an engine argument the kit "
                             f"knows{did_you_mean(axis, known)}; axes: {', '.join(sorted(known))}")
        if getattr(engine_args, axis) is not None:
            raise ValueError(f"{axis} is both a grid axis and fixed in engine_args; remove one of them")
        if isinstance(grid, dict) and not values:
            raise ValueError(f"grid axis {axis!r} has no values")
        if isinstance(grid, dict) and len(set(map(repr, values))) != len(values):
            raise ValueError(f"grid axis {axis!r} repeats a value: {values}")
    if isinstance(grid, dict):
        return
    names = list(axes(grid))
    for i, point in enumerate(grid):
        if sorted(point) != sorted(names):
            raise ValueError(f"grid point {i + 1} ({point}) gives {', '.join(sorted(point)) or 'no axis'}, "
                             f"but the list's points set {', '.join(names)}: give every point every axis "
                             "(write vLLM's own value where a point keeps its default)")
        twin = next((j for j in range(i) if all(repr(grid[j][a]) == repr(point[a]) for a in names)), None)
        if twin is not None:
            raise ValueError(f"grid points {twin + 1} and {i + 1} are the same configuration ({point}); "
                             "remove one (replicates: N starts each point N times)")
