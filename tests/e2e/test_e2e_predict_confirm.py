"""`predict:` end to end against a real vLLM (the CPU build), through `python -m vllm_study
sweep`: a 2x2 grid whose one seed (the baseline) is measured in a real start, every point
predicted from its step records in parallel processes, the top config and the baseline
measured in real starts, the grid predicted again with the model refitted (a second
pass) and its new top measured, and confirmed until resolved; predictions.json, the report's
section and export say what was predicted and what was measured."""
from __future__ import annotations

import json

import pytest
from e2e_support import UNI, kv_bytes, sweep, tiny, write

from vllm_study.predict import study as ps
from vllm_study.records import confirmation
from vllm_study.records.results import RunFolder
from vllm_study.report import export

# prefix caching and the per-request prefill cap are no kernel settings: one seed's step
# records are in scope for every point (chunk size and max_num_seqs would need seeds at their ends)
PREDICT_STUDY = tiny(
    name="e2e-predict", engine_args={"max_model_len": 2048, "enforce_eager": True,
                                     "kv_cache_memory_bytes": kv_bytes(16384)},
    grid={"enable_prefix_caching": [True, False], "long_prefill_token_threshold": [0, 128]},
    baseline="pc=on__lpt=0",
    workload={"system_prompt_tokens": 512, "question_tokens": 16, "output_tokens": 32,
              "requests_per_round": 16, "warmup_requests": 2},
    slo={"ttft_p90_ms": 1000}, capacity={"over": "concurrency", "lo": 1, "hi": 8, "max_steps": 2},
    confirm={"until": "resolved", "max_starts": 2},
    predict={"seed": ["defaults"], "confirm_top": 1, "workers": 2}, server={"extra_cli_args": UNI})


@pytest.mark.e2e
def test_predict_then_confirm_measures_the_seed_the_top_and_the_baseline_and_reports_both(tmp_path):
    results = tmp_path / "results"
    r = sweep(write(tmp_path, PREDICT_STUDY), "--results", results, timeout=2400)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    (path,) = results.iterdir()
    run = RunFolder(path)
    pred = ps.read(path)
    assert pred is not None, "predictions.json is missing"
    # every point has a verdict, none dropped; the model names what it was fitted on
    assert [p.point for p in pred.points] == run.manifest().points
    first, second = pred.passes   # two passes (the default)
    assert pred.seeds == ["pc=on__lpt=0"] and first.model.starts == ["pc=on__lpt=0#s1"] and first.model.steps > 0
    for p in (first, second):
        assert all(q.predicted and q.value > 0 and q.rank for q in p.points), [q.verdict for q in p.points]
        top = min((q for q in p.points if q.point != pred.seeds[0]), key=lambda q: q.rank)
        assert p.chosen == [top.point, "pc=on__lpt=0"]
    # vLLM's real scheduler recorded the prefill chunks' attention pairs, so the model has the term
    assert not first.model.left_out and "per_prefill_attention_pair_s" in first.model.coef
    # the second pass was fitted on the first's starts too
    assert set(first.model.starts) < set(second.model.starts) and second.model.steps > first.model.steps
    # the end-to-end error was measured on the seed's replayed rounds, and the intervals carry it
    assert first.error.replay_rounds > 0 and first.error.widen is not None
    assert all(p.low is not None for p in first.points)
    # the step model's spread: every point of this small grid leads, each drawn on 3 streams
    assert all(len(p.draws) == 3 for p in second.points), [p.draws for p in second.points]
    # real starts: the seed's, then each pass's top's first; the points never chosen have none
    measured = {p for p in run.point_ids() if run.point(p).starts()}
    assert measured == set(first.chosen) | set(second.chosen), measured
    assert "predict: pass 2 of 2" in r.stdout and "end-to-end error so far" in r.stdout
    # each later real start refitted the model from every start's steps
    later = sum(len(run.point(p).starts()) for p in measured) - 1
    assert len(pred.refits) >= 1 and len(pred.refits) <= later
    assert pred.refits[-1].steps > first.model.steps
    # confirmation ran over the measured configs
    rec = confirmation.read(path)
    assert rec is not None and rec.stop, r.stdout[-2000:]
    # the report's section: the measured configs predicted beside measured, tau, error so far
    html = (path / "report.html").read_text()
    assert "Predicted beside measured" in html and "rank agreement over the measured configs" in html
    # export: a predicted-only point is refused, the measured ones are not
    never = next(p for p in run.point_ids() if p not in measured)
    with pytest.raises(ValueError, match=f"{never} has no measured start"):
        export.export_point(path, never, tmp_path / "out")
    json.loads((path / ps.PREDICTIONS).read_text())


@pytest.mark.e2e
def test_predictions_as_ray_tasks_equal_those_made_in_this_process():
    """The ray executor's cores (here a local Ray that ray.init starts): each point one task,
    the same prediction as in this process (the simulation is deterministic)."""
    import ray

    from vllm_study.predict import step_model
    from vllm_study.sweep import REPO
    run = RunFolder(REPO / "results/predict-vs-measured/20261206-cpu/runs/"
                           "20261206T213256Z-cpu-predict-vs-measured-6e57094")
    todo, _ = ps.tasks(run, step_model.fit_run(run.path))
    try:
        remote = ps.predict_all(todo[:2], 2, on_ray=True)
    finally:
        ray.shutdown()
    local = [ps.predict_one(t) for t in todo[:2]]
    assert [p.point for p in remote] == [p.point for p in local]
    assert [p.value for p in remote] == [p.value for p in local] and all(p.predicted for p in remote)
