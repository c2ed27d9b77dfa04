"""Prefix Reuse Budget plugin without a server: the admission rule, parameter
validation, the counters file and its deltas, and the plugin inside vLLM's real
scheduler, driven in-process (requests added, schedule() called, no model run)."""
from __future__ import annotations

import json
import time

import numpy as np
import pytest

from scheduler_support import config_only_model
from vllm_study.scheduler_plugin import (Decision, Params, StatsRecorder, decide, params_from_config,
                                      passes_alone, percentile, read_stats, stats_delta)

R, MAXD = 0.8, 500.0


# -- the rule ---------------------------------------------------------------------------
@pytest.mark.parametrize("share,waited,others,expected", [
    (0.9, 0, True, Decision.RATIO),      # above the ratio: admitted, whatever else waits
    (0.8, 0, True, Decision.RATIO),      # exactly at the ratio counts as enough
    (1.0, 0, False, Decision.RATIO),
    (0.79, 0, True, Decision.DEFER),     # below, young, others could use the budget
    (0.0, 499.9, True, Decision.DEFER),
    (0.0, 500.0, True, Decision.AGE),    # the age bound is inclusive
    (0.5, 10_000, True, Decision.AGE),
    (0.0, 0, False, Decision.IDLE),      # nothing else eligible: never leave the budget unused
    (0.79, 499, False, Decision.IDLE),
])
def test_decide_cases(share, waited, others, expected):
    d = decide(share, waited, others, R, MAXD)
    assert d is expected
    assert d.admits == (expected is not Decision.DEFER)


@pytest.mark.parametrize("share", [0.0, 0.01, 0.5, 0.999, 1.0])
@pytest.mark.parametrize("waited", [0.0, 1.0, 1e6])
def test_ratio_zero_never_defers(share, waited):
    assert decide(share, waited, True, 0.0, MAXD) is Decision.RATIO


def test_max_defer_zero_never_holds_a_request():
    assert decide(0.0, 0.0, True, R, 0.0) is Decision.AGE


def test_passes_alone_ignores_the_idle_rule():
    assert passes_alone(0.9, 0, R, MAXD) and passes_alone(0.1, 600, R, MAXD)
    assert not passes_alone(0.1, 10, R, MAXD)  # would pass by the idle rule only


# -- parameters -------------------------------------------------------------------------
def test_params_defaults_and_values():
    assert params_from_config({}) == Params(0.8, 500.0, None)
    assert params_from_config(None) == Params()
    assert params_from_config({"other_plugin": {"x": 1}}) == Params()
    p = params_from_config({"prefix_budget": {"min_reuse_ratio": 0, "max_defer_ms": 0,
                                              "stats_path": "/tmp/x.json"}})
    assert p == Params(0.0, 0.0, "/tmp/x.json")
    assert isinstance(p.min_reuse_ratio, float)


@pytest.mark.parametrize("ratio", [-0.1, 1.01, 80])
def test_ratio_outside_unit_interval_is_a_clear_error(ratio):
    with pytest.raises(ValueError) as e:
        params_from_config({"prefix_budget": {"min_reuse_ratio": ratio}})
    msg = str(e.value)
    assert "prefix_budget.min_reuse_ratio" in msg and "[0, 1]" in msg
    assert "--additional-config" in msg and '"min_reuse_ratio": 0.8' in msg


def test_negative_max_defer_is_a_clear_error():
    with pytest.raises(ValueError) as e:
        params_from_config({"prefix_budget": {"max_defer_ms": -1}})
    msg = str(e.value)
    assert "prefix_budget.max_defer_ms" in msg and ">= 0" in msg and "got -1" in msg
    assert "--additional-config" in msg and '"max_defer_ms": 500' in msg


@pytest.mark.parametrize("section,key", [
    ({"min_reuse_ratio": "0.8"}, "min_reuse_ratio"),   # a string, not a number
    ({"min_reuse_ratio": True}, "min_reuse_ratio"),    # a bool is not a ratio
    ({"max_defer_ms": float("nan")}, "max_defer_ms"),
    ({"max_defer_ms": None}, "max_defer_ms"),
    ({"stats_path": 3}, "stats_path"),
    ({"stats_path": ""}, "stats_path"),
])
def test_wrong_types_name_the_key(section, key):
    with pytest.raises(ValueError, match=f"prefix_budget.{key}"):
        params_from_config({"prefix_budget": section})


def test_unknown_keys_and_bad_sections_are_rejected():
    with pytest.raises(ValueError, match=r"prefix_budget\.min_ratio.*known keys are max_defer_ms, "
                                         r"min_reuse_ratio, stats_path"):
        params_from_config({"prefix_budget": {"min_ratio": 0.5}})
    with pytest.raises(ValueError, match="must be a JSON object"):
        params_from_config({"prefix_budget": 0.8})
    with pytest.raises(ValueError, match="additional_config must be a JSON object"):
        params_from_config("prefix_budget")


# -- counters and deltas ----------------------------------------------------------------
def _snap(run="r1", counters=None, defer=(), steps=None, waits=None, t=0.0):
    base = {k: 0 for k in ("deferred", "admitted_by_ratio", "admitted_by_age", "admitted_idle",
                           "admitted_idle_undeferred", "aborted_while_deferred", "lookups", "steps")}
    return {"schema": 1, "run_id": run, "updated_at": t, "counters": {**base, **(counters or {})},
            "defer_ms": list(defer), "release_step_ms": list(steps or [1.0] * len(defer)),
            "admit_wait_ms": list(waits or [0.0] * len(defer))}


def test_percentile_matches_numpy_linear():
    xs = [5.0, 1.0, 9.0, 3.0, 7.0, 100.0, 2.5]
    for q in (0, 1, 25, 50, 90, 99, 100):
        assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))
    assert percentile([], 50) is None
    assert percentile([4.0], 99) == 4.0


def test_stats_delta_known_answer():
    before = _snap(counters={"deferred": 3, "admitted_by_age": 1, "admitted_idle": 2, "steps": 10},
                   defer=[500.0, 50.0, 70.0], t=100.0)
    after = _snap(counters={"deferred": 8, "admitted_by_age": 3, "admitted_idle": 4,
                            "admitted_by_ratio": 1, "aborted_while_deferred": 1, "steps": 60},
                  defer=[500.0, 50.0, 70.0, 10.0, 20.0, 30.0, 40.0, 100.0],
                  steps=[1, 1, 1, 5.0, 5.0, 5.0, 5.0, 30.0], waits=[0, 0, 0, 0, 0, 0, 12.5, 0],
                  t=112.5)
    d = stats_delta(before, after)
    assert (d["deferred"], d["admitted_by_age"], d["admitted_idle"]) == (5, 2, 2)
    assert (d["admitted_by_ratio"], d["aborted_while_deferred"], d["steps"]) == (1, 1, 50)
    assert d["n_defer_samples"] == 5 and d["defer_ms"] == [10.0, 20.0, 30.0, 40.0, 100.0]
    assert d["defer_ms_p50"] == 30.0
    # rank (5-1)*0.99 = 3.96: 40 + 0.96 * (100 - 40)
    assert d["defer_ms_p99"] == pytest.approx(97.6)
    assert d["defer_ms_max"] == 100.0
    assert d["defer_ms_minus_step_max"] == 70.0      # 100 - 30
    assert d["release_step_ms_max"] == 30.0 and d["admit_wait_ms_max"] == 12.5
    assert d["seconds"] == 12.5


def test_stats_delta_without_new_deferrals():
    s = _snap(counters={"deferred": 2}, defer=[1.0, 2.0])
    d = stats_delta(s, s)
    assert d["deferred"] == 0 and d["n_defer_samples"] == 0
    assert d["defer_ms_p50"] is None and d["defer_ms_p99"] is None and d["defer_ms_max"] is None


def test_stats_delta_refuses_mixed_runs_and_swapped_snapshots():
    with pytest.raises(ValueError, match="different engine runs"):
        stats_delta(_snap(run="a"), _snap(run="b"))
    with pytest.raises(ValueError, match="swapped"):
        stats_delta(_snap(defer=[1.0, 2.0]), _snap(defer=[1.0]))


def test_recorder_writes_atomically_and_in_the_background(tmp_path):
    path = tmp_path / "sub" / "pb.json"
    rec = StatsRecorder(path, {"base_class": "Scheduler"}, interval_s=0.05)
    try:
        first = read_stats(path)  # written at once: a client can snapshot before any load
        assert first["counters"]["deferred"] == 0 and first["base_class"] == "Scheduler"
        rec.add("deferred")
        rec.record_admission("age", defer_ms=510.0, release_step_ms=20.0, admit_wait_ms=0.0)
        deadline = time.monotonic() + 5
        while read_stats(path)["counters"]["deferred"] == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        mid = read_stats(path)
        assert mid["counters"]["deferred"] == 1 and mid["counters"]["admitted_by_age"] == 1
        assert mid["defer_ms"] == [510.0] and mid["run_id"] == first["run_id"]
    finally:
        rec.close()
    rec2_before = read_stats(path)
    assert [p.name for p in path.parent.iterdir()] == ["pb.json"]  # no tmp file left over
    assert stats_delta(first, rec2_before)["defer_ms_p50"] == 510.0


def test_recorder_final_write_at_close(tmp_path):
    path = tmp_path / "pb.json"
    rec = StatsRecorder(path, {}, interval_s=3600)  # the thread would not write again
    rec.record_admission("idle", 12.0, 3.0, 0.0)
    rec.close()
    assert read_stats(path)["counters"]["admitted_idle"] == 1


def test_read_stats_explains_a_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="--scheduler-cls vllm_study.scheduler_plugin"):
        read_stats(tmp_path / "none.json")
    (tmp_path / "old.json").write_text(json.dumps({"schema": 99}))
    with pytest.raises(ValueError, match="schema 99"):
        read_stats(tmp_path / "old.json")


# -- inside vLLM's real scheduler (in-process, no model, no server) ---------------------
BS = 16
PREFIX = list(range(1000, 1064))  # 64 tokens: 4 full blocks


@pytest.fixture(scope="module")
def vllm_parts(tmp_path_factory):
    """Configs for a real vLLM scheduler over a 2-layer Qwen2 config (nothing loaded)."""
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    model, hasher = config_only_model(tmp_path_factory.mktemp("model"), BS)

    def kv_config(num_blocks):
        return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[
            KVCacheGroupSpec(["layer"], FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=1,
                                                          dtype=torch.float32))])
    return model, kv_config, hasher


def make_scheduler(vllm_parts, pb: dict | None, *, async_scheduling: bool | None = None,
                   max_num_seqs: int = 64, policy: str = "fcfs", num_blocks: int = 400, cls=None):
    from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.v1.structured_output import StructuredOutputManager

    from vllm_study.scheduler_plugin import PrefixBudgetScheduler

    model, kv_config, _ = vllm_parts
    vc = VllmConfig(
        model_config=ModelConfig(model=model, dtype="float32", seed=0, skip_tokenizer_init=True,
                                 max_model_len=1024),
        scheduler_config=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=1024,
                                         max_model_len=1024, is_encoder_decoder=False, policy=policy),
        cache_config=CacheConfig(block_size=BS, enable_prefix_caching=True),
        additional_config={} if pb is None else {"prefix_budget": pb})
    if async_scheduling is not None:
        # the CPU platform forces async scheduling off; the GPU default is on
        vc.scheduler_config.async_scheduling = async_scheduling
    vc.cache_config.num_gpu_blocks = num_blocks
    return (cls or PrefixBudgetScheduler)(
        vllm_config=vc, kv_cache_config=kv_config(num_blocks),
        structured_output_manager=StructuredOutputManager(vc), log_stats=True, block_size=BS)


def _req(vllm_parts, rid, ids, priority=0):
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request
    return Request(rid, list(ids), SamplingParams(max_tokens=4), None, priority=priority,
                   block_hasher=vllm_parts[2])


def hot(vllm_parts, rid, k):
    return _req(vllm_parts, rid, PREFIX + list(range(5000 + 16 * k, 5000 + 16 * k + 8)))  # 64/72 cached


def cold(vllm_parts, rid, k):
    return _req(vllm_parts, rid, range(20000 + 100 * k, 20000 + 100 * k + 72))


def admitted(out):
    return [r.req_id for r in out.scheduled_new_reqs]


def test_factory_picks_the_base_class_from_the_engine_config(vllm_parts, tmp_path):
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler

    s = make_scheduler(vllm_parts, {"stats_path": str(tmp_path / "a.json")}, async_scheduling=True)
    assert isinstance(s, AsyncScheduler) and type(s).__name__ == "PrefixBudgetAsyncScheduler"
    s.shutdown()
    assert read_stats(tmp_path / "a.json")["base_class"] == "AsyncScheduler"
    s = make_scheduler(vllm_parts, {"stats_path": str(tmp_path / "s.json")}, async_scheduling=False)
    assert isinstance(s, Scheduler) and not isinstance(s, AsyncScheduler)
    s.shutdown()
    assert read_stats(tmp_path / "s.json")["base_class"] == "Scheduler"
    # vLLM's own checks on the configuration still run: bad parameters stop the engine
    with pytest.raises(ValueError, match="prefix_budget.min_reuse_ratio"):
        make_scheduler(vllm_parts, {"min_reuse_ratio": 2})


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_cold_requests_wait_while_cached_ones_go_first(vllm_parts, async_scheduling):
    s = make_scheduler(vllm_parts, {"min_reuse_ratio": 0.8, "max_defer_ms": 60_000},
                       async_scheduling=async_scheduling)
    s.add_request(hot(vllm_parts, "A", 0))  # alone, nothing cached yet: the idle rule lets it in
    assert admitted(s.schedule()) == ["A"]
    for r in (cold(vllm_parts, "C1", 1), hot(vllm_parts, "B1", 1), cold(vllm_parts, "C2", 2),
              hot(vllm_parts, "B2", 2)):
        s.add_request(r)
    assert admitted(s.schedule()) == ["B1", "B2"]           # 64/72 = 0.89 cached: pass
    assert [r.request_id for r in s.waiting] == ["C1", "C2"]  # held, still queued, in order
    assert admitted(s.schedule()) == ["C1", "C2"]           # nothing else waits: idle rule
    snap = s._pb_stats.snapshot()
    c = snap["counters"]
    assert (c["deferred"], c["admitted_idle"], c["admitted_by_age"]) == (2, 2, 0)
    assert c["admitted_idle_undeferred"] == 1              # A
    assert len(snap["defer_ms"]) == 2 and all(0 <= x < 60_000 for x in snap["defer_ms"])
    assert snap["admit_wait_ms"] == [0.0, 0.0]


def test_age_bound_releases_a_request_even_while_cached_ones_keep_coming(vllm_parts):
    s = make_scheduler(vllm_parts, {"min_reuse_ratio": 0.8, "max_defer_ms": 40})
    s.add_request(hot(vllm_parts, "A", 0))
    s.schedule()
    s.add_request(cold(vllm_parts, "C", 0))
    t0 = time.monotonic()
    for k in range(1, 400):
        s.add_request(hot(vllm_parts, f"H{k}", k))  # always someone eligible: no idle rule
        ids = admitted(s.schedule())
        if "C" in ids:
            break
        assert ids == [f"H{k}"]
        time.sleep(0.004)
    assert "C" in ids, "the age bound never released the cold request"
    assert time.monotonic() - t0 >= 0.040
    snap = s._pb_stats.snapshot()
    assert snap["counters"]["admitted_by_age"] == 1 and snap["counters"]["deferred"] == 1
    (defer,), (step,) = snap["defer_ms"], snap["release_step_ms"]
    assert 40 <= defer <= 40 + step + 0.01  # released by the first step past the bound


def test_waiting_order_survives_a_step_that_admits_nobody(vllm_parts):
    s = make_scheduler(vllm_parts, {"min_reuse_ratio": 0.8, "max_defer_ms": 60_000}, max_num_seqs=1)
    s.add_request(hot(vllm_parts, "A", 0))
    s.schedule()                                   # A occupies the only running slot
    order = ["C1", "H1", "C2", "H2", "C3"]
    for rid in order:
        s.add_request((cold if rid[0] == "C" else hot)(vllm_parts, rid, int(rid[1])))
    assert admitted(s.schedule()) == []
    assert [r.request_id for r in s.waiting] == order
    assert s._pb_stats.counters["deferred"] == 3


def test_priority_policy_gets_held_requests_back(vllm_parts):
    s = make_scheduler(vllm_parts, {"min_reuse_ratio": 0.8, "max_defer_ms": 60_000}, policy="priority")
    s.add_request(hot(vllm_parts, "A", 0))
    s.schedule()
    s.add_request(cold(vllm_parts, "C", 1))
    s.add_request(hot(vllm_parts, "B", 1))
    assert admitted(s.schedule()) == ["B"]
    assert [r.request_id for r in s.waiting] == ["C"]
    assert admitted(s.schedule()) == ["C"]


def test_an_aborted_deferred_request_is_counted_and_forgotten(vllm_parts):
    from vllm.v1.request import RequestStatus
    s = make_scheduler(vllm_parts, {"min_reuse_ratio": 0.8, "max_defer_ms": 60_000})
    s.add_request(hot(vllm_parts, "A", 0))
    s.schedule()
    s.add_request(cold(vllm_parts, "C", 1))
    s.add_request(hot(vllm_parts, "B", 1))
    s.schedule()
    s.finish_requests("C", RequestStatus.FINISHED_ABORTED)
    s.schedule()
    assert s._pb_stats.counters["aborted_while_deferred"] == 1 and not s._pb_pending


def test_ratio_zero_schedules_exactly_like_vllm(vllm_parts):
    """With min_reuse_ratio 0 the plugin must be a no-op: same admissions, step by step,
    as vLLM's own scheduler on the same requests."""
    from vllm.v1.core.sched.scheduler import Scheduler
    plugin = make_scheduler(vllm_parts, {"min_reuse_ratio": 0.0}, max_num_seqs=3)
    plain = make_scheduler(vllm_parts, None, max_num_seqs=3, cls=Scheduler)
    for s in (plugin, plain):
        s.add_request(hot(vllm_parts, "A", 0))
    steps = []
    for s in (plugin, plain):
        seq = [admitted(s.schedule())]
        for k in range(1, 4):
            s.add_request(cold(vllm_parts, f"C{k}", k))
            s.add_request(hot(vllm_parts, f"H{k}", k))
            seq.append(admitted(s.schedule()))
        steps.append(seq)
    assert steps[0] == steps[1]
    assert steps[0][1] == ["C1", "H1"]  # FCFS: the cold one first, as vLLM does
    assert plugin._pb_stats.counters["deferred"] == 0


def test_plugin_lookups_stay_out_of_vllms_prefix_cache_counters(vllm_parts):
    """vLLM 0.26 counts a query in every get_computed_blocks call; the plugin's own
    lookups must not inflate vllm:prefix_cache_queries/hits (checked on 0.32 here)."""
    s = make_scheduler(vllm_parts, {"min_reuse_ratio": 0.8, "max_defer_ms": 60_000})
    s.add_request(hot(vllm_parts, "A", 0))
    s.schedule()
    for r in (cold(vllm_parts, "C1", 1), hot(vllm_parts, "B1", 1), cold(vllm_parts, "C2", 2)):
        s.add_request(r)
    s.schedule()
    s.schedule()
    assert s._pb_stats.counters["lookups"] >= 6  # A, then C1, B1, C2, then C1, C2
    stats = s.kv_cache_manager.make_prefix_cache_stats()
    assert stats.requests == 4 and stats.queries == 4 * 72  # once per admitted request
    assert stats.hits == 64                                 # B1's cached prefix
