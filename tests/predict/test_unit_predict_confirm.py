"""`predict:` (define/predict_spec.py, predict/study.py, report/predict_section.py): the
study's checks before anything starts, the ranking and the choice of real starts, the
interval each prediction carries, the flag on a prediction outside its measured interval,
and export refusing a config that was only predicted."""
from __future__ import annotations

import shutil

import pytest
from synthetic_run import make_capacity_run

from vllm_study.capacity.fit import ConfigCapacity
from vllm_study.define.predict_spec import seed_points
from vllm_study.define.study_file import study_from_dict
from vllm_study.predict import study as ps
from vllm_study.report import export, predict_section

GRID = {"max_num_seqs": [4, 8, 16]}


def _study(**over) -> dict:
    base = {"name": "p", "model": {"card": "tiny-qwen2", "served_name": "tiny"},
            "engine_args": {"max_model_len": 2048, "dtype": "float32"}, "grid": GRID, "baseline": "mns=16",
            "workload": {"system_prompt_tokens": 256, "question_tokens": 16, "output_tokens": 16,
                         "load": {"kind": "poisson", "rate": 2}},
            "slo": {"ttft_p90_ms": 400}, "capacity": {"over": "rate", "lo": 1, "hi": 8},
            "confirm": {"max_starts": 3}, "predict": {"seed": ["defaults"], "confirm_top": 2}}
    return {**base, **over}


@pytest.mark.parametrize("over, said", [
    ({"capacity": None}, "it needs `capacity:`"),
    ({"baseline": None, "confirm": None}, "name the baseline with `baseline:`"),
    ({"confirm": None}, "add `confirm:`"),
    ({"server": {"step_records": False}}, "remove server.step_records: false"),
    ({"server": {"extra_cli_args": ["--scheduler-cls", "my.Sched"]}}, "--scheduler-cls, a class it cannot simulate"),
    ({"predict": {"seed": ["mns=4", "mns=4"]}}, "predict.seed repeats"),
    ({"predict": {"confirm_top": 0}}, "confirm_top"),
])
def test_a_study_predict_cannot_run_is_refused_naming_the_key_and_the_fix(over, said):
    with pytest.raises(Exception) as e:
        study_from_dict(_study(**over))
    assert said in str(e.value), str(e.value)


def test_the_seed_is_named_points_or_the_baseline_and_points_spread_over_the_grid():
    ids = [f"p{i}" for i in range(7)]
    s = study_from_dict(_study())
    assert seed_points(s, ["mns=4", "mns=8", "mns=16"]) == ["mns=16"]  # 'defaults': the baseline
    s.baseline, s.predict.seed = "p3", 3
    assert seed_points(s, ids) == ["p3", "p0", "p6"]                  # the baseline, then both ends
    s.predict.seed = 1
    assert seed_points(s, ids) == ["p3"]
    s.predict.seed = ["p1", "nope"]
    with pytest.raises(ValueError, match="predict.seed names 'nope', not a point of the grid"):
        seed_points(s, ids)


def _p(point, value, censored=None, verdict="predicted"):
    return ps.PointPrediction(point=point, verdict=verdict, value=value, censored=censored)


def test_rank_puts_bounds_above_hi_first_below_floor_last_and_leaves_the_unpredicted_out():
    pts = [_p("a", 2.0), _p("b", 8.0, "above"), _p("c", 5.0), _p("d", 0.5, "below"),
           _p("e", None, verdict="not predicted: the step-time model would extrapolate")]
    ranked = ps.rank(pts)
    assert [p.point for p in ranked] == ["b", "c", "a", "d"]
    assert {p.point: p.rank for p in pts} == {"a": 3, "b": 1, "c": 2, "d": 4, "e": None}
    # the top configs other than the baseline, then the baseline: each a comparison to resolve
    assert ps.choose(pts, 2, baseline="c") == ["b", "a", "c"]
    assert ps.choose(pts, 1, baseline="e") == ["b", "e"]


def test_each_interval_carries_the_end_to_end_error_and_a_bound_keeps_its_open_side():
    p = ps.widen(_p("a", 4.0), 0.5)
    assert (p.low, p.high) == pytest.approx((4.0 / 1.5, 6.0))
    above = ps.widen(_p("b", 8.0, "above"), 0.5)
    assert above.low == pytest.approx(8 / 1.5) and above.high is None
    below = ps.widen(_p("c", 0.5, "below"), 0.5)
    assert below.low is None and below.high == pytest.approx(0.75)
    none = ps.widen(_p("d", 3.0), None)   # no error measured yet: no interval is claimed
    assert none.low is None and none.high is None


def test_a_prediction_outside_its_measured_interval_is_flagged():
    m = ConfigCapacity(kind="value", value=4.0, low=3.0, high=5.0, starts=2)
    assert predict_section.outside(6.0, m) and predict_section.outside(2.9, m)
    assert not predict_section.outside(4.9, m)
    assert predict_section.outside(9.0, ConfigCapacity(kind="value", value=4.0, low=3.0, high=None)) is False
    assert predict_section.outside(2.0, ConfigCapacity(kind="below", value=1.0))
    assert not predict_section.outside(0.5, ConfigCapacity(kind="below", value=1.0))
    assert predict_section.outside(4.0, ConfigCapacity(kind="at_least", value=8.0))
    assert predict_section.outside(4.0, ConfigCapacity(kind="unresolved")) is None
    # a predicted bound contradicts only where nothing it allows is measured
    below = ConfigCapacity(kind="below", value=0.6)
    assert not predict_section.outside(0.6, below, censored="below")       # both: under 0.6
    assert predict_section.outside(0.5, m, censored="below")                # under 0.5, measured 3.0..5.0
    assert not predict_section.outside(4.0, m, censored="below")            # under 4.0: 3.0..4.0 allowed
    assert predict_section.outside(6.0, m, censored="above")                # 6.0 or more, measured up to 5.0
    assert not predict_section.outside(2.0, ConfigCapacity(kind="at_least", value=8.0), censored="above")


def _predicted_run(tmp_path):
    """A capacity run of three points, two measured (mbt=256 at 4 req/s, mbt=512 at 3), the
    third (mbt=1024) only predicted, with its predictions.json."""
    over = {"grid": {"max_num_batched_tokens": [256, 512, 1024]}, "baseline": "mbt=512",
            "confirm": {"max_starts": 3}, "predict": {"seed": ["defaults"], "confirm_top": 1}}
    run = make_capacity_run(tmp_path, {"mbt=256": 4.0, "mbt=512": 3.0, "mbt=1024": 5.0}, study_over=over)
    folder = run.point("mbt=1024")
    for k in (1, 2):
        shutil.rmtree(folder.start_dir(k))
    (folder.path / "summary.json").unlink()
    points = [_p("mbt=256", 9.0), _p("mbt=512", 3.0), _p("mbt=1024", 7.0)]
    for p in points:
        ps.widen(p, 0.2)
    ps.rank(points)
    ps.Predictions(model=ps.ModelVersion(starts=["mbt=512#s1"], rounds=3, steps=300),
                   error=ps.EndToEnd(capacity={"mbt=512": 0.2}, widen=0.2), points=points, seeds=["mbt=512"],
                   chosen=["mbt=1024", "mbt=512"]).save(run)
    run.write_summary_csv()
    return run


def test_the_section_sets_predicted_beside_measured_flags_the_outside_one_and_ranks(tmp_path):
    from vllm_study.report import report
    run = _predicted_run(tmp_path)
    r = report.Run.load(run)
    sec = predict_section.predicted_vs_measured(run.path, r.capacities)
    assert list(sec.table.index) == ["mbt=256", "mbt=512"]          # measured configs only
    assert sec.flagged == ["mbt=256"]                                # 9 against a measured ~4
    assert sec.table.loc["mbt=256", "OUTSIDE its measured interval"] == "FLAGGED"
    assert sec.table.loc["mbt=512", "OUTSIDE its measured interval"] == ""
    assert sec.tau == pytest.approx(1.0)                             # both orders agree
    assert sec.errors["mbt=256"] == pytest.approx(9.0 / r.capacities["mbt=256"].config.value - 1)
    assert any("1 prediction(s) outside the measured interval: mbt=256" in line for line in sec.lines)
    assert not any("left out" in line for line in sec.lines)          # every term fitted


def test_the_section_says_which_term_the_model_left_out_and_why(tmp_path):
    run = _predicted_run(tmp_path)
    pred = ps.read(run.path)
    why = "3 of 3 rounds were recorded by a kit that did not write prefill_attention_pairs"
    pred.model.left_out = {"per_prefill_attention_pair_s": why}
    pred.save(run)
    from vllm_study.report import report
    sec = predict_section.predicted_vs_measured(run.path, report.Run.load(run).capacities)
    assert any(line.startswith("the model now:") and f"per_prefill_attention_pair_s left out: {why}" in line
               for line in sec.lines)


def test_export_refuses_a_config_that_was_only_predicted(tmp_path):
    run = _predicted_run(tmp_path)
    with pytest.raises(ValueError, match="mbt=1024 has no measured start .* predicted only .*rank 2"):
        export.export_point(run.path, "mbt=1024", tmp_path / "out")
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").iterdir())
    # the recommendation is a measured config, exported on its measurement
    e = export.export_point(run.path, None, tmp_path / "out")
    assert e.point == "mbt=256" and e.config.exists()


def test_the_dry_run_gives_the_real_starts_and_their_minutes_against_the_whole_grid(capsys):
    from vllm_study import sweep
    points = sweep.dry_run([str(sweep.REPO / "params" / "cpu-predict-confirm.yaml")], "cpu")
    out = capsys.readouterr().out
    assert len(points) == 36
    # 3 seeds + the top 3 (the baseline is a seed), a second pass's new top 3 at most, then up to
    # 3 x (max_starts - 1) confirmation starts
    assert "predict: 3 seed point(s) measured" in out
    line = next(x for x in out.splitlines() if "real starts" in x)
    assert "6 to 15 real starts" in line and "for the whole grid measured once" in line
    few, most, grid = (float(x) for x in __import__("re").findall(r"about (\d+) to (\d+) .* against (\d+)", line)[0])
    assert 0 < few < most < grid


MEASURED = "results/predict-vs-measured/20261206-cpu/runs/20261206T213256Z-cpu-predict-vs-measured-6e57094"


def test_a_refit_after_a_real_start_records_the_model_and_each_measured_points_error(tmp_path):
    """On a committed CPU run whose 6 starts recorded their steps: the refit names every
    start it saw and the error of each prediction against its measured capacity."""
    from vllm_study import sweep
    from vllm_study.records.results import RunFolder
    run = RunFolder(shutil.copytree(sweep.REPO / MEASURED, tmp_path / "run"))
    assert ps.refit(run) is None                       # no predictions: nothing to refit
    ids = run.manifest().points
    points = [_p(pid, 2.0) for pid in ids]
    ps.Predictions(model=ps.ModelVersion(starts=[f"{ids[0]}#s1"], rounds=1, steps=1),
                   error=ps.EndToEnd(), points=points, seeds=[ids[0]], chosen=ids[:2]).save(run)
    v = ps.refit(run)
    assert v.starts == [f"{pid}#s1" for pid in ids] and v.steps > 10000 and v.held_out_median is not None
    measured = ps.measured_capacities(run, run.point(ids[0]).plan().study)
    want = {pid: abs(2.0 / pc.config.value - 1) for pid, pc in measured.items() if pc and pc.config.kind == "value"}
    assert want and v.errors == pytest.approx(want)
    assert ps.read(run.path).refits == [v]
    ps.refit(run)                                      # no new start: no new version
    assert len(ps.read(run.path).refits) == 1


def test_a_point_the_simulation_refuses_is_kept_with_why_never_dropped():
    from vllm_study import sweep
    from vllm_study.predict import step_model
    from vllm_study.records.results import RunFolder
    run = RunFolder(sweep.REPO / MEASURED)
    pid = run.manifest().points[0]
    [model] = step_model.fit_run(run.path)
    p = ps.predict_one((pid, run.point(pid).plan(), model, {"block_size": "128"}))   # no KV block count
    assert not p.predicted and p.rank is None and p.value is None
    assert p.verdict.startswith("not predicted: the simulation failed: ") and "no KV block count" in p.verdict


def test_a_point_drawn_on_several_streams_takes_the_median_stream_and_its_interval_every_stream():
    streams = [_p("a", 1.2), _p("a", 0.9), _p("a", 1.0)]
    p = ps.combine(streams)
    assert p.value == 1.0 and p.draws == [(1.2, None), (0.9, None), (1.0, None)]
    ps.widen(p, 0.05)   # the model's error is narrower than the draws' spread: the draws widen it
    assert (p.low, p.high) == pytest.approx((0.9, 1.2))
    q = ps.widen(ps.combine([_p("b", 1.0), _p("b", 2.0), _p("b", 1.1)]), 0.5)
    assert q.value == 1.1 and (q.low, q.high) == pytest.approx((1.1 / 1.5, 2.0))
    # a bound ranks beyond every value; a stream's bound opens its side of the interval
    r = ps.widen(ps.combine([_p("c", 8.0, "above"), _p("c", 3.0), _p("c", 4.0)]), 0.1)
    assert r.value == 4.0 and r.censored is None and r.high is None and r.low == pytest.approx(3.0)
    s = ps.combine([_p("d", 1.0, "below"), _p("d", 1.0, "below"), _p("d", 3.0)])
    assert s.censored == "below"
    # an even count: the lower middle (the cautious one)
    assert ps.combine([_p("e", 2.0), _p("e", 1.0)]).value == 1.0
    # a stream the simulation refused: the point's verdict is that refusal
    bad = _p("f", None, verdict="not predicted: the simulation failed: x")
    assert ps.combine([_p("f", 1.0), bad]).verdict == bad.verdict


def test_the_points_drawn_again_are_the_leaders_on_one_stream():
    pts = [_p("a", 2.0), _p("b", 8.0, "above"), _p("c", 5.0), _p("d", 0.5, "below"),
           _p("e", None, verdict="not predicted: x")]
    assert ps.leading(pts, 2) == {"b", "c"}
    assert ps.leading(pts, 9) == {"a", "b", "c", "d"}


def _passes_run(tmp_path, values_by_pass):
    """A 4-point capacity run whose manifest holds only the baseline's start, and a
    `predict` that returns each pass's values in turn (as the sweep's passes would)."""
    over = {"grid": {"max_num_batched_tokens": [256, 512, 1024, 2048]}, "baseline": "mbt=512",
            "confirm": {"max_starts": 3}, "predict": {"seed": ["defaults"], "confirm_top": 1, "passes": 2}}
    run = make_capacity_run(tmp_path, {"mbt=256": 4.0, "mbt=512": 3.0, "mbt=1024": 5.0, "mbt=2048": 2.0},
                            study_over=over)
    m = run.manifest()
    m.order = [u for u in m.order if u.point == "mbt=512" and u.block == 1]
    m.save(run.manifest_path)
    calls = iter(values_by_pass)

    def predict(run_, study, workers=None, on_ray=False):
        points = [_p(pid, v) for pid, v in next(calls).items()]
        ps.rank(points)
        return ps.Predictions(model=ps.ModelVersion(starts=["mbt=512#s1"], rounds=1, steps=1), error=ps.EndToEnd(),
                              points=points, seeds=["mbt=512"], chosen=ps.choose(points, 1, "mbt=512"))
    return run, predict


def test_each_pass_predicts_again_after_the_last_ones_starts_and_measures_only_its_new_top(tmp_path, monkeypatch):
    run, predict = _passes_run(tmp_path, [
        {"mbt=256": 3.0, "mbt=512": 3.0, "mbt=1024": 6.0, "mbt=2048": 2.0},    # pass 1: 1024 first
        {"mbt=256": 4.5, "mbt=512": 3.0, "mbt=1024": 4.0, "mbt=2048": 2.0}])   # pass 2, refitted: 256 first
    monkeypatch.setattr(ps, "predict", predict)
    study = run.point("mbt=512").plan().study
    first = ps.plan_confirmation(run, study)
    assert [(u.point, u.start, u.block) for u in first] == [("mbt=1024", 1, 2)]
    second = ps.plan_confirmation(run, study)
    assert [(u.point, u.start, u.block) for u in second] == [("mbt=256", 1, 3)]
    pred = ps.read(run.path)
    assert len(pred.passes) == 2 and pred.passes[0].chosen == ["mbt=1024", "mbt=512"]
    assert pred.chosen_in("mbt=1024") == 1 and pred.chosen_in("mbt=256") == 2 and pred.chosen_in("mbt=2048") is None
    assert [u.point for u in run.manifest().order] == ["mbt=512", "mbt=1024", "mbt=256"]
    assert ps.plan_confirmation(run, study) == []      # `passes` made: no third (predict is not called again)
    # the report sets each config's prediction when it was chosen beside the latest
    from vllm_study.report import report
    sec = predict_section.predicted_vs_measured(run.path, report.Run.load(run).capacities)
    t = sec.table
    assert t.loc["mbt=1024", "chosen in pass"] == "1" and t.loc["mbt=1024", "predicted when chosen"] == "6"
    assert t.loc["mbt=1024", "predicted"] == "4" and t.loc["mbt=512", "chosen in pass"] == "seed"
    measured_1024 = report.Run.load(run).capacities["mbt=1024"].config.value
    assert t.loc["mbt=1024", "error when chosen"] == f"{6.0 / measured_1024 - 1:+.0%}"
    assert sec.lines[0].startswith("pass 1: fitted on 1 start(s)") and "chose mbt=1024, mbt=512" in sec.lines[0]
    assert sec.lines[2].startswith("the error of each prediction made before its config was measured")


def test_a_pass_that_chooses_only_measured_points_adds_no_start(tmp_path, monkeypatch):
    same = {"mbt=256": 3.0, "mbt=512": 3.0, "mbt=1024": 6.0, "mbt=2048": 2.0}
    run, predict = _passes_run(tmp_path, [same, same])
    monkeypatch.setattr(ps, "predict", predict)
    study = run.point("mbt=512").plan().study
    assert [u.point for u in ps.plan_confirmation(run, study)] == ["mbt=1024"]
    assert ps.plan_confirmation(run, study) == []
    assert len(ps.read(run.path).passes) == 2
