"""Confirmation until resolved (`confirm:`) on fake capacity runs: blocks of the best, the
runner-up and the baseline are added until both gains are resolved or the cap is reached,
a resumed run adds no block twice, and the stop reason is recorded and shown."""
from __future__ import annotations

import pytest
from synthetic_run import add_capacity_start, make_capacity_run

from vllm_study.analysis import confirmation as confirming
from vllm_study.records import confirmation
from vllm_study.sweep import SweepOutcome, confirm_until_resolved, unit_finished

GRID = {"grid": {"max_num_batched_tokens": [256, 512, 1024]}, "baseline": "mbt=256", "replicates": 2}


def _run(tmp_path, caps: dict[str, list[float]], max_starts: int, **confirm):
    run = make_capacity_run(tmp_path / "r", {p: tuple(v[:2]) for p, v in caps.items()}, lo=1.0, hi=16.0,
                            study_over={**GRID, "confirm": {"until": "resolved", "max_starts": max_starts, **confirm}})
    from vllm_study.report.run import Run
    return run, Run.load(run).study


def _blocks(caps):
    """A fake run_block: each unit's start meets the SLO up to the test's k-th capacity."""
    def run_block(units, outcome):
        for u in units:
            add_capacity_start(outcome.run, u.point, u.start, caps[u.point][u.start - 1])
        return SweepOutcome(outcome.run, 0)
    return run_block


# the best (1024) about 1.2 x the runner-up and 2.3 x the baseline, with start-to-start spread
# wide enough that two starts each leave best-vs-runner-up unresolved
RESOLVES = {"mbt=256": [2.5, 2.8, 2.6, 2.7, 2.55, 2.75, 2.65, 2.6],
            "mbt=512": [4.8, 6.2, 5.2, 5.4, 5.1, 5.5, 5.3, 5.25],
            "mbt=1024": [5.6, 7.2, 6.3, 6.5, 6.2, 6.6, 6.4, 6.35]}


def test_blocks_are_added_until_both_gains_are_resolved(tmp_path):
    run, study = _run(tmp_path, RESOLVES, max_starts=8)
    planned = max(u.block for u in run.manifest().order)
    confirm_until_resolved(run, study, SweepOutcome(run, 0), _blocks(RESOLVES))
    rec = confirmation.read(run.path)
    assert not rec.verdicts[0].resolved and rec.verdicts[0].baseline_resolved   # the runner-up was not told apart
    assert rec.stop == confirmation.RESOLVED and rec.last.resolved
    assert rec.last.best == "mbt=1024" and rec.last.runner_up == "mbt=512"
    added = [u for u in run.manifest().order if u.block > planned]
    assert len(added) >= 3 and len(added) % 3 == 0
    for b in {u.block for u in added}:   # one fresh start each of the three per block
        assert sorted(u.point for u in added if u.block == b) == ["mbt=1024", "mbt=256", "mbt=512"]
    assert [v.block for v in rec.verdicts] == list(range(planned, max(u.block for u in added) + 1))
    assert not any(v.resolved for v in rec.verdicts[:-1])   # no block after it was resolved


def test_confirmation_stops_at_max_starts_when_the_best_and_runner_up_tie(tmp_path):
    tie = {"mbt=256": [2.5, 2.8, 2.6, 2.7], "mbt=512": [5.0, 6.0, 5.5, 5.2], "mbt=1024": [6.0, 5.0, 5.2, 5.5]}
    run, study = _run(tmp_path, tie, max_starts=4)
    confirm_until_resolved(run, study, SweepOutcome(run, 0), _blocks(tie))
    rec = confirmation.read(run.path)
    assert rec.stop.startswith(confirmation.MAX_STARTS) and "4 starts" in rec.stop
    assert not rec.last.runner_up_resolved and rec.last.baseline_resolved
    assert {u.start for u in run.manifest().order} == {1, 2, 3, 4}
    assert rec.last.starts == {"mbt=256": 4, "mbt=512": 4, "mbt=1024": 4}


def test_a_resumed_run_finishes_its_block_and_adds_none_twice(tmp_path):
    run, study = _run(tmp_path, RESOLVES, max_starts=8)
    planned = max(u.block for u in run.manifest().order)
    full = _blocks(RESOLVES)

    def budget_spent(units, outcome):   # the first start of the block ran, then the budget ended
        full(units[:1], outcome)
        return SweepOutcome(outcome.run, 2, "stopped after 1.0 of 1 minutes")
    confirm_until_resolved(run, study, SweepOutcome(run, 0), budget_spent)
    rec = confirmation.read(run.path)
    assert rec.stop.startswith(confirmation.BUDGET)
    order = run.manifest().order
    assert max(u.block for u in order) == planned + 1
    # --resume: the sweep runs the manifest's unfinished units, then confirms again
    todo = [u for u in order if not unit_finished(run, u)]
    assert len(todo) == 2
    outcome = full(todo, SweepOutcome(run, 0))
    confirm_until_resolved(run, study, outcome, full)
    order = run.manifest().order
    keys = [(u.point, u.start) for u in order]
    assert len(keys) == len(set(keys))   # no start appended twice
    assert sum(1 for u in order if u.block == planned + 1) == 3
    assert confirmation.read(run.path).stop == confirmation.RESOLVED


def test_the_report_says_what_was_resolved_and_why_it_stopped_only_where_recorded(tmp_path):
    from vllm_study.report.capacity_section import capacity_answer
    from vllm_study.report.run import Run
    run, study = _run(tmp_path, RESOLVES, max_starts=8)
    assert "Confirmation" not in capacity_answer(Run.load(run))   # a run without the record reads as before
    confirm_until_resolved(run, study, SweepOutcome(run, 0), _blocks(RESOLVES))
    answer = capacity_answer(Run.load(run))
    assert "Confirmation until resolved, " in answer and "block(s) begun after the planned starts" in answer
    assert "over the baseline mbt=256 resolved" in answer and "over the runner-up mbt=512 resolved" in answer
    assert "It stopped: resolved." in answer
    # the starts in the order best, runner-up, baseline, whatever the process's string hashing
    last = confirmation.read(run.path).last
    assert list(last.starts) == ["mbt=1024", "mbt=512", "mbt=256"]
    assert f"(starts judged: mbt=1024 {last.starts['mbt=1024']}, mbt=512 {last.starts['mbt=512']}, mbt=256 " in answer


def test_a_run_stopped_inside_a_block_is_reported_on_the_starts_it_holds(tmp_path):
    """The budget ended after a block's first start: the record's last verdict judged the
    block before; the report judges the folder as it is, counting that start."""
    from vllm_study.report.capacity_section import capacity_answer
    from vllm_study.report.run import Run
    run, study = _run(tmp_path, RESOLVES, max_starts=8)
    full = _blocks(RESOLVES)

    def budget_spent(units, outcome):
        full(units[:1], outcome)
        return SweepOutcome(outcome.run, 2, "stopped after 1.0 of 1 minutes")
    confirm_until_resolved(run, study, SweepOutcome(run, 0), budget_spent)
    rec = confirmation.read(run.path)
    first = next(u for u in run.manifest().order if u.block == rec.last.block + 1)
    assert rec.last.starts[first.point] == 2          # judged before the block's start
    now = confirming.current(run, study, rec)
    assert now.block == rec.last.block + 1 and now.starts[first.point] == 3
    assert confirming.current(run, study, rec) is not rec.last
    answer = capacity_answer(Run.load(run))
    assert f"{first.point} 3" in answer and "1 block(s) begun" in answer and "It stopped: --max-minutes" in answer


def test_a_failed_start_stops_confirmation_and_says_which(tmp_path):
    from vllm_study.records.results import StartRecord
    run, study = _run(tmp_path, RESOLVES, max_starts=8)

    def fails(units, outcome):
        u = units[0]
        d = run.point(u.point).start_dir(u.start)
        d.mkdir(parents=True)
        StartRecord(point=u.point, start=u.start, block=u.block, status="failed", reason="server did not start",
                    rounds_planned=1, started_utc="x", host="test").save(d / "start.json")
        _blocks(RESOLVES)(units[1:], outcome)
        return SweepOutcome(run, 0)
    confirm_until_resolved(run, study, SweepOutcome(run, 0), fails)
    rec = confirmation.read(run.path)
    assert rec.stop.startswith(confirmation.FAILED) and f"{run.manifest().order[-3].point}#s3" in rec.stop


def test_confirm_after_a_search_is_refused_with_the_way_out(tmp_path):
    import json

    from vllm_study.define.schema import StudyError
    from vllm_study.sweep import sweep
    study = {"name": "s", "slo": {"ttft_p90_ms": 2000}, "workload": {"load": {"kind": "poisson", "rate": 2}},
             "capacity": {"over": "rate", "lo": 1, "hi": 8}, "confirm": {"max_starts": 4},
             "search": {"space": {"max_num_seqs": [8, 32]}, "objective": "capacity_rps", "trials": 4}}
    f = tmp_path / "s.yaml"
    f.write_text(json.dumps(study))
    with pytest.raises(StudyError, match="after a search's confirmation it is not run yet"):
        sweep([str(f)], tmp_path / "results", "cpu")
    assert not (tmp_path / "results").exists()


def test_no_block_is_added_where_every_capacity_is_below_the_lowest_load(tmp_path, capsys):
    from vllm_study.report.capacity_section import capacity_answer
    from vllm_study.report.run import Run
    low = {"mbt=256": [0.2, 0.3], "mbt=512": [0.3, 0.2], "mbt=1024": [0.25, 0.3]}
    run, study = _run(tmp_path, low, max_starts=6)
    before = run.manifest().order
    confirm_until_resolved(run, study, SweepOutcome(run, 0), _blocks(low))
    said = capsys.readouterr().out
    assert "confirm: best" not in said and "confirm: no best: every point's capacity is below" in said   # none is best
    rec = confirmation.read(run.path)
    assert rec.stop.startswith(confirmation.NOTHING) and "below its lowest load" in rec.stop
    assert run.manifest().order == before
    assert "Confirmation until resolved stopped: nothing to confirm: every point's capacity is below" \
        in capacity_answer(Run.load(run))


def test_no_block_is_added_where_the_best_and_runner_up_both_met_the_slo_at_the_highest_load(tmp_path):
    top = {"mbt=256": [2.5, 2.8, 2.6], "mbt=512": [18.0, 19.0, 18.5], "mbt=1024": [20.0, 21.0, 20.5]}
    run, study = _run(tmp_path, top, max_starts=6)
    before = run.manifest().order
    confirm_until_resolved(run, study, SweepOutcome(run, 0), _blocks(top))
    rec = confirmation.read(run.path)
    assert rec.last.baseline_resolved and not rec.last.runner_up_resolved
    assert set(rec.last.at_highest) == {"mbt=512", "mbt=1024"}
    assert rec.stop.startswith(confirmation.NOTHING) and rec.stop.endswith("raise capacity.hi")
    assert run.manifest().order == before


def test_a_bound_at_the_highest_load_does_not_stop_a_comparison_that_can_still_resolve(tmp_path):
    # the best met at the highest load; the runner-up has a value: more starts can still part them
    near = {"mbt=256": [2.5, 2.8, 2.6, 2.7], "mbt=512": [12.0, 15.5, 13.0, 14.5], "mbt=1024": [20.0, 21.0, 20.5, 22.0]}
    run, study = _run(tmp_path, near, max_starts=4)
    confirm_until_resolved(run, study, SweepOutcome(run, 0), _blocks(near))
    rec = confirmation.read(run.path)
    assert rec.verdicts[0].at_highest == ["mbt=1024"]
    assert len(rec.verdicts) > 1 and "raise capacity.hi" not in (rec.stop or "")


def test_the_blocks_run_through_the_sweeps_dispatcher(tmp_path):
    """The appended units go through sweep._run_units and an executor, as a sweep runs them."""
    from vllm_study import executors, sweep

    class Measures(executors.Executor):   # each start meets the SLO up to the test's k-th capacity
        rounds_live = False

        def __call__(self, unit, slot, bar, release=None):
            add_capacity_start(self.run, unit.point, unit.start, RESOLVES[unit.point][unit.start - 1])
            return self.run.point(unit.point).summary()
    run, study = _run(tmp_path, RESOLVES, max_starts=8)
    runner = Measures(run, study, "cpu", [])
    out = confirm_until_resolved(run, study, SweepOutcome(run, 0), lambda units, o: sweep._run_units(
        run, units, study, 0.0, None, runner, o.lengths))
    assert out.stop_note is None and confirmation.read(run.path).stop == confirmation.RESOLVED
    assert all(unit_finished(run, u) for u in run.manifest().order)
    assert max(u.start for u in run.manifest().order) > study.replicates


def _capacity(point: str, starts: list[tuple[float, float, float] | float], pooled_df: int | None = None):
    """A point's capacity from its starts: (value, low, high) fitted ones, or a float: below it."""
    from vllm_study.capacity import fit
    from vllm_study.capacity.estimate import PointCapacity
    caps = [fit.StartCapacity(kind="value", value=s[0], low=s[1], high=s[2], lowest=2.95, highest=7.4,
                              log_se=0.025) if isinstance(s, tuple)
            else fit.StartCapacity(kind="below", value=s, lowest=s, highest=s) for s in starts]
    return PointCapacity(point, fit.combine(caps, spread=0.02 if pooled_df else None), caps,
                         ["fit"] * len(caps), 1.0, pooled_df)


def test_a_gain_on_one_start_is_not_resolved_until_a_restart_measures_the_spread():
    # the steady-state H200 run after its first block: the best's one start 3.33 [3.12, 3.43],
    # the baseline below 2.95; its interval alone would part them
    best = _capacity("4096", [(3.33, 3.12, 3.43)])
    base = _capacity("defaults", [2.95])
    words, ok = confirming._told_apart(best, base)
    assert not ok and "one start, so no start-to-start spread" in words and "4096 and defaults" in words
    # restarts measure the spread (two give t on 1 df, too wide here; three that agree part them)
    best3 = _capacity("4096", [(3.33, 3.12, 3.43), (3.30, 3.1, 3.4), (3.36, 3.15, 3.45)])
    words, ok = confirming._told_apart(best3, _capacity("defaults", [2.95] * 3))
    assert ok and "one start" not in words, words
    # or a spread pooled over the run's points (3 df or more) stands in for a point's own
    words, ok = confirming._told_apart(_capacity("4096", [(3.33, 3.12, 3.43)], pooled_df=4),
                                         _capacity("defaults", [2.95], pooled_df=4))
    assert ok, words


def test_a_baseline_below_the_floor_in_two_starts_is_not_started_again(tmp_path):
    """The gain over a baseline below the floor in every start is the best's lower end over
    the floor: its third start would decide nothing, so the next block starts the best and
    the runner-up only, and the report says why."""
    from vllm_study.report.capacity_section import capacity_answer
    from vllm_study.report.run import Run
    caps = {"mbt=256": [0.5] * 4, "mbt=512": [4.8, 6.2, 5.2, 5.4], "mbt=1024": [5.6, 7.2, 6.3, 6.5]}
    run, study = _run(tmp_path, caps, max_starts=4)
    planned = max(u.block for u in run.manifest().order)
    confirm_until_resolved(run, study, SweepOutcome(run, 0), _blocks(caps))
    rec = confirmation.read(run.path)
    assert rec.verdicts[0].settled == ["mbt=256"] and rec.verdicts[0].starts["mbt=256"] == 2
    added = [u for u in run.manifest().order if u.block > planned]
    assert added and {u.point for u in added} == {"mbt=1024", "mbt=512"}
    assert rec.last.baseline_resolved and "at least" in rec.last.over_baseline
    assert "Not started again, below the lowest load in each start: mbt=256" in capacity_answer(Run.load(run))


def test_a_half_width_target_starts_the_best_alone_once_both_gains_are_resolved(tmp_path):
    """confirm.half_width: after both gains resolve, blocks of the best alone until its
    interval is that narrow; the stop says resolved only then."""
    run, study = _run(tmp_path, RESOLVES, max_starts=8, half_width=0.06)
    planned = max(u.block for u in run.manifest().order)
    confirm_until_resolved(run, study, SweepOutcome(run, 0), _blocks(RESOLVES))
    rec = confirmation.read(run.path)
    first_resolved = next(v for v in rec.verdicts if v.resolved)
    assert not first_resolved.precise and first_resolved.best_half_width > 0.06   # the target asked for more
    assert rec.stop == confirmation.RESOLVED and rec.last.done and rec.last.best_half_width <= 0.06
    after = [u for u in run.manifest().order if u.block > first_resolved.block]
    assert after and {u.point for u in after} == {"mbt=1024"}   # the best alone
    assert [v.block for v in rec.verdicts] == list(range(planned, max(u.block for u in run.manifest().order) + 1))
    assert "within +-6% of its value" in study.confirm_plan


def test_a_half_width_not_met_by_max_starts_says_so(tmp_path):
    run, study = _run(tmp_path, RESOLVES, max_starts=5, half_width=0.001)
    confirm_until_resolved(run, study, SweepOutcome(run, 0), _blocks(RESOLVES))
    rec = confirmation.read(run.path)
    assert rec.stop.startswith(confirmation.MAX_STARTS) and rec.last.resolved and not rec.last.precise
    words = confirming.stop_words(rec)
    assert f"its interval +-{rec.last.best_half_width:.0%} of its value, wider than confirm.half_width" in words


def test_an_unresolved_gain_says_which_capacity_is_a_bound_and_which_is_open():
    """The baseline below the floor against a best whose interval is open below: only the
    baseline is a bound, and the words say so (never "both are bounds on the same side")."""
    from vllm_study.capacity import fit
    from vllm_study.capacity.estimate import PointCapacity
    best = PointCapacity("chunk2048", fit.ConfigCapacity(kind="value", value=1.1, low=None, high=1.4, starts=3,
                                                         spread=0.1), [], ["fit"] * 3, 3.7, None)
    base = PointCapacity("defaults", fit.ConfigCapacity(kind="below", value=0.8, starts=2), [], ["fit"] * 2, 3.7)
    words, ok = confirming._told_apart(best, base)
    assert not ok
    assert "both are bounds" not in words
    assert "defaults's capacity is a bound, below 0.8" in words
    assert "chunk2048's interval is open below" in words and "at most 1.4" in words


def test_a_runner_up_that_is_the_baseline_is_compared_once():
    v = confirmation.Verdict(block=3, best="mbt=1024", runner_up="mbt=256", baseline="mbt=256",
                             starts={"mbt=1024": 3, "mbt=256": 3}, over_baseline="1.80x [1.50, 2.10]",
                             over_runner_up="1.80x [1.50, 2.10]", baseline_resolved=True, runner_up_resolved=True)
    words = confirming.stop_words(confirmation.ConfirmRecord(planned_blocks=2, verdicts=[v], stop="resolved"), v)
    assert words.count("1.80x [1.50, 2.10]") == 1, words
    assert "over the baseline mbt=256, also the runner-up, resolved (1.80x [1.50, 2.10])" in words


def test_the_report_counts_the_starts_each_point_has_after_confirmation(tmp_path):
    """Two planned starts each, then confirmation starts the best and the runner-up again
    (the baseline below the floor is settled): the header gives the range, not the plan."""
    from vllm_study.report import answer
    from vllm_study.report.run import Run
    caps = {"mbt=256": [0.5] * 4, "mbt=512": [4.8, 6.2, 5.2, 5.4], "mbt=1024": [5.6, 7.2, 6.3, 6.5]}
    run, study = _run(tmp_path, caps, max_starts=4)
    confirm_until_resolved(run, study, SweepOutcome(run, 0), _blocks(caps))
    r = Run.load(run)
    counts = {s.point: len(run.point(s.point).starts()) for s in r.summaries}
    assert counts["mbt=256"] == 2 and max(counts.values()) > 2
    context = answer.answer_context(r)
    assert f"3 points, 2 to {max(counts.values())} server starts each" in context, context
    assert "2 server starts each" not in context


def test_a_half_width_a_coarse_bracket_cannot_reach_stops_instead_of_starting_the_best_again(tmp_path):
    """Searched in 3 steps over [1, 16], every start of the best brackets [4, 8]: its interval
    reaches that bracket (capacity.fit.within_bracket), and more starts do not narrow it.
    Once both gains resolve, confirmation stops and names the setting that would."""
    caps = {"mbt=256": [2.5, 2.6] * 4, "mbt=512": [2.7, 2.8] * 4, "mbt=1024": [6.3, 6.5] * 4}
    coarse = {"over": "rate", "lo": 1.0, "hi": 16.0, "precision": 0.1, "max_steps": 3, "floor": 1.0}
    run = make_capacity_run(tmp_path / "r", {p: tuple(v[:2]) for p, v in caps.items()}, study_over={
        **GRID, "capacity": coarse, "confirm": {"until": "resolved", "max_starts": 8, "half_width": 0.05}})
    from vllm_study.report.run import Run
    study = Run.load(run).study
    confirm_until_resolved(run, study, SweepOutcome(run, 0), _blocks(caps))
    rec = confirmation.read(run.path)
    assert rec.last.resolved and not rec.last.precise and rec.last.best_bracket_bound
    assert rec.stop.startswith(confirmation.NOTHING) and "capacity.precision" in rec.stop
    assert max(rec.last.starts.values()) < 8          # no start spent on what starts cannot move
