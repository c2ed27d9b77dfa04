"""Does the capacity's 95% interval cover a known capacity? Simulated studies, fitted by
capacity.fit (margins, a monotone fit per start, a bootstrap over each step's requests,
an interval-censored likelihood over starts).

Each study is one config, its server started STARTS times. A start's capacity is the
config's (the truth, exp(mu)) times exp(N(0, 0.09)): starts of one config differ by
about 9%, as the H200 search's fresh starts did. At load x a start with capacity c has
TTFT P90 = 5000 ms * exp(k (x / c - 1)): flat (k = 0.15, as the H200 TTFT P90 ran along
its 5 s bound: 5118 ms at 1.73x, 5177 at 1.99x, 5374 at 2.28x) or steep (k = 3); ITL P99
sits at 0.6 of its bound at capacity and rises more slowly (it binds only past ~2c). Each
step draws its 40 requests afresh, each request's latency lognormal about that level,
its spread set so that a round's P90 repeats to about 1% at a fixed load (the H200's
replayed window: 2529, 2561, 2533 ms). Steps are placed as the kit's search places them
(capacity.Search, copied below so this script runs without the kit): the probe at hi, a
geometric bisection, lo only if nothing above it met; then, where lo missed too, halving
below lo to the FLOOR (lo / 8: three halvings) and two bisections in the bracket found.
A start still missing at the floor is "below the floor": a bound. A start meeting at hi
is "at least hi".

Scenarios: a flat and a steep config inside [lo, hi]; one below lo (found by halving);
one near the floor (some starts below it: censored); one near hi (some starts at least
hi: censored); and a convex curve searched coarsely: a queue's TTFT P90, 0.632 + 0.287 /
(4.43 - x) of its bound at capacity 3.65 (0.75 at 2x, 1.3 at 4x, as azure_code's margins
read on the CPU), searched over [1, 16] from lo in 4 steps (1, 16, 4, 2: a bracket [2, 4],
across which a straight line crosses 1 near 2.9x). Coverage counts a config's interval (or bound) holding the truth; a
half-open interval (an end beyond the loads measured) holds all on its open side.

Confirmation: the best config (flat, 1.9x), vLLM's defaults (flat, 0.7x: below lo) and
a runner-up (flat, 1.65x) start again, one start of each a block, from two starts each,
until the gain of the best over each is resolved or MAX_STARTS each.

    python benchmarks/capacity_coverage.py [--studies 500] [--seed 0] [--jobs 2]

Target: coverage >= 90% over the 500 studies.
"""
from __future__ import annotations

import argparse
import math
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "lib"))

from vllm_study.capacity import fit  # noqa: E402
from vllm_study.capacity.fit import (StepData, bounds_from_slo, combine, fit_start,  # noqa: E402
                                     gain)

SLO = {"ttft_p90_ms": 5000.0, "itl_p99_ms": 150.0}
BOUNDS = bounds_from_slo(SLO)
REQUESTS = 40            # requests per step (the replayed window's)
REQ_SIGMA = 0.037        # per-request log spread: a round's P90 of 40 repeats to ~1%
START_SPREAD = 0.09      # start-to-start sd of log capacity
LO, HI, PRECISION, MAX_STEPS = 1.0, 4.0, 0.15, 5
FLOOR = LO / 8           # the search halves below lo down to here (three halvings)
STARTS = 4
RESAMPLES = 500
MAX_STARTS = 10          # confirmation's budget per config

SCENARIOS = {            # name: (true capacity in the search's unit, TTFT slope k)
    "flat, inside [lo, hi]": (1.9, 0.15),
    "steep, inside [lo, hi]": (1.9, 3.0),
    "flat, below lo": (0.7, 0.15),
    "steep, near the floor": (0.14, 3.0),
    "flat, near hi": (3.7, 0.15),
    "convex, coarse bracket": (3.65, "queue"),
}
# the coarse search of the convex scenario: lo, hi, precision, max_steps, probing lo first
COARSE = (1.0, 16.0, 0.05, 4)
Z90, Z99 = 1.2815515655446004, 2.3263478740408408


def ttft_level(x: float, c: float, k) -> float:
    """TTFT P90 over its bound at load x for capacity c: exp(k (x / c - 1)), or a queue's
    curve (k = "queue"), saturated (10) near 4.43 / 3.65 of c."""
    if k == "queue":
        u = x * 3.65 / c
        return 0.632 + 0.287 / (4.43 - u) if u < 4.4 else 10.0
    return math.exp(k * (x / c - 1))


def measure(rng, x: float, c: float, k) -> tuple[StepData, bool]:
    """One round at load x of a start with capacity c: its requests' latencies, and
    whether it met the SLO (the kit's judge: every bound's percentile within its limit)."""
    def draw(z):   # requests about a level: the population's quantile at z is the level
        return np.exp(REQ_SIGMA * (rng.standard_normal(REQUESTS) - z))
    ttft = SLO["ttft_p90_ms"] * ttft_level(x, c, k) * draw(Z90)
    itl = 0.6 * SLO["itl_p99_ms"] * math.exp(0.5 * (x / c - 1)) * draw(Z99)
    met = np.percentile(ttft, 90) <= SLO["ttft_p90_ms"] and np.percentile(itl, 99) <= SLO["itl_p99_ms"]
    return StepData(load=x, latencies={"ttft_p90_ms": ttft, "itl_p99_ms": itl}), bool(met)


def coarse_search(rng, c: float, k) -> list[StepData]:
    """The convex scenario's search: the kit's own Bracket, probing lo first, over COARSE."""
    from vllm_study.capacity.bracket import Bracket, Step
    steps = []

    def take(x):
        s, met = measure(rng, x, c, k)
        steps.append(s)
        return Step(x, met, "")
    lo, hi, precision, max_steps = COARSE
    Bracket("speed", lo, hi, precision, max_steps, probe="lo").run(take)
    return steps


def search(rng, c: float, k) -> list[StepData]:
    """The kit's step placement (capacity.Search.run), extended below lo by halving."""
    if k == "queue":
        return coarse_search(rng, c, k)
    steps = []

    def take(x):
        s, met = measure(rng, x, c, k)
        steps.append(s)
        return met

    def done(a, b):
        return b / a - 1 <= PRECISION

    if take(HI):
        return steps
    best, a, b = False, LO, HI
    while len(steps) < MAX_STEPS - (not best) and not done(a, b):
        mid = math.sqrt(a * b)
        if take(mid):
            best, a = True, mid
        else:
            b = mid
    if best or take(LO):
        return steps
    b, x = LO, LO / 2
    while x >= FLOOR * (1 - 1e-9):     # below lo: halve until a step meets or the floor missed
        if take(x):
            a = x
            for _ in range(2):
                if done(a, b):
                    break
                mid = math.sqrt(a * b)
                if take(mid):
                    a = mid
                else:
                    b = mid
            return steps
        b, x = x, x / 2
    return steps


def study(seed: int, cap: float, k: float, starts: int = STARTS):
    rng = np.random.default_rng(seed)
    fits = [fit_start(search(rng, cap * math.exp(START_SPREAD * rng.standard_normal()), k), BOUNDS,
                      n_resamples=RESAMPLES, seed=int(rng.integers(2 ** 32)))
            for _ in range(starts)]
    return fits


def covers(c, truth: float) -> bool:
    if c.kind == "below":
        return truth < c.value
    if c.kind == "at_least":
        return truth >= c.value
    if c.kind == "unresolved":
        return True
    return (c.low is None or c.low <= truth) and (c.high is None or truth <= c.high)


def coverage_job(args):
    i, seed, name, bracket_bound = args
    cap, k = SCENARIOS[name]
    if not bracket_bound:   # the interval as it was before it reached the bracket's ends
        fit.within_bracket = lambda low, high, brackets: (low, high)
    fits = study(seed, cap, k)
    c = combine(fits)
    half = None
    if c.kind == "value" and c.low is not None and c.high is not None:
        half = math.exp(math.log(c.high / c.low) / 2) - 1
    return name, covers(c, cap), half, c.kind, sum(f.kind != "value" for f in fits)


def confirm_job(seed: int):
    """Starts each config needed until best vs baseline, and best vs runner-up, resolved."""
    rng = np.random.default_rng(seed)
    configs = {"best": (1.9, 0.15), "baseline": (0.7, 0.15), "runner-up": (1.65, 0.15)}
    fits = {n: [] for n in configs}
    need = {"baseline": None, "runner-up": None}
    for n_starts in range(1, MAX_STARTS + 1):
        for n in rng.permutation(list(configs)):          # one start of each a block, shuffled
            cap, k = configs[n]
            fits[n] += study(int(rng.integers(2 ** 32)), cap, k, starts=1)
        if n_starts < 2:
            continue
        best = combine(fits["best"])
        for other in need:
            if need[other] is None and gain(best, combine(fits[other])).resolved:
                need[other] = n_starts
        if all(v is not None for v in need.values()):
            break
    return need


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--studies", type=int, default=500)
    ap.add_argument("--confirmations", type=int, default=50)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--without-bracket", action="store_true",
                    help="also the coverage of the likelihood's interval alone (capacity.fit before its interval "
                         "reached the bracket's ends): every study fitted twice")
    a = ap.parse_args(argv)

    rng = np.random.default_rng(a.seed)
    p90 = [np.percentile(measure(rng, 1.5, 1.5, 0.15)[0].latencies["ttft_p90_ms"], 90) for _ in range(2000)]
    print(f"a round's TTFT P90 at a fixed load repeats to {np.std(np.log(p90)):.1%} (sd of log)")

    seeds = np.random.SeedSequence(a.seed).generate_state(a.studies + a.confirmations)
    names = list(SCENARIOS)
    jobs = [(i, int(seeds[i]), names[i % len(names)], True) for i in range(a.studies)]
    with ProcessPoolExecutor(a.jobs) as ex:
        rows = list(ex.map(coverage_job, jobs, chunksize=4))
        confirms = list(ex.map(confirm_job, [int(s) for s in seeds[a.studies:]]))
    before = None
    if a.without_bracket:   # a pool of its own: the patch stays in its workers
        with ProcessPoolExecutor(a.jobs) as ex:
            before = list(ex.map(coverage_job, [j[:3] + (False,) for j in jobs], chunksize=4))

    print(f"\n{a.studies} studies, {STARTS} starts each; search lo {LO:g}, hi {HI:g}, precision {PRECISION:g}, "
          f"max_steps {MAX_STEPS}, floor {FLOOR:g}; {RESAMPLES} resamples a start")
    print(f"convex, coarse bracket: lo {COARSE[0]:g}, hi {COARSE[1]:g}, max_steps {COARSE[3]}, probe lo")
    extra = f" {'without bracket':>16} {'its half-width':>15}" if before else ""
    print(f"{'scenario':26} {'studies':>7} {'coverage':>9} {'median half-width':>18} {'bounds':>7} "
          f"{'censored starts':>16}{extra}")

    def cells(rs):
        halves = [r[2] for r in rs if r[2] is not None]
        return np.mean([r[1] for r in rs]), f"{np.median(halves):.1%}" if halves else "-"
    for name in names + ["all"]:
        rs = [r for r in rows if name in ("all", r[0])]
        cov, hw = cells(rs)
        more = ""
        if before:
            cov0, hw0 = cells([r for r in before if name in ("all", r[0])])
            more = f" {cov0:16.1%} {hw0:>15}"
        print(f"{name:26} {len(rs):7d} {cov:9.1%} {hw:>18} "
              f"{sum(r[3] != 'value' for r in rs):7d} {sum(r[4] for r in rs):16d}{more}")

    print(f"\nconfirmation over {len(confirms)} studies: best 1.9x, baseline 0.7x (below lo), runner-up 1.65x; "
          f"from 2 starts each, one more of each a block, at most {MAX_STARTS}")
    for other in ("baseline", "runner-up"):
        got = [c[other] for c in confirms if c[other] is not None]
        med = f"median {np.median(got):.0f}, max {max(got)}" if got else "-"
        print(f"  best vs {other:9}: resolved in {len(got)}/{len(confirms)}; starts of each config needed: {med}")


if __name__ == "__main__":
    main()
