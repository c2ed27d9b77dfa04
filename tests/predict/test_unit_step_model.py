"""The step-time model (predict/step_model.py) on synthetic step records with a known
answer: coefficients recovered, held-out error reported, extrapolation refused."""
import numpy as np
import pytest

from vllm_study.predict import step_model
from vllm_study.predict.step_model import Extrapolation, Scope, StepModel, fit
from vllm_study.scheduler_plugin import steps

TRUE = {"overhead_s": 0.012, "per_prefill_token_s": 22e-6, "per_prefill_req_s": 0.4e-3,
        "per_decode_req_s": 40e-6, "per_context_token_s": 0.15e-6, "per_prefill_attention_pair_s": 0.5e-9}
SCOPE = Scope(model="qwen2.5-7b", device="NVIDIA H100 80GB HBM3", dtype="bfloat16", vllm_version="0.26.0",
              engine="gpu", launch={"max_num_batched_tokens": 2048, "max_num_seqs": 256, "block_size": 16,
                                    "enforce_eager": False, "tensor_parallel_size": 1})


def synthetic_round(seed: int, n: int = 800, noise: float = 0.03, overlap: bool = False,
                    lead_req_s: float = 0.0) -> np.ndarray:
    """Steps whose time is TRUE's linear form times (1 + noise); back to back with a small
    gap (sync), or overlapped as async scheduling does (each scheduled before the previous
    output is back): either way steps.cycles gives each step's own time back. lead_req_s:
    overlapped steps also take this long for each prefill request of the next step (the
    admission work an async engine does while the step runs)."""
    rng = np.random.default_rng(seed)
    rows = np.zeros(n, dtype=steps.DTYPE)
    prefill = rng.random(n) < 0.4
    rows["prefill_reqs"] = np.where(prefill, rng.integers(1, 4, n), 0)
    rows["prefill_tokens"] = np.where(prefill, rng.integers(16, 2048, n), 0)
    rows["decode_reqs"] = rng.integers(0, 64, n)
    rows["decode_tokens"] = rows["decode_reqs"]
    rows["context_tokens"] = rows["decode_reqs"] * rng.integers(200, 4000, n)
    # one chunk a prefill step, late in its prompt or early: n x c + n (n + 1) / 2 pairs
    before = np.where(prefill, rng.integers(0, 16000, n), 0)
    tokens = rows["prefill_tokens"].astype(np.int64)
    rows["prefill_context_tokens"] = before
    rows["prefill_attention_pairs"] = tokens * before + tokens * (tokens + 1) // 2
    rows = rows[rows["prefill_tokens"] + rows["decode_tokens"] > 0]
    t = TRUE["overhead_s"] + sum(TRUE[f"per_{f.removesuffix('s')}_s"] * rows[f] for f in step_model.FEATURES)
    t = t * (1 + noise * rng.standard_normal(len(rows)))
    if overlap:
        t = t + lead_req_s * np.r_[rows["prefill_reqs"][1:], 0]
    done = 100.0 + np.cumsum(t + (0 if overlap else 0.002))
    rows["t_done"] = done
    rows["t_scheduled"] = done - t - (np.r_[0, t[1:]] * 0.5 if overlap else 0)  # async: a step's schedule before
    return rows


def test_the_coefficients_come_back_and_the_held_out_error_is_the_noise():
    rounds = [synthetic_round(k, overlap=k % 2 == 1) for k in range(6)]
    m = fit(rounds, SCOPE)
    for term, value in TRUE.items():
        assert m.coef[term] == pytest.approx(value, rel=0.1), term
    assert m.rounds == 6 and m.steps == sum(len(r) for r in rounds)
    h = m.held_out
    assert h.folds == 5 and h.steps == m.steps
    # noise of 3% (normal): the median absolute relative error is ~0.67 * 3%, the P90 ~1.64 * 3%
    assert 0.015 < h.median < 0.03 and 0.035 < h.p90 < 0.065
    rows = synthetic_round(99, noise=0.0)
    truth = TRUE["overhead_s"] + sum(TRUE[f"per_{f.removesuffix('s')}_s"] * rows[f] for f in step_model.FEATURES)
    assert np.median(np.abs(m.predict(rows) / truth - 1)) < 0.01
    assert m.predict(rows).shape == (len(rows),)


def test_coefficients_stay_nonnegative_where_a_term_is_absent():
    rounds = [synthetic_round(k) for k in range(3)]
    for r in rounds:
        r["context_tokens"] = 0   # no KV read at all: its term is unidentified, not negative
    m = fit(rounds, SCOPE)
    assert all(v >= 0 for v in m.coef.values())


def test_one_round_has_no_held_out_error_and_says_why():
    m = fit([synthetic_round(1)], SCOPE)
    assert m.held_out is None and "one round" in m.held_out_why_not
    with pytest.raises(ValueError, match="no busy engine step"):
        fit([np.zeros(0, dtype=steps.DTYPE)], SCOPE)


def test_extrapolation_is_refused_with_what_differs():
    other = SCOPE.model_copy(update={"launch": {**SCOPE.launch, "max_num_batched_tokens": 1024}})
    m = fit([synthetic_round(k) for k in range(2)], SCOPE, launches=[SCOPE.launch, other.launch])
    between = SCOPE.model_copy(update={"launch": {**SCOPE.launch, "max_num_batched_tokens": 1536}})
    m.check(between)  # a chunk size between the two measured: interpolated
    h200 = SCOPE.model_copy(update={"device": "NVIDIA H200"})
    with pytest.raises(Extrapolation, match=r"device 'NVIDIA H200' \(fitted on 'NVIDIA H100 80GB HBM3'\)"
                                            r".*Measure a start there"):
        m.check(h200)
    big = SCOPE.model_copy(update={"launch": {**SCOPE.launch, "max_num_batched_tokens": 8192, "enforce_eager": True}})
    with pytest.raises(Extrapolation, match=r"max_num_batched_tokens=8192 \(fitted on 1024..2048\); "
                                            r"enforce_eager=True \(fitted on False\)"):
        m.check(big)
    rows = synthetic_round(5)
    rows["context_tokens"][0] = 10 * m.ranges["context_tokens"][1]
    with pytest.raises(Extrapolation, match=r"context_tokens up to .*up to 2 x"):
        m.check(SCOPE, rows)


def test_rows_a_little_past_the_fitted_maximum_are_predicted_and_far_past_refused():
    # a held-out round of the fitted configuration reaches a request or a few tokens past the
    # fitted rounds (12-13 prefill requests where 11 were fitted on the H100): that is no
    # extrapolation; twice and more the fitted maximum is
    m = fit([synthetic_round(k) for k in range(2)], SCOPE)
    hi = m.ranges["prefill_reqs"][1]
    rows = synthetic_round(5)
    rows["prefill_reqs"][0] = hi + 2
    rows["context_tokens"][0] = m.ranges["context_tokens"][1] + 25
    m.check(SCOPE, rows)
    rows["prefill_reqs"][0] = step_model.RANGE_MARGIN * hi + 1
    with pytest.raises(Extrapolation, match=rf"prefill_reqs up to {int(step_model.RANGE_MARGIN * hi + 1)} "
                                            rf"\(fitted on 0..{hi:g}; up to 2 x {hi:g} is predicted\)"):
        m.check(SCOPE, rows)


def test_the_next_steps_admission_is_charged_to_the_step_in_flight():
    # async rounds whose steps each take 3 ms longer for every request the next step admits:
    # the next-step term takes it (the row-wise form cannot: it has no column for it)
    rounds = [synthetic_round(k, overlap=True, lead_req_s=3e-3) for k in range(6)]
    m = fit(rounds, SCOPE)
    assert m.coef["per_next_prefill_req_s"] == pytest.approx(3e-3, rel=0.1)
    for term, value in TRUE.items():
        assert m.coef[term] == pytest.approx(value, rel=0.15), term
    rowwise = fit(rounds, SCOPE, lead=False)
    assert rowwise.coef["per_next_prefill_req_s"] == 0 and rowwise.coef["per_next_prefill_token_s"] == 0
    assert m.held_out.median < 0.03 < rowwise.held_out.median
    # the simulator's split: a row's own time plus what the next row's admission adds
    rows = rounds[0]   # every step overlaps the next
    assert np.allclose(m.predict(rows)[:-1], m.own_s(rows)[:-1] + m.admission_s(rows[1:]))
    # a sync engine never has the next step in flight: the terms stay 0
    sync = fit([synthetic_round(k, lead_req_s=3e-3) for k in range(3)], SCOPE)
    assert sync.coef["per_next_prefill_req_s"] == 0 and sync.coef["per_next_prefill_token_s"] == 0


def test_a_model_saved_before_the_next_step_terms_loads_row_wise(tmp_path):
    m = fit([synthetic_round(k) for k in range(3)], SCOPE, lead=False)
    old = m.model_dump(mode="json", exclude={"front_end", "front_end_why_not"})
    old["coef"] = {k: v for k, v in old["coef"].items() if "next" not in k}
    (tmp_path / "old.json").write_text(__import__("json").dumps(old))
    back = StepModel.load(tmp_path / "old.json")
    rows = synthetic_round(7, overlap=True)
    assert np.array_equal(back.predict(rows), m.predict(rows))
    assert not back.admission_s(rows).any()


def test_saved_as_json_and_loaded_back(tmp_path):
    m = fit([synthetic_round(k) for k in range(3)], SCOPE)
    back = StepModel.load(m.save(tmp_path / "model.json"))
    assert back == m
    rows = synthetic_round(7)
    assert np.array_equal(back.predict(rows), m.predict(rows))


def test_a_run_folders_records_come_with_their_starts_scope(tmp_path):
    from synthetic_run import make_run
    run = make_run(tmp_path, {"mbt=256__kv=16MiB": {"ttft_p90_ms": 100.0}, "mbt=512__kv=16MiB": {"ttft_p90_ms": 90.0}})
    for pid in run.point_ids():
        folder = run.point(pid)
        for st in folder.starts():
            for r in range(2):
                steps.save_round(folder.start_dir(st.start), r, synthetic_round(r + 10 * st.start))
    got = step_model.collect(run.path)
    assert len(got) == 2 * sum(len(run.point(p).starts()) for p in run.point_ids())
    scopes = {s.launch["max_num_batched_tokens"] for _, s in got}
    assert scopes == {256, 512}
    _, scope = got[0]
    assert scope.device == "cpu" and scope.engine == run.point(run.point_ids()[0]).plan().engine
    (m,) = step_model.fit_run(run.path)  # one scope: the chunk sizes are a range within it
    assert sorted(la["max_num_batched_tokens"] for la in m.launches) == [256, 512]
    assert m.held_out.folds == 5


def test_the_spread_of_each_kind_of_step_is_kept_and_drawn_from():
    """Prefill steps noisier than decode ones: the spread keeps each kind's own tail, and
    jitter draws factors whose quantiles are the measured ones."""
    rounds = []
    for k in range(4):
        r = synthetic_round(k, noise=0.0)
        t = steps.cycles(r)
        rng = np.random.default_rng(k)
        wide = r["prefill_tokens"] > 0
        z = rng.standard_normal(len(r))
        t = t * np.where(wide, 1 + 0.3 * z.clip(-2, 2), 1 + 0.01 * z)
        r["t_done"] = 100.0 + np.cumsum(t + 0.002)
        r["t_scheduled"] = r["t_done"] - t
        rounds.append(r)
    m = fit(rounds, SCOPE)
    assert set(m.spread) == {"prefill", "decode"}
    pre, dec = np.array(m.spread["prefill"]), np.array(m.spread["decode"])
    assert np.all(np.diff(pre) >= 0) and np.all(np.diff(dec) >= 0)
    assert pre[90] - pre[10] > 10 * (dec[90] - dec[10])          # the prefill tail is the wide one
    rows = np.concatenate(rounds)
    f = m.jitter(rows, np.random.default_rng(0))
    pf = f[rows["prefill_tokens"] > 0]
    assert np.quantile(pf, 0.9) == pytest.approx(pre[90], rel=0.05)
    assert np.quantile(f[rows["prefill_tokens"] == 0], 0.5) == pytest.approx(1.0, abs=0.02)
    # no spread (a model saved before it): every factor is 1
    assert np.all(m.model_copy(update={"spread": None}).jitter(rows, np.random.default_rng(0)) == 1)


def test_the_attention_term_is_left_out_where_a_round_did_not_record_its_column():
    rounds = [synthetic_round(k) for k in range(4)]
    assert all(step_model.recorded(r, "prefill_attention_pairs") for r in rounds)
    full = fit(rounds, SCOPE)
    assert full.coef["per_prefill_attention_pair_s"] == pytest.approx(0.5e-9, rel=0.1)
    assert not full.left_out and "prefill_attention_pairs" in full.ranges
    old = rounds[0].copy()
    old["prefill_attention_pairs"] = 0     # an older kit's round: the column reads 0
    old["prefill_context_tokens"] = 0
    assert not step_model.recorded(old, "prefill_attention_pairs")
    mixed = fit([old] + rounds[1:], SCOPE)
    assert mixed.coef["per_prefill_attention_pair_s"] == 0
    assert mixed.left_out == {"per_prefill_attention_pair_s": "1 of 4 rounds were recorded by a kit that did not "
                                                               "write prefill_attention_pairs"}
    assert "prefill_attention_pairs" not in mixed.ranges
    far = synthetic_round(9)
    far["prefill_attention_pairs"] *= 100   # no range to keep to: the term is not in the model
    mixed.check(SCOPE, far)
    with pytest.raises(Extrapolation, match="prefill_attention_pairs up to"):
        full.check(SCOPE, far)
    # the term carries what a chunk late in a long prompt costs: the model without it misses those steps
    test = synthetic_round(11, noise=0.0)
    truth = TRUE["overhead_s"] + sum(TRUE[f"per_{f.removesuffix('s')}_s"] * test[f] for f in step_model.FEATURES)
    late = test["prefill_attention_pairs"] > np.quantile(test["prefill_attention_pairs"], 0.9)
    assert np.median(np.abs(full.predict(test[late]) / truth[late] - 1)) < 0.02
    assert np.median(np.abs(mixed.predict(test[late]) / truth[late] - 1)) > 0.05
