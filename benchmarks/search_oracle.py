"""The search against a completed grid as its oracle: how often does the search find a
configuration as good as the grid's best, and with how many trials?

Each seed runs the kit's own search loop (config_search.SearchLoop, the sampler a study
names) over the grid's axes, and each trial reads one of the grid point's measured
server starts (drawn at random, so a trial sees the start-to-start noise a live one
would) instead of starting a server. The search's answer is its best trial; it counts
as found when the grid's own value of that point (all its starts) lies within the 95%
interval of the grid optimum's value. Random search on the same budget is printed
beside it.

    python benchmarks/search_oracle.py results/<grid run> [--seeds 100] [--trials 12]

Target: within the optimum's interval in at least 80% of seeds, with at most a third
of the grid's points as trials. Where the optimum's interval is wide (it holds many of
the grid's points), that criterion is easy: the lines also give how often the search
found the optimum itself, or came within 10% of its value, which tell samplers apart.
"""
from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

import numpy as np
import optuna

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "lib"))

from vllm_study.analysis import intervals as analysis  # noqa: E402
from vllm_study.search import config_search as cs  # noqa: E402
from vllm_study.vocab import metrics  # noqa: E402
from vllm_study.define.search_space import Search  # noqa: E402

MIN_TRIALS = Search.model_fields["trials"].metadata[0].ge  # the fewest trials a search takes
from vllm_study.report.report import Run  # noqa: E402

USAGE = 2   # the exit status of a usage error, as the kit's command line and argparse give it


class UsageError(Exception):
    """What the user asked cannot be answered from this run: said on stderr, exit USAGE."""


def oracle(run: Run, objective: str):
    """(grid axes with their values, point id -> values, point id -> its starts' values,
    the point_intervals rows of the objective)."""
    data = analysis.MetricData.from_rounds(run.rounds, objective)
    if data is None:
        why = (" (goodput counts the requests within the SLO, and the study sets no `slo:`)"
               if objective == "goodput" and not run.slo else "")
        raise UsageError(f"{run.folder.path}: no {objective} measured{why}; name a metric the grid measured "
                         "with --objective, e.g. --objective output_throughput")
    starts = {p: [float(data.back(v)) for v in vs] for p, vs in data.starts.items()}
    values = {s.point: s.values for s in run.summaries}
    iv = analysis.point_intervals(run.rounds, [objective]).set_index("point")
    return dict(run.study.grid), values, starts, iv


def search_once(axes, values, starts, objective: str, trials: int, sampler: str, seed: int,
                direction: str) -> tuple[str | None, int, int]:
    """One seeded search over the grid: (its best point, trials started, the trial that
    first found it)."""
    spec = Search(space={a: list(v) for a, v in axes.items()}, objective=objective, trials=trials,
                  sampler=sampler, seed=seed, direction=direction)
    by_values = {tuple(v[a] for a in axes): p for p, v in values.items()}
    rng = random.Random(f"oracle/{seed}")
    found_at = {}

    def measure(v: dict) -> cs.TrialOutcome:
        point = by_values.get(tuple(v[a] for a in axes))
        if point is None or point not in starts:  # a grid point with no measured start: a failed trial
            return cs.TrialOutcome(failed="the grid has no measured start of this point")
        found_at.setdefault(point, len(found_at) + 1)
        return cs.TrialOutcome(rng.choice(starts[point]))

    loop = cs.SearchLoop(spec, f"oracle-{seed}", optuna.storages.InMemoryStorage(), lambda v: [])
    cs.run_offline(loop, measure)
    top = loop.top(1)  # trial points are named as the grid names its points (grid.point_id)
    point = top[0] if top else None
    return point, len(loop.started()), found_at.get(point, 0)


def main() -> int:
    try:
        return _main()
    except (UsageError, FileNotFoundError) as e:   # a run folder that is not there is one too
        print(f"error: {e}", file=sys.stderr)
        return USAGE


def _main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run", type=Path, help="a completed grid run")
    ap.add_argument("--objective", default="goodput")
    ap.add_argument("--seeds", type=int, default=100)
    ap.add_argument("--trials", type=int, help="trials per search (default: a third of the grid's points)")
    ap.add_argument("--samplers", default="tpe,random")
    a = ap.parse_args()
    run = Run.load(a.run)
    axes, values, starts, iv = oracle(run, a.objective)
    m = metrics.get(a.objective)
    direction = "maximize" if m.better == "higher" else "minimize"
    n_points = int(np.prod([len(v) for v in axes.values()]))
    trials = a.trials or n_points // 3
    if trials < MIN_TRIALS:
        given = f"--trials {trials}" if a.trials else \
            f"the grid's {n_points} points give a search {trials} trial(s) (a third of them), which"
        raise UsageError(f"{given} is below the {MIN_TRIALS} trials a search needs; pass --trials {MIN_TRIALS} "
                         "or more")
    best = iv["value"].idxmax() if direction == "maximize" else iv["value"].idxmin()
    lo, hi = iv.loc[best, "ci_low"], iv.loc[best, "ci_high"]
    n_starts = sum(len(v) for v in starts.values())
    print(f"grid: {a.run.name}: {n_points} points over {', '.join(axes)}, {len(starts)} measured "
          f"({n_starts} server starts)")
    print(f"grid optimum by {a.objective}: {best} {iv.loc[best, 'value']:{m.fmt}} [{lo:{m.fmt}}, {hi:{m.fmt}}] "
          f"{m.unit} (95% interval); {sum(lo <= iv['value']) if direction == 'maximize' else sum(iv['value'] <= hi)}"
          f" of {len(iv)} points have a value inside it")
    print(f"each search: {trials} trials ({trials / n_points:.0%} of the grid's points), {a.seeds} seeds\n")
    verdicts = {}
    for sampler in a.samplers.split(","):
        found, used, when, regret, exact = 0, [], [], [], 0
        for seed in range(a.seeds):
            point, n, at = search_once(axes, values, starts, a.objective, trials, sampler, seed, direction)
            v = iv.loc[point, "value"] if point in iv.index else np.nan
            ok = bool(point) and (lo <= v <= hi or (direction == "maximize" and v >= lo)
                                  or (direction == "minimize" and v <= hi))
            found += ok
            exact += point == best
            used.append(n)
            when.append(at)
            regret.append(abs(iv.loc[best, "value"] - v) / abs(iv.loc[best, "value"]))
        share = found / a.seeds
        verdicts[sampler] = share
        close = int(np.sum(np.array(regret) <= 0.10))
        print(f"{sampler:>6}: best within the optimum's interval in {found} of {a.seeds} seeds ({share:.0%}); "
              f"the optimum itself in {exact}, within 10% of its value in {close}; shortfall from the optimum: "
              f"median {np.nanmedian(regret):.1%}, worst {np.nanmax(regret):.1%}; trials started "
              f"{int(np.median(used))} (median), the answer the k-th configuration measured, k "
              f"{int(np.median(when))} (median)")
    head = a.samplers.split(",")[0]
    met = verdicts[head] >= 0.8 and trials <= n_points / 3
    print(f"\ntarget (>= 80% of seeds, <= a third of the points): {'MET' if met else 'NOT MET'} by {head} "
          f"({verdicts[head]:.0%}, {trials} of {n_points})")
    return 0 if met else 1


if __name__ == "__main__":
    raise SystemExit(main())
