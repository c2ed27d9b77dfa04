"""Per-request ITL figures: each request's longest gap (its stall) and its mean gap, with
percentiles over the round's requests, beside the pooled ITL; as metrics, as SLO bounds a
study validates, as the capacity search's judge and fit read them."""
from __future__ import annotations

import numpy as np
import pytest

from vllm_study.capacity import fit
from vllm_study.capacity.bracket import meets_slo, margins
from vllm_study.define.study_file import study_from_dict
from vllm_study.measure.client import RequestResult
from vllm_study.measure.stats import request_value_ms, round_metrics
from vllm_study.capacity.estimate import step_from_requests
from vllm_study.vocab import metrics
from paths import REPO


def _req(i: int, stall_s: float | None, decode_s: float = 0.010, gaps: int = 255) -> dict:
    """A request of gaps+1 chunks: decode gaps, one of them a stall where stall_s is given."""
    itl = [decode_s] * gaps
    if stall_s is not None:
        itl[gaps // 2] = stall_s
    e2e = 0.1 + sum(itl)
    return RequestResult(index=i, send_time=float(i), prompt_tokens=100, output_tokens=gaps + 1, ttft_s=0.1,
                         e2e_s=e2e, itl_s=itl).to_dict()


def _round(stalled: int, stall_s: float, n: int = 20) -> list[dict]:
    return [_req(i, stall_s if i < stalled else None) for i in range(n)]


def test_a_stall_in_every_other_request_hides_below_the_pooled_p99_but_not_in_the_stall_p90():
    m = round_metrics(_round(10, 0.250), duration_s=10.0)
    # 10 stalls among 5100 gaps: 0.2%, below the pooled P99
    assert m["itl_p99_ms"] == pytest.approx(10.0)
    assert m["stall_p90_ms"] == pytest.approx(250.0) and m["stall_p99_ms"] == pytest.approx(250.0)
    assert m["stall_p50_ms"] == pytest.approx(130.0)          # median of ten 10 ms and ten 250 ms
    assert m["itl_mean_p90_ms"] == pytest.approx((254 * 10 + 250) / 255)
    assert m["itl_mean_p50_ms"] < m["itl_mean_p90_ms"]
    for name in ("stall_p50_ms", "stall_p90_ms", "stall_p99_ms", "itl_mean_p50_ms", "itl_mean_p90_ms",
                 "itl_mean_p99_ms"):
        assert metrics.get(name).better == "lower" and metrics.request_itl_figure(name)


def test_a_request_with_one_chunk_has_no_gap_and_no_stall():
    one = RequestResult(index=99, send_time=0.0, prompt_tokens=10, output_tokens=1, ttft_s=0.1, e2e_s=0.1,
                        itl_s=[]).to_dict()
    m = round_metrics(_round(0, 0.0) + [one], duration_s=10.0)
    assert m["stall_p99_ms"] == pytest.approx(10.0)
    assert request_value_ms(one, "stall_p90_ms") is None
    assert round_metrics([one], duration_s=1.0)["stall_p90_ms"] is None


def test_a_stall_bound_is_a_study_slo_and_each_request_meets_it_by_its_own_longest_gap():
    base = {"name": "s", "model": {"card": "tiny-qwen2"}, "grid": {"max_num_batched_tokens": [256]}}
    s = study_from_dict({**base, "slo": {"stall_p90_ms": 200, "itl_mean_p90_ms": 20, "itl_p99_ms": 50}})
    assert s.slo == {"stall_p90_ms": 200, "itl_mean_p90_ms": 20, "itl_p99_ms": 50}
    with pytest.raises(ValueError, match=r"slo\.stall_p95_ms.*stall_p90_ms"):
        study_from_dict({**base, "slo": {"stall_p95_ms": 200}})
    slo = {"stall_p90_ms": 200}
    m = round_metrics(_round(10, 0.250), duration_s=10.0, slo=slo)
    assert m["slo_attainment"] == pytest.approx(0.5)          # the ten stalled requests missed
    ok, why = meets_slo(m, slo)
    assert not ok and "stall_p90_ms 250 > 200" in why
    assert margins(m, slo) == {"stall_p90_ms": pytest.approx(1.25)}
    assert meets_slo(m, {"itl_p99_ms": 50})[0]                      # the pooled bound sees nothing


def test_capacity_fits_a_stall_bound_over_requests_not_over_pooled_gaps():
    """Stalls in more requests as the load rises: at 1 and 2 req/s one request in 20
    stalls (P90 met), at 4 req/s 10 of 20 (P90 missed); the pooled P99 never sees them."""
    bounds = fit.bounds_from_slo({"stall_p90_ms": 200, "itl_p99_ms": 50})
    steps = []
    for load, stalled in ((1.0, 1), (2.0, 1), (4.0, 10)):
        reqs = _round(stalled, 0.250)
        d = step_from_requests({"load": load}, reqs, bounds, round_metrics(reqs, 10.0))
        assert d is not None and len(d.latencies["stall_p90_ms"]) == 20
        assert all(len(v) == 1 for v in d.latencies["stall_p90_ms"])      # one value per request
        assert sum(len(v) for v in d.latencies["itl_p99_ms"]) == 20 * 255  # every gap, pooled
        steps.append(d)
    s = fit.fit_start(steps, bounds, n_resamples=99, seed=1)
    assert s.kind == "value" and 2.0 <= s.value < 4.0
    pooled_only = fit.fit_start(steps, fit.bounds_from_slo({"itl_p99_ms": 50}), n_resamples=99, seed=1)
    assert pooled_only.kind == "at_least"


def test_the_per_request_figure_names_are_the_registrys():
    assert metrics.request_itl_figure("stall_p90_ms") == "stall"
    assert metrics.request_itl_figure("itl_mean_p99_ms") == "itl_mean"
    assert metrics.request_itl_figure("itl_p99_ms") is None and metrics.request_itl_figure("itl_mean_ms") is None
    assert metrics.request_itl_ms(np.array([0.01, 0.3]), "stall") == pytest.approx(300.0)


def test_a_run_made_before_the_stall_figures_says_it_did_not_record_them(tmp_path):
    """A committed run has the pooled ITL but no per-request figures: its headline table
    stays as it was rendered (no stall column), and compare with a run that has them says
    which lacks it."""

    from synthetic_run import make_run
    from vllm_study import notebook_support as ns
    from vllm_study.report import compare, report

    old = REPO / "results" / "20261130T211048Z-h200-qwen2.5-72b-tp2-343f2b5"
    r = ns.load_run(ns.resolve_run(str(old)), quiet=True)
    t = report.headline_table(r)
    assert metrics.get("stall_p90_ms").title not in t.columns
    assert t[metrics.get("itl_p90_ms").title].str.contains(r"\[").all()
    points = ["mbt=256__kv=16MiB", "mbt=512__kv=16MiB"]
    a = make_run(tmp_path / "a", {p: {"itl_p90_ms": 25.0} for p in points})
    b = make_run(tmp_path / "b", {p: {"itl_p90_ms": 25.0, "stall_p90_ms": 180.0} for p in points})
    head, _, _ = compare.compare_runs(a.path, b.path)
    assert "stall P90: not recorded by A (made before the kit recorded it)" in head
    t = report.headline_table(ns.load_run(ns.resolve_run(str(b.path)), quiet=True))
    assert t.loc[points, metrics.get("stall_p90_ms").title].str.contains(r"\[").all()


def test_a_stall_bound_on_a_run_that_did_not_record_it_is_not_measured_and_never_met():

    from vllm_study import notebook_support as ns
    from vllm_study.analysis import decision

    old = REPO / "results" / "20261130T211048Z-h200-qwen2.5-72b-tp2-343f2b5"
    r = ns.load_run(ns.resolve_run(str(old)), quiet=True)
    t = decision.slo_table(r.intervals, {"stall_p90_ms": 200, "ttft_p90_ms": 5000})
    assert (t["stall P90 <= 200"] == "not measured").all() and (t["TTFT P90 <= 5000"] == "meets").all()
    assert not (t["SLO"] == "meets").any()
