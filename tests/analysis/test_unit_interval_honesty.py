"""Intervals a point's own rounds cannot contradict (analysis.MetricData.spread): a figure
the workload fixes is exact where it is constant; a measured figure constant over the
rounds of one start has not been measured to be constant; a point whose own spread is
clearly larger than the pooled one gets its own; and the binding table names the
aggregate (maximum or median over rounds) each of its columns shows."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
from scipy import stats as sps

from vllm_study.analysis import intervals as analysis
from vllm_study.vocab import metrics
from vllm_study.report import binding, effects


def _rounds(values: dict[str, list[list[float]]], metric: str) -> pd.DataFrame:
    """A summary.csv-shaped frame: values[point] is a list of starts, each a list of rounds."""
    rows = []
    for point, starts in values.items():
        for s, start in enumerate(starts, 1):
            for r, v in enumerate(start):
                rows.append({"point": point, "start": s, "round": r, "group": "all", "group_value": "",
                             "round_status": "ok", metric: v})
    return pd.DataFrame(rows)


def _iv(df: pd.DataFrame, metric: str) -> pd.DataFrame:
    return analysis.point_intervals(df, [metric]).set_index("point")


def test_the_registry_marks_only_workload_figures_exact():
    exact = {n for n, m in metrics.REGISTRY.items() if m.exact}
    assert {"expected_prefix_hit_rate", "prompt_tokens", "trace_prompt_tokens", "requests",
            "prompt_tokens_vs_trace"} <= exact
    assert not exact & {"prefix_cache_hit_rate", "kv_usage_peak", "ttft_p90_ms", "startup_s", "capacity_rps"}


def test_an_exact_figure_constant_over_rounds_is_exact_even_where_others_scatter():
    """The never-evicting hit rate, one start per point: a and b the same in every round,
    c not. Pooling c's spread gave a and b an interval; they are exact, and so is their
    difference, which resolves."""
    m = "expected_prefix_hit_rate"
    df = _rounds({"a": [[0.25, 0.25, 0.25]], "b": [[0.50, 0.50, 0.50]], "c": [[0.30, 0.34, 0.32]]}, m)
    iv = _iv(df, m)
    for p, v in (("a", 0.25), ("b", 0.50)):
        assert iv.at[p, "ci_low"] == pytest.approx(v) and iv.at[p, "ci_high"] == pytest.approx(v)
        assert iv.at[p, "method"].startswith("exact")
        assert iv.at[p, "next_start_low"] == pytest.approx(v) == iv.at[p, "next_start_high"]
    assert iv.at["c", "ci_low"] < iv.at["c", "value"] < iv.at["c", "ci_high"]  # c keeps an interval
    data = analysis.MetricData.from_rounds(df, m)
    d = analysis.difference(data, "b", "a")
    assert d.low == d.high == pytest.approx(d.estimate) and d.resolved
    # an exact point against one with spread: the interval is the other point's alone
    dc = analysis.difference(data, "c", "a")
    assert dc.low < dc.estimate < dc.high


def test_a_measured_figure_constant_over_one_starts_rounds_is_not_called_exact():
    """The measured prefix-cache hit rate, one start per point, the same in every round at
    each point: the old code gave zero-width intervals and called 0.60 vs 0.61 resolved.
    Equal rounds do not measure how a restart moves it: no interval, nothing resolved."""
    m = "prefix_cache_hit_rate"
    df = _rounds({"a": [[0.60, 0.60, 0.60]], "b": [[0.61, 0.61, 0.61]]}, m)
    iv = _iv(df, m)
    assert iv["ci_low"].isna().all() and iv["ci_high"].isna().all()
    assert iv["method"].str.contains("rounds identical; start-to-start variation not measured").all()
    assert all(analysis.relative_width(row) == float("inf") for row in iv.itertuples())
    data = analysis.MetricData.from_rounds(df, m)
    d = analysis.difference(data, "b", "a")
    assert not d.resolved and d.verdict() == "not resolved"
    assert effects._diff_cell(d).endswith("not resolved") and "no spread measured" in effects._change_text(d)
    assert analysis.versus_best(df, m)["tied_with_best"].all()


def test_a_constant_kv_peak_does_not_borrow_another_points_spread():
    """KV peak 22.05% in every round was shown as [19.4%, 25.1%], pooled from a point whose
    rounds scattered."""
    m = "kv_usage_peak"
    df = _rounds({"flat": [[0.2205, 0.2205, 0.2205]], "busy": [[0.40, 0.52, 0.46]]}, m)
    iv = _iv(df, m)
    assert iv.at["flat", "value"] == pytest.approx(0.2205)
    assert np.isnan(iv.at["flat", "ci_low"]) and "rounds identical" in iv.at["flat", "method"]
    assert iv.at["busy", "ci_low"] < iv.at["busy", "value"] < iv.at["busy", "ci_high"]


def test_a_measured_point_with_several_identical_starts_keeps_the_pooled_start_spread():
    """Start-to-start spread was measured at other points: another start of this one may
    still differ, so its interval stays the pooled one."""
    m = "kv_usage_peak"
    df = _rounds({"flat": [[0.22, 0.22], [0.22, 0.22]], "busy": [[0.40, 0.41], [0.50, 0.49]]}, m)
    iv = _iv(df, m)
    assert iv.at["flat", "ci_low"] < 0.22 < iv.at["flat", "ci_high"]
    assert iv.at["flat", "method"] == "t over server starts, spread pooled over points"


def test_a_point_whose_rounds_scatter_clearly_more_gets_its_own_spread():
    """One start per point: six quiet points (about 1% round to round) and one whose rounds
    span 50-150. The pooled spread gave it far too narrow an interval; it gets the t
    interval of its own rounds (sd of its logs, df 2)."""
    m = "ttft_p90_ms"
    quiet = {f"q{i}": [[100.0 + i, 101.0 + i, 99.0 + i]] for i in range(6)}
    noisy = [50.0, 150.0, 100.0]
    df = _rounds({**quiet, "noisy": [noisy]}, m)
    iv = _iv(df, m)
    logs = np.log(noisy)
    half = sps.t.ppf(0.975, 2) * logs.std(ddof=1) / np.sqrt(3)
    assert iv.at["noisy", "df"] == 2 and "own rounds" in iv.at["noisy", "method"]
    assert np.log(iv.at["noisy", "ci_high"] / iv.at["noisy", "ci_low"]) == pytest.approx(2 * half)
    # the quiet points keep the pooled round spread
    assert iv.loc[[f"q{i}" for i in range(6)], "df"].eq(analysis.MetricData.from_rounds(df, m).noise().round_df).all()
    assert not iv.loc["q0", "method"].startswith("t over this point")


def test_a_point_whose_starts_scatter_clearly_more_gets_its_own_start_spread():
    """Two starts per point: eight points whose restarts move ~2%, one whose two starts
    are 100 and 300. Its interval is its own starts' t interval (df 1); the others keep
    the pooled start spread."""
    m = "ttft_p90_ms"
    quiet = {f"q{i}": [[100.0 * (1 + i / 10)] * 2, [102.0 * (1 + i / 10)] * 2] for i in range(8)}
    df = _rounds({**quiet, "wild": [[100.0, 100.0], [300.0, 300.0]]}, m)
    iv = _iv(df, m)
    s = np.log([100.0, 300.0])
    half = sps.t.ppf(0.975, 1) * s.std(ddof=1) / np.sqrt(2)
    assert iv.at["wild", "df"] == 1 and "own server starts" in iv.at["wild", "method"]
    assert np.log(iv.at["wild", "ci_high"] / iv.at["wild", "ci_low"]) == pytest.approx(2 * half)
    assert (iv.loc[[f"q{i}" for i in range(8)], "method"] == "t over server starts, spread pooled over points").all()


def _run(df: pd.DataFrame, axes=("gpu_memory_utilization",)) -> SimpleNamespace:
    points = list(dict.fromkeys(df["point"]))
    return SimpleNamespace(rounds=df, axes=list(axes),
                           measured=[SimpleNamespace(point=p, effective=None) for p in points])


def test_the_binding_table_names_the_aggregate_it_shows():
    """The per-point KV peak is a median with its interval (3.7%); the binding table's is
    the maximum over rounds (4.3%): its column and notes say so."""
    m = "kv_usage_peak"
    df = _rounds({"a": [[0.033, 0.037, 0.043]]}, m)
    df["prefix_cache_hit_rate"] = [0.5, 0.6, 0.7]
    t = binding.binding_table(_run(df))
    assert t.at["a", "KV peak (max over rounds)"] == "4.3%"
    assert t.at["a", "hit rate (median)"] == "0.600"
    assert "KV peak" not in t.columns and "hit rate" not in t.columns
    assert _iv(df, m).at["a", "value"] == pytest.approx(0.037)  # the median: a different statistic
    notes = binding.binding_notes(_run(df))
    assert notes == ["gpu_memory_utilization never bound: KV peak (maximum over rounds) at most 4.3% at every "
                     "point and no preemption; this study cannot show its effect"]
    df2 = _rounds({"a": [[0.5, 0.95]], "b": [[0.2, 0.3]]}, m)
    assert "KV peak, maximum over rounds, >= 90%" in binding.binding_notes(_run(df2))[0]
