"""Run-level statistics (analysis.py) on synthetic data whose answer is known: intervals
that hold the true value about 95% of the time, differences that resolve a real effect
and not a null one, and the noise floor it reports."""
from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from vllm_study.analysis import intervals as analysis
from vllm_study.measure.stats import estimate
from paths import REPO


def _rounds(values: dict[str, np.ndarray], metric: str = "ttft_p90_ms") -> pd.DataFrame:
    """A summary.csv-shaped frame: values[point] is a (starts, rounds) array."""
    rows = []
    for point, arr in values.items():
        for s, start in enumerate(arr, 1):
            for r, v in enumerate(start):
                rows.append({"point": point, "start": s, "round": r, "group": "all", "round_status": "ok",
                             metric: v})
    return pd.DataFrame(rows)


def _grid(rng, truth: dict[str, float], starts: int, rounds: int, start_sd: float, round_sd: float):
    """Log-normal noise around each point's true value: a start effect shared by its
    rounds, and round noise on top (multiplicative, as latency noise is)."""
    return {p: v * np.exp(rng.normal(0, start_sd, (starts, 1)) + rng.normal(0, round_sd, (starts, rounds)))
            for p, v in truth.items()}


def test_estimate_is_median_range_and_start_medians():
    e = estimate([[10.0, 12.0, 11.0], [20.0, 14.0, None]])
    assert e.median == pytest.approx(np.median([10, 12, 11, 20, 14]))
    assert (e.min, e.max, e.rounds, e.starts) == (10.0, 20.0, 5, 2)
    assert e.start_medians == [11.0, 17.0]
    assert estimate([[None], []]) is None


def test_value_is_mean_of_start_medians_on_the_log_scale():
    df = _rounds({"a": np.array([[100.0, 110.0, 90.0], [400.0, 380.0, 420.0]])})
    row = analysis.point_intervals(df, ["ttft_p90_ms"]).iloc[0]
    assert row["scale"] == "log"
    assert row["value"] == pytest.approx(np.sqrt(100 * 400))  # geometric mean of 100 and 400
    assert row["starts"] == 2 and row["rounds"] == 6


def test_interval_holds_the_true_value_about_95_percent_of_the_time_with_two_starts():
    """12 points x 2 starts x 3 rounds, restarts moving values by ~25% (as on the H200):
    pooling the start spread over points gives close to nominal coverage."""
    rng = np.random.default_rng(7)
    truth = {f"p{i}": 100.0 * (1 + i / 10) for i in range(12)}
    hits = total = 0
    for _ in range(150):
        df = _rounds(_grid(rng, truth, starts=2, rounds=3, start_sd=0.25, round_sd=0.08))
        iv = analysis.point_intervals(df, ["ttft_p90_ms"]).set_index("point")
        # the true "typical value" of a point is its median (log-normal: exp of the log mean)
        inside = (iv["ci_low"] <= pd.Series(truth)) & (pd.Series(truth) <= iv["ci_high"])
        hits += int(inside.sum())
        total += len(inside)
    assert 0.91 <= hits / total <= 0.98, hits / total


def test_a_new_start_falls_inside_the_prediction_interval():
    rng = np.random.default_rng(3)
    truth = {f"p{i}": 50.0 + 5 * i for i in range(10)}
    hits = total = 0
    for _ in range(100):
        df = _rounds(_grid(rng, truth, 2, 3, 0.2, 0.05))
        iv = analysis.point_intervals(df, ["ttft_p90_ms"]).set_index("point")
        later = _grid(rng, truth, 1, 3, 0.2, 0.05)  # a re-run of each point, later
        for p, arr in later.items():
            v = float(np.median(arr))
            hits += iv.at[p, "next_start_low"] <= v <= iv.at[p, "next_start_high"]
            total += 1
    assert 0.90 <= hits / total <= 0.99, hits / total


def test_intervals_stay_where_the_quantity_can_lie():
    """Preemptions (linear scale: some points count 0) at a point whose starts all saw
    none, with the spread pooled from a point that had many: [0, x], never below 0. A hit
    rate near 1 on the log scale stays at or below 1."""
    pre = _rounds({"calm": np.array([[0.0, 0.0], [0.0, 0.0]]), "busy": np.array([[2.0, 3.0], [12.0, 10.0]])},
                  "preemptions")
    iv = analysis.point_intervals(pre, ["preemptions"]).set_index("point")
    assert iv.at["calm", "scale"] == "linear" and iv.at["calm", "value"] == 0.0
    assert iv.at["calm", "ci_low"] == 0.0 and iv.at["calm", "ci_high"] > 0
    assert iv.at["calm", "next_start_low"] == 0.0
    hit = _rounds({"a": np.array([[0.99, 0.98], [0.80, 0.82]])}, "prefix_cache_hit_rate")
    row = analysis.point_intervals(hit, ["prefix_cache_hit_rate"]).iloc[0]
    assert row["scale"] == "log" and row["ci_high"] == 1.0 and 0 < row["ci_low"] < row["value"]


def test_one_start_per_point_says_start_variation_is_not_covered():
    df = _rounds({"a": np.array([[10.0, 11.0, 12.0]]), "b": np.array([[20.0, 21.0, 19.0]])})
    iv = analysis.point_intervals(df, ["ttft_p90_ms"])
    assert iv["method"].str.contains("start-to-start variation not covered").all()
    assert (iv["ci_low"] < iv["value"]).all() and (iv["value"] < iv["ci_high"]).all()
    assert iv["next_start_low"].isna().all()  # nothing measured how a restart moves it


def test_a_real_effect_is_resolved_and_a_null_one_mostly_not():
    rng = np.random.default_rng(11)
    resolved_real = resolved_null = 0
    trials = 120
    for _ in range(trials):
        truth = {"base": 100.0, "slower": 200.0, "same": 100.0, **{f"x{i}": 120.0 for i in range(6)}}
        df = _rounds(_grid(rng, truth, 2, 3, 0.15, 0.05))
        data = analysis.MetricData.from_rounds(df, "ttft_p90_ms")
        real = analysis.difference(data, "slower", "base")
        null = analysis.difference(data, "same", "base")
        resolved_real += real.resolved and real.verdict() == "worse"
        resolved_null += null.resolved
    assert resolved_real / trials > 0.9, resolved_real / trials  # a 2x effect against ~15% restart noise
    assert resolved_null / trials < 0.1, resolved_null / trials  # a 5% false-alarm rate, with slack


def test_difference_is_a_relative_change_with_direction_from_the_registry():
    df = _rounds({"a": np.array([[200.0, 200.0, 200.0], [210.0, 190.0, 200.0]]),
                  "b": np.array([[100.0, 100.0, 100.0], [105.0, 95.0, 100.0]])}, "output_throughput")
    d = analysis.difference(analysis.MetricData.from_rounds(df, "output_throughput"), "a", "b")
    assert d.relative and d.estimate == pytest.approx(1.0, rel=0.01)  # a is +100%
    assert d.resolved and d.verdict() == "better"  # more throughput is better


def test_ties_with_best_and_the_noise_floor():
    df = _rounds({"fast": np.array([[100.0, 101.0, 99.0], [103.0, 104.0, 102.0]]),
                  "close": np.array([[101.0, 102.0, 100.0], [104.0, 103.0, 105.0]]),
                  "slow": np.array([[200.0, 201.0, 199.0], [206.0, 204.0, 205.0]])})
    vb = analysis.versus_best(df, "ttft_p90_ms")
    assert (vb["best"] == "fast").all()
    assert vb.loc["close", "tied_with_best"] and not vb.loc["slow", "tied_with_best"]
    nf = analysis.noise_floor(df, ["ttft_p90_ms"]).loc["ttft_p90_ms"]
    assert nf["start_df"] == 3 and nf["round_df"] == 12
    assert 0.01 < nf["start_to_start"] < 0.05 and nf["round_to_round"] < nf["start_to_start"]


def test_counts_that_can_be_zero_use_a_linear_scale():
    df = _rounds({"a": np.array([[0.0, 2.0, 1.0], [1.0, 1.0, 0.0]])}, "preemptions")
    row = analysis.point_intervals(df, ["preemptions"]).iloc[0]
    assert row["scale"] == "linear" and row["value"] == pytest.approx(np.mean([1.0, 1.0]))


def _benchmark(name: str):
    import importlib.util
    path = REPO / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_rerun_check_accepts_a_rerun_from_the_same_servers_and_flags_a_shifted_one():
    from types import SimpleNamespace
    rerun_check = _benchmark("rerun_check")
    rng = np.random.default_rng(7)
    truth = {f"p{i}": 1000.0 * (1 + i / 4) for i in range(12)}
    from vllm_study.report.run import interval_row
    published = analysis.point_intervals(_rounds(_grid(rng, truth, 2, 2, 0.10, 0.03)))
    study = SimpleNamespace(interval=lambda point, metric: interval_row(published, point, metric))
    same = _grid(rng, {"p0": truth["p0"], "p5": truth["p5"]}, 1, 2, 0.10, 0.03)
    shifted = {p: v * 1.6 for p, v in same.items()}  # the +35-40% kind of drift, and more
    ok = rerun_check.check(study, SimpleNamespace(rounds=_rounds(same)), ["ttft_p90_ms"])
    bad = rerun_check.check(study, SimpleNamespace(rounds=_rounds(shifted)), ["ttft_p90_ms"])
    assert list(ok["point"]) == ["p0", "p5"] and ok["in prediction"].all()
    assert not bad["in prediction"].any() and not bad["in CI"].any()
    assert np.allclose(bad["re-run"], ok["re-run"] * 1.6)


def test_prefix_budget_rounds_show_which_rounds_lost_the_shared_prefix():
    each_round = _benchmark("prefix_budget_effect")._each_round
    rows = []
    for point, start, rnd, hit, p90, deferred in (("on", 1, 0, 0.06, 2000.0, 8), ("off", 1, 0, 0.24, 700.0, None)):
        rows.append({"point": point, "start": start, "round": rnd, "round_status": "ok", "group": "all",
                     "group_value": None, "prefix_cache_hit_rate": hit, "expected_prefix_hit_rate": 0.25,
                     "ttft_p90_ms": p90, "pb_deferred": deferred, "pb_admitted_by_age": 0})
        for cls, share in (("cold", 1.1), ("shared", 0.9)):
            rows.append({"point": point, "start": start, "round": rnd, "round_status": "ok", "group": "class",
                         "group_value": cls, "ttft_p90_ms": p90 * share})
    rows.append({**rows[0], "round": 1, "round_status": "failed"})  # not measured: left out
    out = each_round(pd.DataFrame(rows), ["cold", "shared"])
    assert list(out.index) == [("off", 1, 0), ("on", 1, 0)]
    assert out.loc[("on", 1, 0), "of never-evicting"] == pytest.approx(0.24)
    assert out.loc[("off", 1, 0), "of never-evicting"] == pytest.approx(0.96)
    assert out.loc[("on", 1, 0), "cold TTFT P90 ms"] == pytest.approx(2200.0)
    assert out.loc[("on", 1, 0), "deferred"] == 8 and np.isnan(out.loc[("off", 1, 0), "deferred"])


def _agreement_runs(rng, n: int, kit_clock_ms: float, bench_clock_ms: float, bench_tpot: float = 1.0) -> dict:
    """Runs of two clients on one server: each run's server-side TTFT scatters ~8% (the
    load), the client adds its own clock share on top."""
    runs = {"kit": [], "vllm_bench": []}
    for who, clock, tpot in (("kit", kit_clock_ms, 1.0), ("vllm_bench", bench_clock_ms, bench_tpot)):
        for i in range(n):
            server = 25.0 * float(np.exp(rng.normal(0, 0.08)))
            tpot_ms = 5.1 * tpot * float(np.exp(rng.normal(0, 0.005)))
            runs[who].append({"ttft_ms": server + clock, "ttft_mean_ms": server + clock + 2.0,
                              "server_ttft_mean_ms": server + 2.0, "tpot_ms": tpot_ms, "itl_ms": 5.0, "order": i})
    return runs


def test_client_agreement_separates_the_clock_from_the_load():
    agreement = _benchmark("client_agreement").agreement
    rng = np.random.default_rng(3)
    same = agreement(_agreement_runs(rng, 8, 4.0, 4.0))
    # equal clocks, load noise only: no disagreement is claimed on any figure
    assert not any(x["verdict"].startswith("DISAGREE") for x in same.values())
    assert same["tpot_ms"]["verdict"] == "agree within +-2%"
    shifted = agreement(_agreement_runs(rng, 8, 4.0, 6.0, bench_tpot=1.04))
    low, high = shifted["clock_ms"]["diff_ms"][1:]
    assert low < -2.0 < high and shifted["clock_ms"]["verdict"].startswith("DISAGREE")
    assert shifted["tpot_ms"]["verdict"].startswith("DISAGREE") and shifted["tpot_ms"]["diff"][0] < -0.03
