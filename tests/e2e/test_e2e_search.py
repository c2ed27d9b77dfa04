"""A live search on the CPU engine, end to end: real papermill, servers of the fake engine
(the search loop and its crash rule are the kit's; the fake refuses a KV cache too small
for one request in vLLM's words). Its first trial is a configuration whose KV cache
cannot hold one request (it must crash): the crash is a failed trial with vLLM's reason,
nothing like it starts again, the budget counts server starts, and the best trial and
vLLM's defaults get their fresh confirmation starts; the report and export decide on
those."""
from __future__ import annotations

import subprocess
import sys

import optuna
import pytest

from e2e_support import REPO, fake_engine_study, kv_bytes, sweep, tiny, write
from vllm_study.search import config_search as cs
from vllm_study.define.grid import DEFAULTS_POINT
from vllm_study.report.report import Run
from vllm_study.report.answer import answer_text
from vllm_study.records.results import RunFolder

SMALL, ROOMY = kv_bytes(512), kv_bytes(16384)  # 512 tokens cannot hold a 2,048-token request
STUDY = fake_engine_study(tiny(grid=None, rounds=1, search={
    "space": {"kv_cache_memory_bytes": [SMALL, ROOMY], "max_num_batched_tokens": [256, 1024]},
    "first": [{"kv_cache_memory_bytes": SMALL, "max_num_batched_tokens": 256}],
    "objective": "output_throughput", "trials": 3, "top_k": 1, "confirm_starts": 1, "seed": 3,
    "live_batch": 1}))  # a start a trial here (test_e2e_search_live_batch.py shares them)
STUDY["engine_args"] = {k: v for k, v in STUDY["engine_args"].items() if k != "kv_cache_memory_bytes"}


@pytest.mark.e2e
@pytest.mark.fake_engine
def test_a_live_search_records_its_crash_and_confirms_its_best(tmp_path):
    results = tmp_path / "results"
    r = sweep(write(tmp_path, STUDY), "--results", results)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    (path,) = results.iterdir()
    run = RunFolder(path)
    study = optuna.load_study(study_name="e2e", storage=optuna.storages.JournalStorage(
        optuna.storages.journal.JournalFileBackend(str(path / cs.JOURNAL))))
    started = [t for t in study.trials if "point" in t.user_attrs]
    assert len(started) == 3  # the budget counts server starts
    crash = started[0]
    assert crash.params == {"kv_cache_memory_bytes": SMALL, "max_num_batched_tokens": 256}
    assert crash.state == optuna.trial.TrialState.FAIL
    assert "max_model_len too large for the KV cache" in crash.user_attrs["failed"]
    assert run.point(crash.user_attrs["point"]).start(1).status == "failed"
    # nothing like it (as small a KV cache, the rest equal) started again
    for t in started[1:]:
        assert not (t.params["kv_cache_memory_bytes"] <= SMALL and t.params["max_num_batched_tokens"] == 256)
    skipped = [t for t in study.trials if "like_crashed" in t.user_attrs]
    assert all(t.params == crash.params for t in skipped)
    # confirmation: one fresh start of the best measured trial, one of vLLM's defaults
    order = run.manifest().order
    confirm = [u for u in order if u.block > cs.TRIAL_BLOCK]
    measured = [t for t in started if t.state == optuna.trial.TrialState.COMPLETE]
    best = max(measured, key=lambda t: t.value).user_attrs["point"]
    assert sorted(u.point for u in confirm) == sorted([best, DEFAULTS_POINT])
    assert all(run.point(u.point).start(u.start).status == "ok" for u in confirm)
    assert run.point(best).summary().starts_planned == 2  # its trial and its confirmation
    # the report decides on the confirmation starts and says what the search did
    rep = Run.load(run)
    assert set(rep.rounds["block"]) == {cs.TRIAL_BLOCK + 1}
    text = answer_text(rep)
    assert "A search over kv_cache_memory_bytes, max_num_batched_tokens" in text and "1 failed" in text
    assert DEFAULTS_POINT in text
    assert (path / "report.html").exists() and (path / "figures" / "search.png").exists()
    ex = subprocess.run([sys.executable, "-m", "vllm_study", "export", str(path), "--best", "--out",
                         str(tmp_path / "x"), "--force"], cwd=REPO, capture_output=True, text=True, timeout=300)
    # the fake engine served it: nothing here is vLLM's to export (a real run's export:
    # test_e2e_models_and_export.py)
    assert ex.returncode != 0 and "not vLLM" in ex.stderr, ex.stderr[-2000:]
    assert not (tmp_path / "x").exists() or not any((tmp_path / "x").iterdir())
