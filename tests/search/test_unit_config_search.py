"""The search loop (config_search.py) on synthetic objectives: crashes are failed trials
that are never tried again (nor anything like them), the SLO reaches the sampler as a
constraint, measured configurations are not started twice, a journal resumes."""
from __future__ import annotations

import optuna
import pandas as pd
import pytest

from vllm_study.search import config_search as cs
from vllm_study.define.schema import StudyError
from vllm_study.define.study_file import study_from_dict
from vllm_study.search.search_report import best_so_far
from paths import REPO

SPACE = {"max_num_batched_tokens": [256, 512, 1024, 2048], "max_num_seqs": [8, 32, 128],
         "gpu_memory_utilization": {"float": [0.80, 0.95], "step": 0.05}}


def _study(**search):
    return study_from_dict({"name": "s", "slo": {"ttft_p90_ms": 1000},
                            "search": {"space": SPACE, "objective": "goodput", "trials": 12, **search}})


def _loop(study, check=lambda v: [], storage=None):
    return cs.SearchLoop(study.search, "s", storage or optuna.storages.InMemoryStorage(), check, )


def _goodput(v):
    return v["max_num_batched_tokens"] / 256 + v["max_num_seqs"] / 32


def test_a_crash_is_a_failed_trial_and_nothing_like_it_starts_again():
    study = _study(trials=20, first=[{"max_num_batched_tokens": 1024, "max_num_seqs": 32,
                                      "gpu_memory_utilization": 0.85}])

    def measure(v):
        if v["gpu_memory_utilization"] >= 0.85 and v["max_num_batched_tokens"] == 1024 and v["max_num_seqs"] == 32:
            return cs.TrialOutcome(failed="server exit code 1 | torch.OutOfMemoryError: CUDA out of memory")
        return cs.TrialOutcome(_goodput(v), {"ttft_p90_ms": -0.5})
    loop = cs.run_offline(_loop(study), measure)
    started = loop.started()
    assert len(started) == 20
    failed = [t for t in started if t.state == optuna.trial.TrialState.FAIL]
    assert len(failed) == 1 and "out of memory" in failed[0].user_attrs["failed"]
    crashed = failed[0].params
    for t in started:
        p = t.params
        # out of memory: nothing that equals it but asks at least as much memory starts again
        like_it = (p["max_num_batched_tokens"] == 1024 and p["max_num_seqs"] == 32
                   and p["gpu_memory_utilization"] >= crashed["gpu_memory_utilization"])
        assert t is failed[0] or not like_it, p
    skipped = [t for t in loop.trials() if "like_crashed" in t.user_attrs]
    assert all("like trial 0 (out of memory failure" in t.user_attrs["like_crashed"] for t in skipped)


def test_like_follows_the_short_resource():
    oom = cs.failure_class("RuntimeError: CUDA out of memory. Tried to allocate")[1]
    base = {"max_num_batched_tokens": 1024, "gpu_memory_utilization": 0.9, "enable_prefix_caching": True}
    assert cs.like(base, {**base, "gpu_memory_utilization": 0.95}, oom)
    assert not cs.like(base, {**base, "gpu_memory_utilization": 0.85}, oom)
    assert not cs.like(base, {**base, "enable_prefix_caching": False}, oom)
    kv = cs.failure_class("ValueError: No available memory for the cache blocks. Try increasing "
                          "`gpu_memory_utilization`")
    assert kv[0] == "KV cache too small"
    assert cs.like(base, {**base, "gpu_memory_utilization": 0.8}, kv[1])
    assert not cs.like(base, {**base, "gpu_memory_utilization": 0.95}, kv[1])
    other = cs.failure_class("server exit code 2 | error: unrecognized arguments")[1]
    assert other == {} and cs.like(base, dict(base), other)
    assert not cs.like(base, {**base, "max_num_batched_tokens": 2048}, other)


def test_rejected_configurations_never_start_and_say_why():
    study = _study(trials=8, when=["max_num_seqs < 128"])
    loop = cs.run_offline(_loop(study), lambda v: cs.TrialOutcome(_goodput(v), {"ttft_p90_ms": -1.0}))
    assert all(t.params["max_num_seqs"] < 128 for t in loop.started())
    rejected = [t for t in loop.trials() if "rejected" in t.user_attrs]
    assert rejected and all("breaks search.when: max_num_seqs < 128 (max_num_seqs=128" in t.user_attrs["rejected"]
                            for t in rejected)
    assert all(t.state == optuna.trial.TrialState.FAIL for t in rejected)


def test_measured_configurations_are_told_their_value_not_started_again():
    study = study_from_dict({"name": "s", "search": {"space": {"max_num_seqs": [8, 32]}, "objective": "goodput",
                                                      "trials": 2, "startup_trials": 2}})
    calls = []

    def measure(v):
        calls.append(v["max_num_seqs"])
        return cs.TrialOutcome(float(v["max_num_seqs"]))
    loop = cs.run_offline(_loop(study), measure)
    assert sorted(calls) == [8, 32]  # two trials, two different configurations
    repeats = [t for t in loop.trials() if "repeat_of" in t.user_attrs]
    assert all(t.value == float(t.params["max_num_seqs"]) for t in repeats)


def test_the_slo_is_a_constraint_and_the_top_are_feasible_only():
    study = _study(trials=12)
    # the higher max_num_seqs, the more goodput, but 128 misses the SLO
    def measure(v):
        return cs.TrialOutcome(_goodput(v), {"ttft_p90_ms": 0.3 if v["max_num_seqs"] == 128 else -0.2})
    loop = cs.run_offline(_loop(study), measure)
    frozen = {t.number: t for t in loop.trials()}
    top = loop.feasible()
    assert top and all(frozen[t.number].params["max_num_seqs"] != 128 for t in top)
    assert all(b.value <= a.value for a, b in zip(top, top[1:]))
    assert any(t.constraints == {"ttft_p90_ms": 0.3} for t in loop.trials())  # what the sampler was told


def test_a_journal_resumes_the_search(tmp_path):
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend
    study = _study(trials=6)

    def storage():
        return JournalStorage(JournalFileBackend(str(tmp_path / cs.JOURNAL)))
    first = _loop(study, storage=storage())
    for _ in range(3):
        p = first.propose()
        first.record(p.number, cs.TrialOutcome(_goodput(p.values), {"ttft_p90_ms": -1.0}))
    pending = first.propose()  # started, then the machine went away
    again = _loop(study, storage=storage())
    assert len(again.started()) == 4
    assert again.running_points() == {cs.point_id(pending.values): pending.number}
    again.record(pending.number, cs.TrialOutcome(1.0, {"ttft_p90_ms": -1.0}))
    cs.run_offline(again, lambda v: cs.TrialOutcome(_goodput(v), {"ttft_p90_ms": -1.0}))
    assert len(again.started()) == 6


@pytest.mark.parametrize("search, message", [
    ({"space": {"max_num_batched_tokns": [1, 2]}}, "did you mean 'max_num_batched_tokens'"),
    ({"space": {"max_num_seqs": [8]}}, "two or more distinct values"),
    ({"space": {"max_num_seqs": {"int": [64, 8]}}}, "needs low < high"),
    ({"space": {"max_num_seqs": [8, 16]}, "when": ["max_num_seqs << 3"]}, "not a comparison"),
    ({"space": {"max_num_seqs": [8, 16]}, "first": [{"block_size": 16}]}, "not in search.space"),
    ({"space": {"max_num_seqs": [8, 16]}, "objective": "requests"}, "no better direction"),
    ({"space": {"max_num_seqs": [8, 16]}}, "search.objective is needed"),
])
def test_bad_search_definitions_are_refused_with_the_fix(search, message):
    with pytest.raises(StudyError, match=message):
        study_from_dict({"name": "s", "search": search})


def test_a_search_replaces_the_grid_and_the_replicates():
    with pytest.raises(StudyError, match="drops its grid with `grid: null`"):
        study_from_dict({"name": "s", "grid": {"max_num_seqs": [1, 2]},
                         "search": {"space": {"max_num_seqs": [8, 16]}, "objective": "goodput"}})
    with pytest.raises(StudyError, match="confirm_starts"):
        study_from_dict({"name": "s", "replicates": 2, "search": {"space": {"max_num_seqs": [8, 16]},
                                                                  "objective": "goodput"}})
    s = study_from_dict({"name": "s", "slo": {"ttft_p90_ms": 500},
                         "capacity": {"over": "concurrency", "lo": 1, "hi": 8},
                         "search": {"space": {"max_num_seqs": [8, 16]}}})
    assert s.search.objective == "capacity_rps"


def test_best_so_far_holds_across_trials_without_a_feasible_value():
    vals = pd.Series([3.1, 5.3, 5.3, float("nan"), 5.3, 6.1, 6.1, 5.3])  # trial 4 missed the SLO
    assert best_so_far(vals, "maximize").tolist() == [3.1, 5.3, 5.3, 5.3, 5.3, 6.1, 6.1, 6.1]
    assert best_so_far(pd.Series([float("nan"), 9.0, float("nan"), 4.0]), "minimize").tolist()[1:] == [9.0, 9.0, 4.0]


def _oracle(run) -> tuple[int, str]:
    """benchmarks/search_oracle.py on a run, as a user runs it: (exit status, stderr)."""
    import subprocess
    import sys
    script = REPO / "benchmarks" / "search_oracle.py"
    done = subprocess.run([sys.executable, str(script), str(run.path), "--seeds", "2"], capture_output=True, text=True)
    return done.returncode, done.stderr


def test_the_search_oracle_explains_a_grid_it_cannot_search(tmp_path):
    from synthetic_run import make_run
    # no `slo:`, so no goodput: the message says why and names --objective
    run = make_run(tmp_path / "a", {p: {"output_throughput": 500.0} for p in
                                    ("mbt=256__kv=16MiB", "mbt=256__kv=128MiB", "mbt=512__kv=16MiB",
                                     "mbt=512__kv=128MiB")})
    rc, err = _oracle(run)
    assert rc == 2 and "Traceback" not in err  # a usage error: the kit's exit status 2
    assert "no goodput measured (goodput counts the requests within the SLO, and the study sets no `slo:`); " \
           "name a metric the grid measured with --objective" in err
    # three points give one trial (a third of them): refused before any search, without a traceback
    small = make_run(tmp_path / "b", {p: {"goodput": 5.0} for p in ("mbt=256", "mbt=512", "mbt=1024")},
                     study_over={"grid": {"max_num_batched_tokens": [256, 512, 1024]}, "slo": {"ttft_p90_ms": 900}})
    rc, err = _oracle(small)
    assert rc == 2 and "Traceback" not in err  # a usage error: the kit's exit status 2
    assert "the grid's 3 points give a search 1 trial(s) (a third of them), which is below the 2 trials a search " \
           "needs; pass --trials 2 or more" in err


def test_the_search_answer_is_the_best_that_meets_the_slo_not_the_defaults_that_miss_it():
    """vLLM's defaults are confirmed whatever their SLO: more tokens/s at 5 s TTFT P90 is
    no answer under a 500 ms bound; without an SLO they compete on the objective alone."""
    from types import SimpleNamespace

    import pandas as pd

    from vllm_study.analysis import decision
    from vllm_study.search import search_report
    rows = [("vllm-defaults", "output_throughput", 900, 880, 920), ("mbt=512", "output_throughput", 700, 690, 710),
            ("mbt=1024", "output_throughput", 950, 940, 960),
            ("vllm-defaults", "ttft_p90_ms", 5000, 4900, 5100), ("mbt=512", "ttft_p90_ms", 300, 280, 320),
            ("mbt=1024", "ttft_p90_ms", 400, 380, 420)]
    iv = pd.DataFrame(rows, columns=["point", "metric", "value", "ci_low", "ci_high"])
    r = SimpleNamespace(search=SimpleNamespace(objective="output_throughput", goal="maximize"), intervals=iv,
                        summaries=[SimpleNamespace(point=p, status="ok" if p != "mbt=1024" else "partial")
                                   for p in ("vllm-defaults", "mbt=512", "mbt=1024")],
                        slo={"ttft_p90_ms": 500})
    r.slo_verdicts = lambda: decision.slo_table(iv, r.slo, ["mbt=1024"])
    assert search_report.best(r) == "mbt=512"      # mbt=1024's confirmation did not complete
    r.slo = {"ttft_p90_ms": 200}
    assert search_report.best(r) is None
    r.slo = {}
    assert search_report.best(r) == "vllm-defaults"
