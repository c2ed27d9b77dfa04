"""Per-round statistics (DESIGN.md section 3) and per-point medians across rounds."""
from __future__ import annotations

import math

import numpy as np
import pytest

from vllm_study.client import RequestResult
from vllm_study.stats import point_medians, round_stats


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


def test_result_dict_fields_match_what_round_stats_reads(results):
    assert set(results[0]) == {"index", "send_time", "prompt_tokens", "output_tokens", "ttft_s",
                               "e2e_s", "itl_s", "error", "error_detail", "tags", "text"}


def test_counts_and_errors_by_kind(results):
    s = round_stats(results, duration_s=2.0)
    assert s["requests"] == 7
    assert s["completed"] == 4
    assert s["failed"] == 3
    assert s["errors"] == {"http_5xx": 2, "timeout": 1}
    assert s["duration_s"] == 2.0


def test_ttft_percentiles_in_ms_match_numpy(results):
    s = round_stats(results, duration_s=2.0)
    ttft_ms = np.array([100.0, 200.0, 50.0, 300.0])  # failed requests are excluded
    for p in (50, 90, 99):
        assert s[f"ttft_p{p}_ms"] == pytest.approx(np.percentile(ttft_ms, p))
    assert s["ttft_mean_ms"] == pytest.approx(162.5)
    assert s["ttft_std_ms"] == pytest.approx(ttft_ms.std())
    assert s["ttft_p50_ms"] == pytest.approx(150.0)


def test_itl_is_pooled_across_requests(results):
    s = round_stats(results, duration_s=2.0)
    pooled = np.array([0.10] * 3 + [0.15] * 4 + [0.05, 0.15]) * 1000
    assert s["itl_mean_ms"] == pytest.approx(pooled.mean())
    # a mean of per-request means would differ: the pooling is what is defined
    per_request_mean = np.mean([100.0, 150.0, 100.0])
    assert not math.isclose(s["itl_mean_ms"], per_request_mean)
    for p in (50, 90, 99):
        assert s[f"itl_p{p}_ms"] == pytest.approx(np.percentile(pooled, p))


def test_tpot_is_e2e_minus_ttft_over_tokens_minus_one(results):
    s = round_stats(results, duration_s=2.0)
    tpot_ms = np.array([(0.4 - 0.1) / 3, (0.8 - 0.2) / 4, (0.25 - 0.05) / 2]) * 1000
    assert s["tpot_mean_ms"] == pytest.approx(tpot_ms.mean())
    assert s["tpot_p50_ms"] == pytest.approx(np.median(tpot_ms))
    assert s["tpot_p90_ms"] == pytest.approx(np.percentile(tpot_ms, 90))
    # and it agrees with RequestResult.tpot_s
    r = RequestResult(**results[1])
    assert r.tpot_s * 1000 == pytest.approx(150.0)


def test_e2e_and_throughputs(results):
    s = round_stats(results, duration_s=2.0)
    assert s["e2e_p50_ms"] == pytest.approx(np.median([400.0, 800.0, 250.0, 300.0]))
    assert s["output_tokens"] == 4 + 5 + 3 + 1
    assert s["prompt_tokens"] == 100 + 120 + 100 + 100
    assert s["request_throughput"] == pytest.approx(4 / 2.0)
    assert s["output_throughput"] == pytest.approx(13 / 2.0)
    assert s["total_token_throughput"] == pytest.approx((420 + 13) / 2.0)
    assert "goodput" not in s  # no SLO, no goodput


def test_goodput_with_ttft_slo(results):
    s = round_stats(results, duration_s=2.0, slo_ttft_ms=150)
    # TTFTs 100, 200, 50, 300 ms: two meet 150 ms
    assert s["goodput"] == pytest.approx(2 / 2.0)
    assert s["slo_attainment"] == pytest.approx(2 / 7)  # failed requests count against it


def test_goodput_with_ttft_and_tpot_slo(results):
    # TPOTs: 100, 150, 100 ms; request 3 has one token (TPOT undefined: TTFT alone decides)
    s = round_stats(results, duration_s=4.0, slo_ttft_ms=250, slo_tpot_ms=120)
    # req0: ttft 100 ok, tpot 100 ok -> good; req1: tpot 150 > 120 -> bad
    # req2: ttft 50, tpot 100 -> good; req3: ttft 300 > 250 -> bad
    assert s["goodput"] == pytest.approx(2 / 4.0)
    assert s["slo_attainment"] == pytest.approx(2 / 7)
    s = round_stats(results, duration_s=4.0, slo_tpot_ms=120)
    # TPOT only: req0, req2, and req3 (no TPOT to miss) are good
    assert s["goodput"] == pytest.approx(3 / 4.0)


def test_all_failed_round_has_none_latencies():
    s = round_stats([_failed(0, "connection"), _failed(1, "connection")], duration_s=1.0,
                    slo_ttft_ms=100)
    assert s["completed"] == 0 and s["failed"] == 2
    assert s["errors"] == {"connection": 2}
    for name in ("ttft", "itl", "tpot", "e2e"):
        assert s[f"{name}_p50_ms"] is None and s[f"{name}_mean_ms"] is None
    assert s["request_throughput"] == 0.0
    assert s["goodput"] == 0.0 and s["slo_attainment"] == 0.0


def test_zero_duration_gives_none_throughput(results):
    s = round_stats(results, duration_s=0.0)
    assert s["request_throughput"] is None and s["output_throughput"] is None


# ---------------------------------------------------------------- across rounds

def test_point_medians_median_min_max():
    rounds = [
        {"round": 0, "ttft_p50_ms": 10.0, "output_throughput": 300.0, "errors": {}, "status": "ok"},
        {"round": 1, "ttft_p50_ms": 30.0, "output_throughput": 100.0, "errors": {}, "status": "ok"},
        {"round": 2, "ttft_p50_ms": 20.0, "output_throughput": 200.0, "errors": {"timeout": 1},
         "status": "ok"},
    ]
    m = point_medians(rounds)
    assert m["ttft_p50_ms"] == 20.0
    assert m["ttft_p50_ms__min"] == 10.0 and m["ttft_p50_ms__max"] == 30.0
    assert m["output_throughput"] == 200.0
    assert m["output_throughput__min"] == 100.0 and m["output_throughput__max"] == 300.0
    # the round number and non-numeric columns are not metrics
    assert "round" not in m and "status" not in m and "errors" not in m


def test_point_medians_skip_none_rounds():
    rounds = [
        {"round": 0, "ttft_p50_ms": 10.0, "prefix_cache_hit_rate": None},
        {"round": 1, "ttft_p50_ms": None, "prefix_cache_hit_rate": 0.5},
        {"round": 2, "ttft_p50_ms": 40.0, "prefix_cache_hit_rate": 0.7},
    ]
    m = point_medians(rounds)
    assert m["ttft_p50_ms"] == 25.0           # median of the two rounds that have it
    assert m["ttft_p50_ms__min"] == 10.0 and m["ttft_p50_ms__max"] == 40.0
    assert m["prefix_cache_hit_rate"] == pytest.approx(0.6)
    assert m["prefix_cache_hit_rate__min"] == pytest.approx(0.5)


def test_point_medians_metric_none_in_every_round_is_none():
    rounds = [{"round": i, "ttft_p50_ms": 10.0 * (i + 1), "gpu_util_mean": None} for i in range(3)]
    m = point_medians(rounds)
    assert m["ttft_p50_ms"] == 20.0
    # on a machine without a GPU the field is there and None ("said plainly")
    assert "gpu_util_mean" in m and m["gpu_util_mean"] is None
    assert "gpu_util_mean__min" not in m


def test_point_medians_of_real_round_stats(results):
    rounds = [{"round": i, **round_stats(results, duration_s=d)} for i, d in enumerate((1.0, 2.0, 4.0))]
    m = point_medians(rounds)
    assert m["request_throughput"] == pytest.approx(2.0)          # 4/1, 4/2, 4/4
    assert m["request_throughput__max"] == pytest.approx(4.0)
    assert m["ttft_p50_ms"] == pytest.approx(150.0)               # same in every round
    assert m["failed"] == 3.0


def test_group_stats_split_by_tag():
    rows = [_ok(i, ttft=0.1 * (i + 1), e2e=1.0, out=3, itl=[0.01, 0.02]) for i in range(4)]
    for r, cls in zip(rows, ["long", "short", "short", "long"]):
        r["tags"] = {"class": cls}
    rows.append({**_failed(9, "timeout"), "tags": {"class": "short"}})
    from vllm_study.stats import group_stats
    g = group_stats(rows)
    assert g["requests[class=long]"] == 2 and g["requests[class=short]"] == 3
    assert g["failed[class=short]"] == 1 and g["failed[class=long]"] == 0
    assert g["ttft_p50_ms[class=long]"] == pytest.approx(np.percentile([100, 400], 50))
    assert g["ttft_p50_ms[class=short]"] == pytest.approx(np.percentile([200, 300], 50))
    assert not any("turn=" in k or "step=" in k for k in g)  # only tags that are present


def test_group_stats_rate_steps_are_labelled_compactly():
    rows = [_ok(i, ttft=0.1, e2e=1.0, out=3, itl=[0.01]) for i in range(2)]
    rows[0]["tags"], rows[1]["tags"] = {"step": 10.0}, {"step": 20.0}
    from vllm_study.stats import group_stats
    g = group_stats(rows)
    assert "ttft_p99_ms[step=10]" in g and "ttft_p99_ms[step=20]" in g
