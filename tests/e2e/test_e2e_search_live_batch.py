"""A live search on the CPU engine whose trials differ only in live scheduler limits:
one start serves all three trials, launched at their largest limits, each trial's rounds
run under its own limits as the engine reports them, each trial told its own outcome; the
confirmation starts are fresh starts of one configuration each. The server is the fake
engine's: how a search shares a start is the kit's; the limits are reported by the kit's
own live-limits plugin code running in it (real vLLM keeping to them:
test_e2e_live_sweep.py, test_e2e_live_knobs.py)."""
from __future__ import annotations

import optuna
import pytest

from e2e_support import fake_engine_study, sweep, tiny, write
from vllm_study.measure import live_knobs
from vllm_study.records.results import ROUNDS, RunFolder, read_rounds
from vllm_study.report.answer import answer_text
from vllm_study.report.report import Run
from vllm_study.search import config_search as cs

pytestmark = [pytest.mark.e2e, pytest.mark.fake_engine]

STUDY = fake_engine_study(tiny(grid=None, rounds=1, search={
    "space": {"max_num_batched_tokens": [256, 512], "max_num_seqs": [2, 4]},
    "objective": "output_throughput", "trials": 3, "top_k": 1, "confirm_starts": 1, "seed": 0}))


def test_one_start_serves_three_trials_each_under_its_own_limits(tmp_path):
    done = sweep(write(tmp_path, STUDY), "--results", tmp_path / "results", timeout=900)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "live knobs: a start serves up to 3 trials" in done.stdout
    run = RunFolder(next((tmp_path / "results").iterdir()))
    order = run.manifest().order
    trial_units = [u for u in order if u.block == cs.TRIAL_BLOCK]
    (unit,) = trial_units
    assert len(unit.serves) == 3 and unit.serves[0] == unit.point
    confirm = [u for u in order if u.block > cs.TRIAL_BLOCK]
    assert confirm and all(not u.serves for u in confirm)  # confirmation: fresh starts of one config
    # a trial's confirmation is its point's next start, after the one it shared
    assert all(u.start == 2 for u in confirm if u.point in unit.serves)
    assert all(run.point(u.point).start(u.start).status == "ok" for u in confirm)

    values = {p: run.point(p).plan().point.values for p in unit.serves}
    lead = run.point(unit.point).start(1)
    cmd = lead.launch.command
    for flag, knob in (("--max-num-batched-tokens", "max_num_batched_tokens"), ("--max-num-seqs", "max_num_seqs")):
        assert int(cmd[cmd.index(flag) + 1]) == max(v[knob] for v in values.values())
    assert live_knobs.SCHEDULER_CLS in cmd
    for p, v in values.items():
        rounds = read_rounds(run.point(p).start_dir(1) / ROUNDS)  # the trial's start (s2: its confirmation)
        assert rounds and all(r.status == "ok" for r in rounds)
        for r in rounds:  # the engine's own report of the limits it ran the round under
            assert (r.limits["max_num_batched_tokens"], r.limits["max_num_seqs"]) == (
                v["max_num_batched_tokens"], v["max_num_seqs"])
            assert 0 < r.limits["peak_running"] <= v["max_num_seqs"]

    journal = optuna.load_study(study_name="e2e", storage=optuna.storages.JournalStorage(
        optuna.storages.journal.JournalFileBackend(str(run.path / cs.JOURNAL))))
    started = [t for t in journal.trials if "point" in t.user_attrs]
    assert sorted(t.user_attrs["point"] for t in started) == sorted(unit.serves)
    assert all(t.state == optuna.trial.TrialState.COMPLETE and t.value > 0 for t in started)
    lead_trial = next(t for t in started if t.user_attrs["point"] == unit.point)
    assert sorted(t.user_attrs.get("alongside", -1) for t in started) == [-1, lead_trial.number, lead_trial.number]
    assert (run.path / "report.html").exists()
    assert "3 trials measured in 1 server start (live knobs" in answer_text(Run.load(run))
