"""A search with live knobs: one server start serves several trials that differ only in
the scheduler limits the kit's plugin changes at runtime. The trials of a start share
every knob that needs a restart, the start is launched at their largest limits, each
trial keeps its own point, plan and outcome; a launch vLLM would refuse falls back to a
start a trial; a shared start's crash is judged at the limits it was launched at."""
from __future__ import annotations

import optuna
import pytest

from e2e_support import kv_bytes, tiny
from vllm_study.define.grid import PointMaker, expand, launch_limits, search_live_label
from vllm_study.define.study_file import study_from_dict
from vllm_study.search import config_search as cs
from vllm_study.sweep import create_run

SMALL, ROOMY = kv_bytes(8192), kv_bytes(16384)
SPACE = {"kv_cache_memory_bytes": [SMALL, ROOMY], "max_num_batched_tokens": [256, 512, 1024],
         "max_num_seqs": [2, 4, 8]}
LIVE = ("max_num_batched_tokens", "max_num_seqs")


def _study(**search):
    s = tiny(grid=None, rounds=1, search={"space": SPACE, "objective": "output_throughput", "trials": 9,
                                          "seed": 1, **search})
    s["engine_args"] = {k: v for k, v in s["engine_args"].items() if k != "kv_cache_memory_bytes"}
    return study_from_dict(s)


def _source(tmp_path, study, maker=None):
    run = create_run(tmp_path / "results", study, "cpu", expand(study, "cpu"))
    loop = cs.SearchLoop(study.search, "s", optuna.storages.InMemoryStorage(), cs.checker(PointMaker(study, "cpu")))
    return cs.TrialSource(loop, run, study, maker or PointMaker(study, "cpu"), "cpu"), loop, run


def _throughput(values: dict) -> float:
    return values["max_num_batched_tokens"] / 256 + values["max_num_seqs"]


def _tell_all(source, unit, loop, monkeypatch):
    """The unit's trials told an outcome from their values, as their summaries would give it."""
    monkeypatch.setattr(cs, "outcome_of", lambda summary, study, folder: cs.TrialOutcome(
        _throughput(folder.plan().point.values)))
    source.done(unit, None)


def test_a_start_serves_trials_that_share_every_restart_knob_launched_at_their_largest(tmp_path, monkeypatch):
    study = _study()
    source, loop, run = _source(tmp_path, study)
    units = []
    for unit in source:
        units.append(unit)
        plans = [run.point(p).plan() for p in unit.points]
        values = [p.point.values for p in plans]
        assert len({v["kv_cache_memory_bytes"] for v in values}) == 1  # one restart value a start
        assert len({tuple(v[k] for k in LIVE) for v in values}) == len(values)  # no trial twice in a start
        lead = plans[0]
        assert lead.point.id == unit.point
        launch = launch_limits([p.point for p in plans])
        assert lead.launch == (launch or None) and all(p.launch is None for p in plans[1:])
        for k in LIVE:  # the launch holds every trial's limit, and is one of theirs
            top = (lead.launch or {}).get(k, lead.point.values[k])
            assert top == max(v[k] for v in values)
        _tell_all(source, unit, loop, monkeypatch)
    trials = loop.started()
    assert len(trials) == 9 and all(t.state == optuna.trial.TrialState.COMPLETE for t in trials)
    assert len(units) < 9 and max(len(u.points) for u in units) == 3  # fewer starts than trials
    assert sum(len(u.points) for u in units) == 9
    # the run order and the manifest's points hold every trial, each point once
    manifest = run.manifest()
    assert [u.point for u in manifest.order] == [u.point for u in units]
    assert sorted(set(manifest.points)) == sorted(manifest.points)
    # the journal says which trials were proposed for another's start and where a start was launched
    along = [t for t in trials if "alongside" in t.user_attrs]
    assert len(along) == 9 - len(units)
    # a trial served by another's start has had its start 1: its 3 confirmation starts are 2 to 4
    served = next(p for u in units if u.serves for p in u.serves[1:])
    confirm = cs.confirmation_units(run, study, [served])
    assert sorted(u.start for u in confirm if u.point == served) == [2, 3, 4] and all(not u.serves for u in confirm)
    shared = [u for u in units if u.serves and run.point(u.point).plan().launch]
    for u in shared:
        numbers = {t.number for t in trials if t.user_attrs["point"] in u.points}
        assert all(t.user_attrs["launched_at"] == run.point(u.point).plan().launch
                   for t in trials if t.number in numbers)


def test_live_batch_one_or_live_knobs_off_start_one_trial_each(tmp_path, monkeypatch):
    own_scheduler = {**_study().server.model_dump(mode="json"),
                     "extra_cli_args": [*_study().server.extra_cli_args, "--scheduler-cls", "my.Scheduler"]}
    for i, study in enumerate((_study(live_batch=1),
                               study_from_dict({**_study().model_dump(mode="json"), "server": {"live_knobs": False}}),
                               study_from_dict({**_study().model_dump(mode="json"), "server": own_scheduler}))):
        source, loop, _ = _source(tmp_path / str(i), study)
        unit = next(source)
        assert unit.serves == [] and len(loop.started()) == 1


def test_a_launch_vllm_would_refuse_falls_back_to_a_start_a_trial(tmp_path):
    study = _study()
    real = PointMaker(study, "cpu")

    class RefusesLaunches:
        """vLLM's rules, and one more: no start above a trial's own limits."""
        def make(self, values, pid=None):
            if values not in asked:
                return None, ["launch refused (the test's rule)"]
            return real.make(values, pid)
    asked = []
    source, loop, run = _source(tmp_path, study, maker=RefusesLaunches())
    orig = loop.propose, loop.propose_alongside
    loop.propose = lambda: _noted(orig[0]())
    loop.propose_alongside = lambda lead, fixed: _noted(orig[1](lead, fixed))

    def _noted(p):
        if p is not None:
            asked.append(p.values)
        return p
    first = next(source)
    assert first.serves == [] and run.point(first.point).plan().launch is None
    queued = list(source.queue)
    assert queued and all(u.serves == [] for u in queued)  # its batch's other trials: a start each
    assert [next(source) for _ in queued] == queued
    assert not any("launched_at" in t.user_attrs for t in loop.started())


def test_a_shared_starts_crash_is_judged_at_its_launch_limits():
    study = _study(first=[{"kv_cache_memory_bytes": ROOMY, "max_num_batched_tokens": 256, "max_num_seqs": 2}])
    loop = cs.SearchLoop(study.search, "s", optuna.storages.InMemoryStorage(), lambda v: [])
    lead = loop.propose()
    other = loop.propose_alongside(lead, {"kv_cache_memory_bytes": ROOMY})
    assert other.values["kv_cache_memory_bytes"] == ROOMY
    assert loop.trials()[other.number].user_attrs["alongside"] == lead.number
    launch = {"max_num_batched_tokens": 1024, "max_num_seqs": 8}
    loop.mark_launch([lead.number, other.number], launch)
    loop.record(lead.number, cs.TrialOutcome(failed="torch.OutOfMemoryError: CUDA out of memory"))
    # out of memory in a start launched at 1024 / 8: the lead's own 256 / 2 may still start
    # on its own; the launch's limits, and more memory at them, not
    assert loop._skip(lead.values) is None
    assert loop._skip({**lead.values, **launch})[0] == "like_crashed"


def test_a_queued_first_configuration_is_never_proposed_alongside():
    study = _study(first=[{"kv_cache_memory_bytes": ROOMY, "max_num_batched_tokens": 256, "max_num_seqs": 2},
                          {"kv_cache_memory_bytes": SMALL, "max_num_batched_tokens": 512, "max_num_seqs": 4}])
    loop = cs.SearchLoop(study.search, "s", optuna.storages.InMemoryStorage(), lambda v: [])
    lead = loop.propose()
    assert lead.values["kv_cache_memory_bytes"] == ROOMY
    # the second first: config waits in the queue, and no sampler may hand it to ROOMY's start
    assert loop.propose_alongside(lead, {"kv_cache_memory_bytes": ROOMY}) is None
    assert loop.propose().values == study.search.first[1]


def test_the_plan_says_how_many_trials_a_start_serves_and_why_none_share():
    study = _study()
    assert search_live_label(study, "cpu").startswith("live knobs: a start serves up to 3 trials, which differ "
                                                      "only in max_num_batched_tokens, max_num_seqs")
    assert "kv_cache_memory_bytes take a start of their own" in search_live_label(study, "cpu")
    assert "off by default on the gpu engine" in search_live_label(study, "gpu")
    assert "search.live_batch: 1" in search_live_label(_study(live_batch=1), "cpu")
    only_restart = study_from_dict({**study.model_dump(mode="json"),
                                    "search": {**study.search.model_dump(mode="json"),
                                               "space": {"kv_cache_memory_bytes": [SMALL, ROOMY]}, "first": []}})
    assert "no knob of the space changes live" in search_live_label(only_restart, "cpu")


def test_the_wall_time_estimate_counts_the_starts_a_shared_search_saves():
    """Nine trials three a start: three trial start-ups, not nine; what is measured stays."""
    from vllm_study.define.timing import CPU_START_S, estimate_minutes
    shared, alone = _study(trials=9), _study(trials=9, live_batch=1)
    saved = estimate_minutes(alone, "cpu", 1) - estimate_minutes(shared, "cpu", 1)
    assert saved * 60 == pytest.approx(6 * CPU_START_S, rel=1e-6)
    assert estimate_minutes(shared, "gpu", 1, "NVIDIA H200") == estimate_minutes(
        _study(trials=9, live_batch=1), "gpu", 1, "NVIDIA H200")  # live knobs off by default on a GPU
    own = _study(trials=9)  # its own --scheduler-cls: no start shared, none saved (search_sharing decides both)
    args = [*own.server.extra_cli_args, "--scheduler-cls", "x.S"]
    own = study_from_dict({**own.model_dump(mode="json"),
                           "server": {**own.server.model_dump(mode="json"), "extra_cli_args": args}})
    assert estimate_minutes(own, "cpu", 1) == estimate_minutes(alone, "cpu", 1)
