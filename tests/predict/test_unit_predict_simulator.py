"""The simulator: vLLM's own scheduler in virtual time, checked with a fixed step time
on a handful of requests whose answers can be worked out by hand."""
from __future__ import annotations

import math

import numpy as np
import pytest

pytest.importorskip("vllm")

from vllm_study.define import models  # noqa: E402
from vllm_study.define.params import ModelSpec  # noqa: E402
from vllm_study.measure import stats  # noqa: E402
from vllm_study.predict.engine import EngineSpec  # noqa: E402
from vllm_study.predict.simulator import VirtualEngine  # noqa: E402
from vllm_study.predict.traffic import closed_loop, open_loop  # noqa: E402
from vllm_study.scheduler_plugin import steps  # noqa: E402
from vllm_study.workload.workload import Request  # noqa: E402
from paths import REPO

DT = 0.01  # every step: 10 ms


def fixed(rows: np.ndarray) -> np.ndarray:
    return np.full(len(rows), DT)


@pytest.fixture(scope="module")
def model_dir() -> str:
    return models.resolve(ModelSpec(card="tiny-qwen2"))[0]


def engine(model_dir, step_time=fixed, **kw) -> VirtualEngine:
    args = dict(model_dir=model_dir, num_blocks=1000, block_size=16, max_num_batched_tokens=64,
                max_num_seqs=8, max_model_len=4096) | kw
    return VirtualEngine(EngineSpec(**args), step_time)


class _Ids:
    """Prompts for hand-made requests: the prompt text is the ids, space-separated."""
    def ids(self, r: Request) -> list[int]:
        return [int(x) for x in r.prompt.split()]


def req(index: int, ids: list[int], max_tokens: int) -> Request:
    return Request(index, None, " ".join(map(str, ids)), len(ids), max_tokens, {})


def test_lone_request_ttft_is_its_prefill_steps(model_dir):
    eng = engine(model_dir)
    [r] = open_loop(eng, _Ids(), [req(0, list(range(100)), 4)], [0.5])
    # 100 prompt tokens at 64 a step: 2 steps, the second samples the first token
    assert r["ttft_s"] == pytest.approx(2 * DT)
    assert r["itl_s"] == pytest.approx([DT] * 3)  # then one decode step a token
    assert r["e2e_s"] == pytest.approx(5 * DT)
    assert r["send_time"] == pytest.approx(0.5) and r["due_time"] == pytest.approx(0.5)
    assert (r["prompt_tokens"], r["output_tokens"], r["error"]) == (100, 4, None)


def test_chunking_splits_a_long_prompt(model_dir):
    eng = engine(model_dir, max_num_batched_tokens=64)
    open_loop(eng, _Ids(), [req(0, list(range(1000, 1300)), 1)], [0.0])
    rows = eng.steps()
    assert len(rows) == math.ceil(300 / 64)
    assert rows["prefill_tokens"].tolist() == [64, 64, 64, 64, 44]
    assert rows["context_tokens"].tolist() == [0, 64, 128, 192, 256]
    assert rows["prefill_context_tokens"].tolist() == [0, 64, 128, 192, 256]  # all of it a prompt's
    # each chunk's causal pairs: its tokens times the context, plus the triangle among themselves
    assert rows["prefill_attention_pairs"].tolist() == [64 * c + 64 * 65 // 2 for c in (0, 64, 128, 192)] + [
        44 * 256 + 44 * 45 // 2]
    assert rows["decode_reqs"].sum() == 0
    # each step starts where the previous ended
    assert np.allclose(rows["t_done"] - rows["t_scheduled"], DT)


def test_shared_prefix_hits_the_cache_on_the_second_request(model_dir):
    eng = engine(model_dir, max_num_batched_tokens=256)
    prefix = list(range(2000, 2064))  # 4 full blocks of 16
    first, second = req(0, prefix + [1, 2, 3], 2), req(1, prefix + [4, 5, 6], 2)
    res = closed_loop(eng, _Ids(), [first, second], concurrency=1)
    rows = eng.steps()
    assert rows["cached_tokens"].tolist() == [0, 0, 64, 0]  # the second found the 4 blocks
    assert rows["prefill_tokens"].tolist() == [67, 0, 3, 0]
    assert (eng.cache_queries, eng.cache_hits) == (134, 64)  # vLLM's own PrefixCacheStats
    # closed loop: the second is sent when the first finishes
    assert res[1]["send_time"] == pytest.approx(res[0]["end_time"])


def test_prefix_caching_off_finds_nothing(model_dir):
    eng = engine(model_dir, max_num_batched_tokens=256, enable_prefix_caching=False)
    prefix = list(range(2000, 2064))
    closed_loop(eng, _Ids(), [req(0, prefix + [1], 1), req(1, prefix + [2], 1)], concurrency=1)
    assert eng.steps()["cached_tokens"].tolist() == [0, 0]


def test_max_num_seqs_caps_the_batch(model_dir):
    eng = engine(model_dir, max_num_seqs=2, max_num_batched_tokens=512)
    reqs = [req(i, [3000 + 100 * i + k for k in range(20)], 5) for i in range(5)]
    res = open_loop(eng, _Ids(), reqs, [0.0] * 5)
    rows = eng.steps()
    assert (rows["prefill_reqs"] + rows["decode_reqs"]).max() == 2
    assert rows["running"].max() == 2 and rows["waiting"].max() == 3
    # pairs: requests 0-1 take 1 prefill + 4 decode steps, then 2-3, then 4
    assert [r["ttft_s"] for r in res] == pytest.approx([DT, DT, 6 * DT, 6 * DT, 11 * DT])


def test_closed_loop_keeps_concurrency_in_flight(model_dir):
    eng = engine(model_dir)
    reqs = [req(i, [4000 + 50 * i + k for k in range(10)], 3) for i in range(6)]
    res = closed_loop(eng, _Ids(), reqs, concurrency=2)
    sends = sorted(r["send_time"] for r in res)
    assert sends[:2] == [0.0, 0.0]
    for t in sends[2:]:  # every later send is some request's finish
        assert any(t == pytest.approx(r["end_time"]) for r in res)
    assert eng.steps()["running"].max() == 2


def test_records_feed_round_metrics(model_dir):
    eng = engine(model_dir)
    reqs = [req(i, [5000 + 50 * i + k for k in range(30)], 4) for i in range(3)]
    res = open_loop(eng, _Ids(), reqs, [0.0, 0.1, 0.2])
    duration = max(r["end_time"] for r in res) - min(r["send_time"] for r in res)
    m = stats.round_metrics(res, duration, {"ttft_p90_ms": 100})
    assert m["completed"] == 3 and m["failed"] == 0
    assert m["ttft_p50_ms"] == pytest.approx(1000 * DT)  # 30 tokens: one step each, never overlapping
    assert m["output_throughput"] == pytest.approx(12 / duration)
    assert m["ttft_sched_p90_ms"] == pytest.approx(m["ttft_p90_ms"])  # sent on time


def test_step_time_follows_the_rows(model_dir):
    # a step's time from its own row: 1 ms + 0.1 ms a prefill token
    eng = engine(model_dir, step_time=lambda rows: 0.001 + 1e-4 * rows["prefill_tokens"])
    [r] = open_loop(eng, _Ids(), [req(0, list(range(6000, 6100)), 2)], [0.0])
    assert r["ttft_s"] == pytest.approx((0.001 + 64e-4) + (0.001 + 36e-4))
    assert r["itl_s"] == pytest.approx([0.001])


def test_async_scheduling_overlaps_steps_back_to_back(model_dir):
    eng = engine(model_dir, async_scheduling=True)
    [r] = open_loop(eng, _Ids(), [req(0, list(range(7000, 7100)), 4)], [0.0])
    rows = eng.steps()
    # the next step is scheduled while the previous one runs: scheduled before it ends
    assert (rows["t_scheduled"][1:] < rows["t_done"][:-1]).any()
    assert np.allclose(np.diff(rows["t_done"]), DT)  # and starts when it ends
    assert r["ttft_s"] == pytest.approx(2 * DT) and r["e2e_s"] == pytest.approx(5 * DT)


class _Admitting:
    """A step model whose steps take DT, and the step in flight ADMIT longer for each
    request the next step admits (step_model's next-step terms)."""
    ADMIT = 0.004

    def own_s(self, rows):
        return np.full(len(rows), DT)

    def admission_s(self, rows):
        return self.ADMIT * rows["prefill_reqs"]


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_admission_work_lands_on_the_step_in_flight(model_dir, async_scheduling):
    eng = engine(model_dir, step_time=_Admitting(), async_scheduling=async_scheduling)
    reqs = [req(0, list(range(8000, 8010)), 8), req(1, list(range(8100, 8110)), 2)]
    open_loop(eng, _Ids(), reqs, [0.0, 0.035])
    rows = eng.steps()
    cyc = steps.cycles(rows)
    [k] = np.flatnonzero(rows["prefill_reqs"][1:] > 0) + 1   # the step that admits the second request
    if async_scheduling:   # scheduled while step k-1 ran: k-1 pays for admitting it, k takes its own DT
        assert rows["t_scheduled"][k] < rows["t_done"][k - 1]
        assert cyc[k - 1] == pytest.approx(DT + _Admitting.ADMIT) and cyc[k] == pytest.approx(DT)
        assert np.allclose(np.delete(cyc, k - 1), DT)
    else:                  # nothing in flight when a step is scheduled: no step pays for the next
        assert np.allclose(cyc, DT)


def test_a_request_over_max_model_len_is_refused(model_dir):
    eng = engine(model_dir, max_model_len=128)
    with pytest.raises(ValueError, match="max_model_len 128"):
        eng.submit(0, list(range(120)), 16)


def test_a_nonpositive_step_time_is_refused(model_dir):
    eng = engine(model_dir, step_time=lambda rows: np.zeros(len(rows)))
    eng.submit(0, list(range(10)), 1)
    with pytest.raises(ValueError, match="positive time"):
        eng.run()


@pytest.mark.parametrize("budget", [None, (0.5, 500.0)])
def test_the_prefix_budget_plugin_reorders_admission(model_dir, budget):
    """The kit's plugin class runs inside the simulator where the point uses it: a warm
    request overtakes a cold one queued before it."""
    eng = engine(model_dir, max_num_seqs=1, prefix_budget=budget)
    assert (type(eng.scheduler).__name__.startswith("PrefixBudget")) == (budget is not None)
    prefix = list(range(8000, 8064))
    first = req(0, prefix + [1], 1)
    cold, warm = req(1, list(range(9000, 9065)), 1), req(2, prefix + [2], 1)
    open_loop(eng, _Ids(), [first, cold, warm], [0.0, 1.0, 1.0])
    rows = eng.steps()
    later = rows[rows["t_scheduled"] >= 1.0]
    # the first step at t=1 admits the cold request (FCFS) without the plugin, the warm one with it
    assert later["cached_tokens"][0] == (64 if budget else 0)


def test_a_study_round_in_simulation():
    """A point of the default study (shared prefix, closed loop of 16): the round's
    requests as the start builds them, records round_metrics reads, vLLM's own hit rate."""

    from vllm_study.define.grid import PointPlan, expand
    from vllm_study.define.study_file import load_study
    from vllm_study.predict.start import SimulatedStart

    study = load_study(REPO / "params" / "default.yaml")
    point = expand(study, "cpu")[0]
    sim = SimulatedStart(PointPlan(study=study, point=point, engine="cpu"), fixed, num_blocks=512)
    rnd = sim.run_round(0)
    w = study.workload
    assert len(rnd.results) == w.requests_per_round and rnd.values["completed"] == w.requests_per_round
    assert {r["output_tokens"] for r in rnd.results} == {w.output_tokens}
    # the shared system prompt is computed once, then found: a hit rate near the never-evicting one
    expected = sim.workloads[0].expected_hit_rate(w.requests_per_round, sim.spec.block_size)
    assert 0.5 * expected < rnd.values["prefix_cache_hit_rate"] <= expected + 1e-9
    assert rnd.steps["running"].max() <= w.concurrency
    with pytest.raises(ValueError, match="no capacity section"):
        sim.capacity()


class _Spread:
    """A step model whose every step is DT, drawn x2 or x1 by its jitter (prefill steps
    only), to see where the simulator applies the draw."""
    def predict(self, rows):
        return np.full(len(rows), DT)

    def jitter(self, rows, rng):
        return np.where(rows["prefill_tokens"] > 0, rng.choice([1.0, 2.0], len(rows)), 1.0)


def test_a_models_spread_is_drawn_only_with_a_generator(model_dir):
    prompt = list(range(640))  # 10 prefill steps of 64, then 3 decode steps
    args = dict(model_dir=model_dir, num_blocks=1000, block_size=16, max_num_batched_tokens=64,
                max_num_seqs=8, max_model_len=4096)
    [plain] = open_loop(VirtualEngine(EngineSpec(**args), _Spread()), _Ids(), [req(0, prompt, 4)], [0.0])
    assert plain["ttft_s"] == pytest.approx(10 * DT)       # no generator: the model's own times
    drawn = [open_loop(VirtualEngine(EngineSpec(**args), _Spread(), np.random.default_rng(s)), _Ids(),
                       [req(0, prompt, 4)], [0.0])[0] for s in range(3)]
    for r in drawn:
        assert 10 * DT < r["ttft_s"] <= 20 * DT                # some prefill steps drawn x2
        assert r["itl_s"] == pytest.approx([DT] * 3)          # decode steps: factor 1
    again = open_loop(VirtualEngine(EngineSpec(**args), _Spread(), np.random.default_rng(0)), _Ids(),
                      [req(0, prompt, 4)], [0.0])[0]
    assert again["ttft_s"] == drawn[0]["ttft_s"]              # a seed gives the same draws
