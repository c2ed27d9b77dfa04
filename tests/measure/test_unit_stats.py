"""Per-round statistics (as lib/vllm_study/vocab/metrics.py defines them), per-group records, and per-point
estimates across rounds and server starts (median and range; intervals are checked in
test_unit_statistics.py)."""
from __future__ import annotations

import math

import numpy as np
import pytest

from vllm_study.measure.client import RequestResult
from vllm_study.records.results import Estimate, GroupRecord, RoundRecord
from vllm_study.measure.stats import errors, estimate, group_records, point_estimates, round_metrics


def _ok(index, ttft, e2e, out, itl, prompt=100):
    return RequestResult(index=index, send_time=float(index), prompt_tokens=prompt,
                         output_tokens=out, ttft_s=ttft, e2e_s=e2e, itl_s=list(itl)).to_dict()


def _failed(index, kind):
    return RequestResult(index=index, send_time=float(index), error=kind,
                         error_detail=f"{kind} detail").to_dict()


@pytest.fixture
def results():
    return [
        _ok(0, ttft=0.100, e2e=0.400, out=4, itl=[0.10, 0.10, 0.10]),
        _ok(1, ttft=0.200, e2e=0.800, out=5, itl=[0.15, 0.15, 0.15, 0.15], prompt=120),
        _ok(2, ttft=0.050, e2e=0.250, out=3, itl=[0.05, 0.15]),
        _ok(3, ttft=0.300, e2e=0.300, out=1, itl=[]),  # one token: no TPOT
        _failed(4, "http_5xx"),
        _failed(5, "timeout"),
        _failed(6, "http_5xx"),
    ]


def test_result_dict_fields_match_what_round_metrics_reads(results):
    assert set(results[0]) == {"index", "send_time", "end_time", "due_time", "prompt_tokens", "output_tokens",
                               "ttft_s", "e2e_s", "itl_s", "error", "error_detail", "tags", "text"}


def test_counts_and_errors_by_kind(results):
    s = round_metrics(results, duration_s=2.0)
    assert s["requests"] == 7
    assert s["completed"] == 4
    assert s["failed"] == 3
    assert s["duration_s"] == 2.0
    # errors by kind are the round record's own field, not a metric
    assert "errors" not in s
    assert errors(results) == {"http_5xx": 2, "timeout": 1}
    assert errors(results[:4]) == {}


def test_round_metrics_are_all_registered_metrics(results):
    """RoundRecord refuses names outside the metric registry: every figure a round
    produces must be storable as is."""
    s = round_metrics(results, duration_s=2.0, slo={"ttft_p99_ms": 150, "tpot_p50_ms": 100})
    rec = RoundRecord(point="p", start=1, round=0, status="ok", utc="t", metrics=s)
    assert rec.metrics == s
    with pytest.raises(ValueError, match="not in the metric registry"):
        RoundRecord(point="p", start=1, round=0, status="ok", utc="t", metrics={"errors": 1.0})


def test_earlier_runs_records_load_under_current_names():
    """A round recorded before a metric was renamed keeps its value under the new name;
    one whose meaning was wrong is dropped (other unknown names are refused: above)."""
    old = {"engine_steps": 120.0, "step_tokens": 6000.0, "tokens_per_step": 50.0,
           "budget_steps_share": 0.4, "completed": 8.0}
    rec = RoundRecord(point="p", start=1, round=0, status="ok", utc="t", metrics=old)
    assert rec.metrics == {"output_steps": 120.0, "computed_tokens": 6000.0,
                           "tokens_per_output_step": 50.0, "completed": 8.0}


def test_ttft_percentiles_in_ms_match_numpy(results):
    s = round_metrics(results, duration_s=2.0)
    ttft_ms = np.array([100.0, 200.0, 50.0, 300.0])  # failed requests are excluded
    for p in (50, 90, 99):
        assert s[f"ttft_p{p}_ms"] == pytest.approx(np.percentile(ttft_ms, p))
    assert s["ttft_mean_ms"] == pytest.approx(162.5)
    assert s["ttft_std_ms"] == pytest.approx(ttft_ms.std())
    assert s["ttft_p50_ms"] == pytest.approx(150.0)


def test_itl_is_pooled_across_requests(results):
    s = round_metrics(results, duration_s=2.0)
    pooled = np.array([0.10] * 3 + [0.15] * 4 + [0.05, 0.15]) * 1000
    assert s["itl_mean_ms"] == pytest.approx(pooled.mean())
    # a mean of per-request means would differ: the pooling is what is defined
    per_request_mean = np.mean([100.0, 150.0, 100.0])
    assert not math.isclose(s["itl_mean_ms"], per_request_mean)
    for p in (50, 90, 99):
        assert s[f"itl_p{p}_ms"] == pytest.approx(np.percentile(pooled, p))


def test_tpot_is_e2e_minus_ttft_over_tokens_minus_one(results):
    s = round_metrics(results, duration_s=2.0)
    tpot_ms = np.array([(0.4 - 0.1) / 3, (0.8 - 0.2) / 4, (0.25 - 0.05) / 2]) * 1000
    assert s["tpot_mean_ms"] == pytest.approx(tpot_ms.mean())
    assert s["tpot_p50_ms"] == pytest.approx(np.median(tpot_ms))
    assert s["tpot_p90_ms"] == pytest.approx(np.percentile(tpot_ms, 90))
    # and it agrees with RequestResult.tpot_s
    r = RequestResult(**results[1])
    assert r.tpot_s * 1000 == pytest.approx(150.0)


def test_e2e_and_throughputs(results):
    s = round_metrics(results, duration_s=2.0)
    assert s["e2e_p50_ms"] == pytest.approx(np.median([400.0, 800.0, 250.0, 300.0]))
    assert s["output_tokens"] == 4 + 5 + 3 + 1
    assert s["prompt_tokens"] == 100 + 120 + 100 + 100
    assert s["request_throughput"] == pytest.approx(4 / 2.0)
    assert s["output_throughput"] == pytest.approx(13 / 2.0)
    assert s["total_token_throughput"] == pytest.approx((420 + 13) / 2.0)
    assert "goodput" not in s  # no SLO, no goodput
    # an SLO with no bound set is no SLO either
    s = round_metrics(results, duration_s=2.0, slo={})
    assert "goodput" not in s and "slo_attainment" not in s


def test_goodput_with_ttft_slo(results):
    s = round_metrics(results, duration_s=2.0, slo={"ttft_p99_ms": 150})
    # TTFTs 100, 200, 50, 300 ms: two meet 150 ms
    assert s["goodput"] == pytest.approx(2 / 2.0)
    assert s["slo_attainment"] == pytest.approx(2 / 7)  # failed requests count against it


def test_goodput_with_ttft_and_tpot_slo(results):
    # TPOTs: 100, 150, 100 ms; request 3 has one token (TPOT undefined: TTFT alone decides)
    s = round_metrics(results, duration_s=4.0, slo={"ttft_p99_ms": 250, "tpot_p99_ms": 120})
    # req0: ttft 100 ok, tpot 100 ok -> good; req1: tpot 150 > 120 -> bad
    # req2: ttft 50, tpot 100 -> good; req3: ttft 300 > 250 -> bad
    assert s["goodput"] == pytest.approx(2 / 4.0)
    assert s["slo_attainment"] == pytest.approx(2 / 7)
    s = round_metrics(results, duration_s=4.0, slo={"tpot_p50_ms": 120})
    # TPOT only: req0, req2, and req3 (no TPOT to miss) are good
    assert s["goodput"] == pytest.approx(3 / 4.0)


def test_goodput_with_an_itl_bound_uses_each_requests_own_gaps(results):
    """itl_p99_ms: 40 -> a request meets it when the P99 of its own gaps is within 40 ms."""
    own = [np.percentile(r["itl_s"], 99) * 1000 if r["itl_s"] else None for r in results if r["error"] is None]
    want = sum(1 for v in own if v is None or v <= 40)
    s = round_metrics(results, duration_s=2.0, slo={"itl_p99_ms": 40})
    assert s["goodput"] == pytest.approx(want / 2.0)


def test_all_failed_round_has_none_latencies():
    failed = [_failed(0, "connection"), _failed(1, "connection")]
    s = round_metrics(failed, duration_s=1.0, slo={"ttft_p90_ms": 100})
    assert s["completed"] == 0 and s["failed"] == 2
    assert errors(failed) == {"connection": 2}
    for name in ("ttft", "itl", "tpot", "e2e"):
        assert s[f"{name}_p50_ms"] is None and s[f"{name}_mean_ms"] is None
    assert s["request_throughput"] == 0.0
    assert s["goodput"] == 0.0 and s["slo_attainment"] == 0.0


def test_zero_duration_gives_none_throughput(results):
    s = round_metrics(results, duration_s=0.0)
    assert s["request_throughput"] is None and s["output_throughput"] is None


# ---------------------------------------------------------------- across rounds
# (were point_medians; now estimate / point_estimates: median, min and max over the pooled
# rounds of every server start, None values skipped)

def test_estimate_median_min_max():
    e = estimate([[10.0, 30.0, 20.0]])
    assert isinstance(e, Estimate)
    assert e.median == 20.0
    assert e.min == 10.0 and e.max == 30.0
    assert e.rounds == 3 and e.starts == 1
    e = estimate([[300.0, 100.0, 200.0]])
    assert (e.median, e.min, e.max) == (200.0, 100.0, 300.0)


def test_estimate_pools_rounds_of_every_start():
    e = estimate([[10.0, 20.0], [30.0, 40.0, 50.0]])
    assert e.median == 30.0 and (e.min, e.max) == (10.0, 50.0)
    assert e.rounds == 5 and e.starts == 2


def test_estimate_skips_none_rounds():
    e = estimate([[10.0, None, 40.0]])
    assert e.median == 25.0           # median of the two rounds that have it
    assert e.min == 10.0 and e.max == 40.0 and e.rounds == 2
    e = estimate([[None, 0.5, 0.7]])
    assert e.median == pytest.approx(0.6) and e.min == pytest.approx(0.5)
    # a start whose rounds all lack the value is no start for it
    e = estimate([[None, None], [1.0, 3.0]])
    assert e.starts == 1 and e.median == 2.0


def test_estimate_none_in_every_round_is_none():
    assert estimate([[None, None, None]]) is None
    assert estimate([[None], [None, None]]) is None
    assert estimate([]) is None


def _round(i, metrics, start=1, status="ok", groups=()):
    return RoundRecord(point="p", start=start, round=i, status=status, utc="2026-11-30T00:00:00+00:00",
                       metrics=metrics, groups=list(groups))


def test_point_estimates_per_metric_over_ok_rounds():
    rounds = [
        _round(0, {"ttft_p50_ms": 10.0, "output_throughput": 300.0}),
        _round(1, {"ttft_p50_ms": 30.0, "output_throughput": 100.0}),
        _round(2, {"ttft_p50_ms": 20.0, "output_throughput": 200.0}),
        # a failed round is no measurement: its numbers must not move the estimate
        _round(3, {"ttft_p50_ms": 9999.0, "output_throughput": 0.0}, status="failed"),
    ]
    m = point_estimates(rounds)
    assert set(m) == {"ttft_p50_ms", "output_throughput"}  # only metrics, nothing else
    assert m["ttft_p50_ms"].median == 20.0
    assert m["ttft_p50_ms"].min == 10.0 and m["ttft_p50_ms"].max == 30.0
    assert m["output_throughput"].median == 200.0
    assert m["output_throughput"].min == 100.0 and m["output_throughput"].max == 300.0
    assert m["ttft_p50_ms"].rounds == 3


def test_point_estimates_skip_none_and_leave_out_metrics_that_are_always_none():
    rounds = [_round(i, {"ttft_p50_ms": 10.0 * (i + 1), "gpu_util_mean": None,
                         "prefix_cache_hit_rate": None if i == 0 else 0.4 + 0.2 * i}) for i in range(3)]
    m = point_estimates(rounds)
    assert m["ttft_p50_ms"].median == 20.0
    assert m["prefix_cache_hit_rate"].median == pytest.approx(0.7) and m["prefix_cache_hit_rate"].rounds == 2
    # on a machine without a GPU there is nothing to estimate: no entry (the round
    # records keep the None, "said plainly")
    assert "gpu_util_mean" not in m


def test_point_estimates_count_server_starts():
    rounds = [_round(i, {"ttft_p50_ms": v}, start=s) for s, vals in ((1, [10.0, 12.0]), (2, [20.0, 22.0, 24.0]))
              for i, v in enumerate(vals)]
    e = point_estimates(rounds)["ttft_p50_ms"]
    assert (e.starts, e.rounds, e.median, e.min, e.max) == (2, 5, 20.0, 10.0, 24.0)
    assert point_estimates(rounds) == point_estimates(rounds)  # replays


def test_point_estimates_of_real_round_metrics(results):
    rounds = [_round(i, round_metrics(results, duration_s=d)) for i, d in enumerate((1.0, 2.0, 4.0))]
    m = point_estimates(rounds)
    assert m["request_throughput"].median == pytest.approx(2.0)          # 4/1, 4/2, 4/4
    assert m["request_throughput"].max == pytest.approx(4.0)
    assert m["ttft_p50_ms"].median == pytest.approx(150.0)               # same in every round
    assert m["failed"].median == 3.0


# ---------------------------------------------------------------- per group

def _by_label(groups: list[GroupRecord]) -> dict[str, dict]:
    return {f"{g.key}={g.value}": g.metrics for g in groups}


def test_group_records_split_by_tag():
    rows = [_ok(i, ttft=0.1 * (i + 1), e2e=1.0, out=3, itl=[0.01, 0.02]) for i in range(4)]
    for r, cls in zip(rows, ["long", "short", "short", "long"]):
        r["tags"] = {"class": cls}
    rows.append({**_failed(9, "timeout"), "tags": {"class": "short"}})
    groups = group_records(rows)
    assert all(isinstance(g, GroupRecord) for g in groups)
    g = _by_label(groups)
    assert set(g) == {"class=long", "class=short"}  # only tags that are present
    assert g["class=long"]["requests"] == 2 and g["class=short"]["requests"] == 3
    assert g["class=short"]["failed"] == 1 and g["class=long"]["failed"] == 0
    assert g["class=long"]["ttft_p50_ms"] == pytest.approx(np.percentile([100, 400], 50))
    assert g["class=short"]["ttft_p50_ms"] == pytest.approx(np.percentile([200, 300], 50))


def test_group_records_rate_steps_are_labelled_compactly():
    rows = [_ok(i, ttft=0.1, e2e=1.0, out=3, itl=[0.01]) for i in range(2)]
    rows[0]["tags"], rows[1]["tags"] = {"step": 10.0}, {"step": 20.0}
    g = _by_label(group_records(rows))
    assert set(g) == {"step=10", "step=20"}
    assert "ttft_p99_ms" in g["step=10"] and "ttft_p99_ms" in g["step=20"]


def test_group_records_without_tags_are_empty(results):
    assert group_records(results) == []
