"""The front end (predict/front_end.py): the time a request spends outside the engine,
fitted from a round's steps and its client figures, applied by the simulated client
(predict/traffic.py). The fit is checked by inverting the simulator: rounds simulated
with a known front end give it back from their steps alone."""
from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("vllm")

from vllm_study.define import models  # noqa: E402
from vllm_study.define.params import ModelSpec  # noqa: E402
from vllm_study.measure import stats  # noqa: E402
from vllm_study.predict import front_end  # noqa: E402
from vllm_study.predict.engine import EngineSpec  # noqa: E402
from vllm_study.predict.front_end import Extrapolation, FrontEnd, FrontEndScope, Handoff, RoundSample  # noqa: E402
from vllm_study.predict.simulator import VirtualEngine  # noqa: E402
from vllm_study.predict.traffic import closed_loop, open_loop  # noqa: E402
from vllm_study.workload.workload import Request  # noqa: E402

SCOPE = FrontEndScope(api="completions", model="tiny-qwen2", vllm_version="0.26.0", prompt_tokens=(40, 60))


def front(spacing_s: float, latency_s: float) -> FrontEnd:
    return FrontEnd(scope=SCOPE, spacing_s=spacing_s, latency_s=latency_s, rounds=1)


@pytest.fixture(scope="module")
def model_dir() -> str:
    return models.resolve(ModelSpec(card="tiny-qwen2"))[0]


class _Ids:
    def ids(self, r: Request) -> list[int]:
        return [int(x) for x in r.prompt.split()]


def requests(n: int, rng, out: int = 12) -> list[Request]:
    reqs = []
    for i in range(n):
        length = int(rng.integers(40, 61))
        ids = list(range(10_000 * (i + 1), 10_000 * (i + 1) + length))   # no shared prefix
        reqs.append(Request(i, None, " ".join(map(str, ids)), length, out, {}))
    return reqs


def engine(model_dir, max_num_seqs: int = 32) -> VirtualEngine:
    spec = EngineSpec(model_dir=model_dir, num_blocks=4000, block_size=16, max_num_batched_tokens=256,
                      max_num_seqs=max_num_seqs, max_model_len=1024, async_scheduling=True)
    return VirtualEngine(spec, lambda rows: 2e-3 + 20e-6 * rows["prefill_tokens"] + 50e-6 * rows["decode_reqs"])


def test_the_handoff_takes_a_burst_one_at_a_time():
    h = Handoff(front(0.005, 0.1))
    assert [h.arrival(0.0) for _ in range(3)] == pytest.approx([0.005, 0.010, 0.015])
    assert h.arrival(1.0) == pytest.approx(1.005)   # an idle server hands it over at once
    assert h.latency_s == 0.1
    none = Handoff(None)
    assert none.arrival(0.3) == 0.3 and none.latency_s == 0.0


def test_a_lone_request_crosses_the_front_end_once_each_way(model_dir):
    eng = engine(model_dir)
    bare = engine(model_dir)
    reqs = requests(1, np.random.default_rng(0))
    [r] = open_loop(eng, _Ids(), reqs, [0.0], front_end=front(0.005, 0.1))
    [b] = open_loop(bare, _Ids(), reqs, [0.0])
    assert r["ttft_s"] == pytest.approx(b["ttft_s"] + 0.005 + 0.1)
    assert r["e2e_s"] == pytest.approx(b["e2e_s"] + 0.005 + 0.1)
    assert r["itl_s"] == pytest.approx(b["itl_s"])   # a constant delay leaves the gaps as they are
    assert r["send_time"] == pytest.approx(0.0)


def test_a_closed_loop_sends_the_next_request_when_the_client_sees_a_finish(model_dir):
    eng = engine(model_dir)
    res = closed_loop(eng, _Ids(), requests(3, np.random.default_rng(1)), 1, front(0.005, 0.1))
    for a, b in zip(res, res[1:]):
        assert b["send_time"] == pytest.approx(a["end_time"])   # the client's end, the engine's + 0.1 s
    first = eng.tracked[next(iter(eng.tracked))]
    assert res[0]["end_time"] == pytest.approx(first.end_time + 0.1)


@pytest.mark.parametrize("spacing_s,latency_s", [(0.004, 0.05), (0.0015, 0.02)])
def test_the_fit_gives_back_the_front_end_a_round_was_simulated_with(model_dir, spacing_s, latency_s):
    samples = []
    for k in range(3):
        eng = engine(model_dir)
        reqs = requests(48, np.random.default_rng(10 + k))
        res = closed_loop(eng, _Ids(), reqs, 8, front(spacing_s, latency_s))
        m = stats.round_metrics(res, max(r["end_time"] for r in res) - min(r["send_time"] for r in res))
        samples.append(RoundSample(eng.steps(), [r["prompt_tokens"] for r in res], m["ttft_p50_ms"] / 1e3, 8,
                                   [r["output_tokens"] for r in res]))
    fe = front_end.fit(samples, SCOPE)
    assert fe.rounds == 3 and not fe.skipped
    # the arrival estimate is the middle of a step's schedule interval (2-3 ms here); the
    # client's TTFT less the engine's less one hand-over would be 2.3 ms high at 4 ms spacing
    # (the hand-over queue's wait): the closed loop's own finishes take it out
    assert fe.spacing_s == pytest.approx(spacing_s, abs=0.3e-3)
    assert fe.latency_s == pytest.approx(latency_s, abs=1.2e-3)
    # the client's TTFT less the engine's holds the latency, a hand-over and the queue's wait
    assert min(fe.gap_rounds) > latency_s + spacing_s - 3e-3


def test_a_round_whose_steps_do_not_hold_its_requests_is_left_out_with_why(model_dir):
    eng = engine(model_dir)
    res = closed_loop(eng, _Ids(), requests(16, np.random.default_rng(3)), 4, front(0.002, 0.03))
    rows = eng.steps()
    good = RoundSample(rows, [r["prompt_tokens"] for r in res], 0.05, 4, [r["output_tokens"] for r in res])
    lost = RoundSample(rows[: len(rows) // 2], good.prompt_tokens, 0.05, 4, good.output_tokens)
    # a request that waited for a free slot (max_num_seqs 2 under 4 in flight) was first
    # scheduled after it arrived: its round cannot place arrivals
    full = engine(model_dir, max_num_seqs=2)
    res = closed_loop(full, _Ids(), requests(16, np.random.default_rng(3)), 4, front(0.002, 0.03))
    waited = RoundSample(full.steps(), good.prompt_tokens, 0.05, 4, good.output_tokens)
    fe = front_end.fit([good, lost, waited], SCOPE)
    assert fe.rounds == 1 and sorted(fe.skipped.values()) == [1, 1]
    assert {w.split(" ")[0] for w in fe.skipped} == {"its", "requests"}   # "do not add up", "waited"
    with pytest.raises(ValueError, match="no round whose steps place its requests.*1 rounds: its steps"):
        front_end.fit([lost], SCOPE)


def test_the_scope_refuses_another_api_or_far_longer_prompts():
    fe = front(0.005, 0.1)
    fe.check(SCOPE.model_copy(update={"prompt_tokens": (10, 110)}))   # within 2 x the longest fitted
    with pytest.raises(Extrapolation, match=r"api 'chat' \(fitted on 'completions'\)"):
        fe.check(SCOPE.model_copy(update={"api": "chat"}))
    with pytest.raises(Extrapolation, match=r"prompts up to 130 tokens \(fitted on 40..60; up to 2 x 60"):
        fe.check(SCOPE.model_copy(update={"prompt_tokens": (40, 130)}))


def test_the_step_model_carries_its_front_end_and_checks_its_version(tmp_path):
    from test_unit_step_model import SCOPE as STEP_SCOPE, synthetic_round

    from vllm_study.predict.step_model import StepModel, fit
    m = fit([synthetic_round(k) for k in range(2)], STEP_SCOPE)
    m.front_end = front(0.005, 0.1)
    back = StepModel.load(m.save(tmp_path / "m.json"))
    assert back.front_end == m.front_end
    back.check(STEP_SCOPE)
    m.front_end = FrontEnd(scope=SCOPE.model_copy(update={"vllm_version": "0.32.0"}), spacing_s=0.005,
                           latency_s=0.1, rounds=1)
    with pytest.raises(Extrapolation, match=r"front end's vLLM '0.32.0'"):
        m.check(STEP_SCOPE)


def test_a_run_folders_rounds_give_the_step_models_their_front_end(tmp_path, model_dir):
    # a kit run folder: each round's steps (steps/r<k>.npz) and requests (requests.jsonl.gz)
    # from a round simulated with a known front end; fit_run gives every model that front end
    import gzip

    from synthetic_run import make_run

    from vllm_study.predict import step_model
    from vllm_study.scheduler_plugin import steps
    from vllm_study.records.results import REQUESTS, request_line
    run = make_run(tmp_path, {"mbt=256__kv=16MiB": {"ttft_p50_ms": 100.0}, "mbt=512__kv=16MiB": {"ttft_p50_ms": 90.0}})
    conc = run.point(run.point_ids()[0]).plan().study.workload.concurrency
    rng = np.random.default_rng(7)
    for pid in run.point_ids():
        folder = run.point(pid)
        for st in folder.starts():
            d = folder.start_dir(st.start)
            for r in range(2 if st.status == "ok" else 0):
                eng = engine(model_dir)
                res = closed_loop(eng, _Ids(), requests(3 * conc, rng), conc, front(0.003, 0.04))
                steps.save_round(d, r, eng.steps())
                with gzip.open(d / REQUESTS, "at") as f:
                    f.writelines(request_line(x, st.start, r) for x in res)
    models = step_model.fit_run(run.path)
    assert models and all(m.front_end is models[0].front_end for m in models)
    fe = models[0].front_end
    assert fe.rounds == 2 * sum(st.status == "ok" for p in run.point_ids() for st in run.point(p).starts()) == 8
    assert fe.spacing_s == pytest.approx(0.003, abs=0.3e-3) and fe.latency_s == pytest.approx(0.04, abs=1.5e-3)
    assert (fe.scope.api, fe.scope.model, fe.scope.vllm_version) == ("chat", "tiny-qwen2", "0.32.0")
    assert fe.scope.prompt_tokens == (40, 60)


def test_a_run_without_request_records_has_no_front_end_and_says_why(tmp_path):
    from synthetic_run import make_run
    from test_unit_step_model import synthetic_round

    from vllm_study.predict import step_model
    from vllm_study.scheduler_plugin import steps
    run = make_run(tmp_path, {"mbt=256__kv=16MiB": {"ttft_p50_ms": 100.0}})
    for pid in run.point_ids():
        folder = run.point(pid)
        for st in folder.starts():
            steps.save_round(folder.start_dir(st.start), 0, synthetic_round(st.start))
    (m,) = step_model.fit_run(run.path)
    assert m.front_end is None and "requests' records" in m.front_end_why_not
