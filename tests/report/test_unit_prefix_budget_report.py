"""The Prefix Reuse Budget in the report (issue 12): each budget point against vLLM's own
scheduler per request class (shared vs cold) with 95% intervals, called an effect only
when resolved; the budget's deferrals per point; the scheduler axis named as never bound
where the budget deferred nothing; one implementation shared with
benchmarks/prefix_budget_effect.py. And export's exit code where the exported point does
not surely meet the SLO."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from synthetic_run import make_run
from vllm_study.analysis import intervals as analysis
from vllm_study import cli
from vllm_study.report import report
from vllm_study.report import binding, effects as report_effects
from paths import REPO

ON, OFF = "mbt=256__mrr=0.80", "mbt=256__mrr=off"
ON2, OFF2 = "mbt=512__mrr=0.80", "mbt=512__mrr=off"
SCHEDULER = {"grid": {"max_num_batched_tokens": [256, 512]}, "scheduler": {"min_reuse_ratio": ["off", 0.8]},
             "replicates": 3}
BENCHMARK = REPO / "benchmarks" / "prefix_budget_effect.py"


def _whole(ttft: float = 400.0) -> dict:
    return {"ttft_p50_ms": ttft, "ttft_p90_ms": 2 * ttft, "output_throughput": 100.0, "prefix_cache_hit_rate": 0.2,
            "expected_prefix_hit_rate": 0.25}


def _classes(shared: float) -> dict:
    """The cold class as without the budget; the shared class's TTFT scaled by `shared`."""
    return {"class=cold": {"ttft_p50_ms": 600.0, "ttft_p90_ms": 1000.0},
            "class=shared": {"ttft_p50_ms": 200.0 * shared, "ttft_p90_ms": 500.0 * shared}}


def _budget_run(root: Path, deferred_on: list[float], deferred_on2: list[float]):
    """The CPU case of the issue: the whole round's TTFT does not move, the shared class's
    TTFT P50 drops by 40% under the budget at chunk 256 (nothing moves at 512)."""
    values = {p: _whole() for p in (ON, OFF, ON2, OFF2)}
    groups = {ON: _classes(0.6), OFF: _classes(1.0), ON2: _classes(1.0), OFF2: _classes(1.0)}
    counts = {ON: {"pb_deferred": deferred_on, "pb_admitted_by_age": [0, 1]},
              ON2: {"pb_deferred": deferred_on2, "pb_admitted_by_age": [0]}}
    return make_run(root, values, SCHEDULER, groups=groups, counts=counts)


@pytest.fixture(scope="module")
def budget(tmp_path_factory):
    # 9 rounds a point (3 starts x 3 rounds): 3 or 4 deferred a round at chunk 256, none at 512
    return report.Run.load(_budget_run(tmp_path_factory.mktemp("budget"), [3, 4, 3, 3, 4, 3, 4, 3, 3], [0]).path)


@pytest.fixture(scope="module")
def idle_budget(tmp_path_factory):
    return report.Run.load(_budget_run(tmp_path_factory.mktemp("idle"), [0], [0]).path)


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """A study without a scheduler axis (the synthetic default grid)."""
    points = ("mbt=256__kv=16MiB", "mbt=256__kv=128MiB", "mbt=512__kv=16MiB", "mbt=512__kv=128MiB")
    return make_run(tmp_path_factory.mktemp("plain"), {p: {**_whole(), "tpot_p50_ms": 20.0} for p in points})


def test_the_shared_class_effect_is_shown_with_its_interval_and_called_an_effect_only_when_resolved(budget):
    axis = binding.scheduler_axis(budget)
    assert axis == "min_reuse_ratio"
    assert report_effects.axis_pairs(budget, axis) == [(ON, OFF), (ON2, OFF2)]
    t = report_effects.axis_effect_table(budget, axis)
    assert list(t.columns[:3]) == ["against", "TTFT P50 change", "TTFT P90 change"]
    assert t.loc[(ON, "class=shared"), "against"] == OFF
    shared = t.loc[(ON, "class=shared"), "TTFT P50 change"]
    assert shared.startswith("-") and shared.endswith("better")
    assert t.loc[(ON, "class=shared"), "TTFT P90 change"].endswith("better")
    assert t.loc[(ON, "class=cold"), "TTFT P50 change"].endswith("not resolved")
    assert t.loc[(ON, "all"), "TTFT P50 change"].endswith("not resolved")  # the whole round hides it
    assert t.loc[(ON, "class=cold"), "output tokens/s change"] == ""   # a whole-round metric only
    # analysis.py's own difference, on the class's rounds: the numbers the table shows
    f = report_effects.axis_effect_frame(budget, axis)
    row = f[(f.point == ON) & (f.group == "class=shared") & (f.metric == "ttft_p50_ms")].iloc[0]
    d = analysis.difference(analysis.MetricData.from_rounds(budget.rounds, "ttft_p50_ms", ("class", "shared")),
                            ON, OFF)
    assert (row.estimate, row.low, row.high) == pytest.approx((d.estimate, d.low, d.high))
    assert row.estimate == pytest.approx(-0.4, abs=0.08) and row.high < 0 and row.resolved
    assert row.change == f"{d.estimate:+.1%} [{d.low:+.1%}, {d.high:+.1%}]"
    assert set(f.loc[f.resolved, "group"]) == {"class=shared"}
    assert set(f.loc[f.resolved, "point"]) == {ON}
    # in words: only the resolved differences are called effects
    notes = report_effects.axis_effect_notes(budget, axis)
    effects = [n for n in notes if n.startswith("effect at")]
    assert effects and all(f"{ON} against {OFF}, class=shared: TTFT P" in n for n in effects)
    assert any(f"TTFT P50 {row.change} (better)" in n for n in effects)


def test_the_deferrals_per_point_are_the_median_per_round_with_the_range(budget):
    t = binding.deferral_table(budget)
    assert list(t.index) == [ON, ON2]  # the budget's points only: off is vLLM's own scheduler
    assert t.loc[ON, "deferred per round"] == "3 (3 to 4)" and t.loc[ON, "rounds"] == 9
    assert t.loc[ON, "let in by the age bound per round"] == "0 (0 to 1)"
    assert t.loc[ON, "let in while idle per round"] == "not recorded"
    assert t.loc[ON, "bound"] == "yes"
    assert t.loc[ON2, "deferred per round"] == "0 (0 to 0)" and t.loc[ON2, "bound"] == "never"
    assert t.loc[ON, "min_reuse_ratio"] == "0.80"


def test_where_the_budget_deferred_nothing_the_binding_names_the_scheduler_axis_never_bound(budget, idle_budget):
    notes = binding.binding_notes(idle_budget)
    assert any(n.startswith("min_reuse_ratio never bound: the budget deferred no request in any round")
               and ON in n and ON2 in n for n in notes)
    # where it bound at some points: the effects cell says where, and where it never did
    line = binding.scheduler_binding(budget)
    assert line.startswith(f"min_reuse_ratio bound at 1 of 2 budget point(s) (requests deferred in a round): {ON}")
    assert f"never bound (no request deferred in any round; no effect to show there) at: {ON2}" in line
    assert line in report_effects.axis_effect_notes(budget, "min_reuse_ratio")
    assert not any("min_reuse_ratio" in n for n in binding.binding_notes(budget))


def test_a_study_without_a_scheduler_axis_keeps_its_binding_and_gets_one_line(plain, capsys):
    from vllm_study import notebook_support as ns
    r = report.Run.load(plain.path)
    assert binding.scheduler_axis(r) is None and binding.deferral_table(r) is None
    assert binding.binding_notes(r) == [
        "max_num_batched_tokens: the server did not report prefill lengths, so the study cannot say whether it bound",
        "kv_cache_memory_bytes: no KV usage was sampled, so the study cannot say whether it bound"]
    capsys.readouterr()
    assert ns.axis_effects(r) is None
    assert capsys.readouterr().out.count("\n") == 1


def test_the_report_cell_shows_effects_binding_and_deferrals(budget, capsys):
    from vllm_study import notebook_support as ns
    t = ns.axis_effects(budget)
    out = capsys.readouterr().out
    assert t.loc[(ON, "class=shared"), "TTFT P50 change"].endswith("better")
    assert binding.scheduler_binding(budget) in out and "3 (3 to 4)" in out
    assert f"effect at {ON} against {OFF}, class=shared" in out
    # any axis, against the baseline's value or its first: here chunk 512 against 256
    by_chunk = ns.axis_effects(budget, "max_num_batched_tokens")
    assert (ON2, "class=shared") in by_chunk.index and by_chunk.loc[(ON2, "all"), "against"] == ON


def _benchmark():
    spec = importlib.util.spec_from_file_location("prefix_budget_effect", BENCHMARK)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_benchmark_prints_the_reports_own_comparison(budget, capsys, monkeypatch):
    assert "analysis.difference" not in BENCHMARK.read_text()  # one implementation: the report's
    monkeypatch.setattr(sys, "argv", ["prefix_budget_effect.py", str(budget.folder.path)])
    assert _benchmark().main() == 0
    out = capsys.readouterr().out
    f = report_effects.axis_effect_frame(budget, "min_reuse_ratio")
    for row in f.itertuples():
        assert row.change in out
    assert "class=shared" in out and "3 (3 to 4)" in out


# -- export: exit 3 where the exported point does not surely meet the SLO ------------------
def test_export_exits_3_where_the_point_does_not_surely_meet_the_slo_and_names_the_files(plain, tmp_path, capsys):
    r = report.Run.load(plain.path)
    point = "mbt=256__kv=16MiB"
    straddled = r.interval(point, "ttft_p90_ms")["value"]  # inside the point's interval: not resolved
    out = tmp_path / "out"
    argv = ["export", str(plain.path), "--point", point, "--out", str(out), "--slo", f"ttft_p90_ms={straddled}"]
    assert cli.main(argv) == 3
    err = capsys.readouterr().err
    cfg, note = out / f"synthetic.{point}.serve.yaml", out / f"synthetic.{point}.md"
    assert cfg.exists() and note.exists()
    assert f"error: {point} does not surely meet the SLO given with --slo" in err
    assert f"ttft_p90_ms <= {straddled:g}: not resolved" in err and str(cfg) in err and str(note) in err
    assert cli.main(argv + ["--force"]) == 0
    assert capsys.readouterr().err.startswith("warning:")
    assert cli.main(["export", str(plain.path), "--best", "--out", str(out), "--slo", "ttft_p90_ms=10000"]) == 0
    assert capsys.readouterr().err == ""
    assert cli.main(["export", str(plain.path), "--point", point, "--out", str(out)]) == 0  # no SLO at all


def test_export_judges_the_point_on_the_studys_own_slo(tmp_path, capsys):
    run = make_run(tmp_path / "r", {"mbt=256__kv=16MiB": _whole(), "mbt=512__kv=16MiB": _whole(100.0)},
                   {"slo": {"ttft_p90_ms": 500}})
    assert cli.main(["export", str(run.path), "--best", "--out", str(tmp_path / "a")]) == 0  # 512 meets it
    assert cli.main(["export", str(run.path), "--point", "mbt=256__kv=16MiB", "--out", str(tmp_path / "b")]) == 3
    err = capsys.readouterr().err
    assert "does not surely meet the study's slo (its 95% interval" in err and "ttft_p90_ms <= 500: misses" in err
