"""Step records from inside vLLM's real scheduler (in-process, no model, no server): the
kit's schedulers driven by schedule() / update_from_output() as EngineCore drives them,
the rows read back from the raw file."""
import numpy as np
import pytest

from scheduler_support import config_only_model
from vllm_study.scheduler_plugin import StepRecordsScheduler, scheduler_class, step_records, steps

BS = 16
PREFIX = list(range(1000, 1064))  # 64 tokens: 4 full blocks


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    """A 2-layer Qwen2 config folder (nothing loaded) and a block hasher."""
    return config_only_model(tmp_path_factory.mktemp("model"), BS)


def make(parts, cls=StepRecordsScheduler, *, async_scheduling=False, mbt=64, num_blocks=400, max_num_seqs=64):
    import torch
    from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    vc = VllmConfig(
        model_config=ModelConfig(model=parts[0], dtype="float32", seed=0, skip_tokenizer_init=True,
                                 max_model_len=1024),
        scheduler_config=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=mbt, max_model_len=1024,
                                         is_encoder_decoder=False, enable_chunked_prefill=True),
        cache_config=CacheConfig(block_size=BS, enable_prefix_caching=True))
    vc.scheduler_config.async_scheduling = async_scheduling  # the CPU platform would force it off
    vc.cache_config.num_gpu_blocks = num_blocks
    kv = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(["layer"], FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=1,
                                                      dtype=torch.float32))])
    return cls(vllm_config=vc, kv_cache_config=kv, structured_output_manager=StructuredOutputManager(vc),
               log_stats=True, block_size=BS)


def req(parts, rid, ids, max_tokens=4):
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request
    return Request(rid, list(ids), SamplingParams(max_tokens=max_tokens, ignore_eos=True), None,
                   block_hasher=parts[1])


def output_for(s, out):
    """The model's answer to a step: one sampled token for each request scheduled past
    its prompt (the step that computes a prompt's last token samples too); under async
    scheduling a request may have finished while its step was in flight (vLLM skips it)."""
    from vllm.v1.outputs import ModelRunnerOutput
    ids = list(out.num_scheduled_tokens)
    reqs = s.requests
    sampled = [[7] if r in reqs and reqs[r].num_computed_tokens >= reqs[r].num_prompt_tokens else [] for r in ids]
    return ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                             sampled_token_ids=sampled)


class Clock:
    """time.monotonic for the mixin: the test sets what each call reads."""
    def __init__(self):
        self.now = 0.0

    def monotonic(self):
        return self.now


@pytest.fixture
def raw(tmp_path, monkeypatch):
    path = tmp_path / "steps.raw"
    monkeypatch.setenv(steps.STEPS_ENV, str(path))
    return path


def test_every_kit_scheduler_records_steps(parts, raw):
    for kind in ("budget", "live", "steps"):
        for a in (False, True):
            assert issubclass(scheduler_class(a, kind), step_records.StepRecordsMixin)
    assert scheduler_class(False, True) is scheduler_class(False, "budget")
    s = make(parts)
    assert type(s).__name__ == "StepRecordsSyncScheduler" and s._sr_on
    s.shutdown()


def test_rows_count_prefill_cached_and_decode_work(parts, raw):
    s = make(parts, mbt=64)
    a = req(parts, "A", PREFIX + list(range(5000, 5036)))       # 100 tokens: chunks of 64 + 36
    s.add_request(a)
    done = []
    while s.requests:
        out = s.schedule()
        s.update_from_output(out, output_for(s, out))
        if "A" not in s.requests and not done:                  # A's blocks now cached: B shares 64 tokens
            s.add_request(req(parts, "B", PREFIX + list(range(6000, 6020))))   # 84 tokens
            s.add_request(req(parts, "C", range(9000, 9030)))                  # 30 tokens, nothing shared
            done.append(True)
    s.shutdown()
    rows = steps.read_raw(raw)
    prompts, cached = 100 + 84 + 30, 64
    assert rows["cached_tokens"].sum() == cached
    assert rows["prefill_tokens"].sum() == prompts - cached  # every prompt token computed once, less the cache
    assert rows["prefill_reqs"][:2].tolist() == [1, 1]      # A's two chunks
    assert rows["prefill_tokens"][:2].tolist() == [64, 36]
    assert rows["context_tokens"][1] == 64                   # A's second chunk reads the first's KV
    assert rows["prefill_context_tokens"][:2].tolist() == [0, 64]   # ... and that is a prefill's context
    assert rows["prefill_attention_pairs"][:2].tolist() == [64 * 65 // 2, 36 * 64 + 36 * 37 // 2]
    # B's cached 64 tokens are its prompt's context where its tail is computed; C has none
    b_step = np.flatnonzero(rows["cached_tokens"] == cached)[0]
    assert rows["prefill_context_tokens"][b_step] == cached
    assert np.all(rows["prefill_context_tokens"][rows["prefill_reqs"] == 0] == 0)
    # B's 20-token tail over its 64 cached, and C's whole 30-token prompt, in the same step
    assert rows["prefill_attention_pairs"][b_step] == (20 * cached + 20 * 21 // 2) + 30 * 31 // 2
    assert np.all(rows["prefill_attention_pairs"][rows["prefill_reqs"] == 0] == 0)
    # 4 tokens each: the first sampled by the prefill's last step, 3 decode steps after
    assert rows["decode_reqs"].sum() == 3 * 3 and rows["decode_tokens"].sum() == 3 * 3
    first_decode = np.flatnonzero(rows["decode_reqs"])[0]
    assert rows["context_tokens"][first_decode] == 100      # A's prompt + its first token less that token
    assert np.all(rows["t_done"] >= rows["t_scheduled"])
    assert np.all(rows["running"] >= rows["prefill_reqs"] + rows["decode_reqs"])
    assert np.all((rows["kv_usage"] > 0) & (rows["kv_usage"] <= 1))
    assert rows["preempted"].sum() == 0


def test_two_steps_in_flight_pair_first_in_first_out(parts, raw, monkeypatch):
    """Async scheduling as EngineCore's batch queue runs it: step n+1 is scheduled
    before step n's output is back; each row gets its own step's output time."""
    clock = Clock()
    monkeypatch.setattr(step_records, "time", clock)
    s = make(parts, async_scheduling=True, mbt=256)
    assert type(s).__name__ == "StepRecordsAsyncScheduler"
    for k in range(3):
        s.add_request(req(parts, f"R{k}", range(100 * k, 100 * k + 40), max_tokens=6))
    queue, expect = [], []   # (scheduler output, t_scheduled); expected (t_scheduled, t_done, tokens)
    for _ in range(100):
        if not (s.requests or queue):
            break
        if s.requests and len(queue) < 2:
            clock.now += 1.0
            out = s.schedule()
            if out.total_num_scheduled_tokens:
                queue.append((out, clock.now))
                if len(queue) < 2:
                    continue                      # fill the queue first, as core.py does
        out, t_s = queue.pop(0)                   # full, or nothing more to schedule: wait for the oldest
        clock.now += 0.25
        expect.append((t_s, clock.now, out.total_num_scheduled_tokens))
        s.update_from_output(out, output_for(s, out))
    assert not s.requests and not queue
    s.shutdown()
    rows = steps.read_raw(raw)
    got = list(zip(rows["t_scheduled"], rows["t_done"], rows["prefill_tokens"] + rows["decode_tokens"]))
    assert got == expect
    # overlap: some step was scheduled before the previous step's output came back
    assert np.any(rows["t_scheduled"][1:] < rows["t_done"][:-1])
    assert rows["prefill_tokens"].sum() == 120
    assert s._sr_unpaired == 0


def test_a_step_whose_output_never_comes_back_is_passed_over(parts, raw, monkeypatch):
    clock = Clock()
    monkeypatch.setattr(step_records, "time", clock)
    s = make(parts, async_scheduling=True, mbt=256)
    s.add_request(req(parts, "R", range(40), max_tokens=20))
    clock.now = 1.0
    lost = s.schedule()
    clock.now = 2.0
    kept = s.schedule()
    clock.now = 3.0
    s.update_from_output(kept, output_for(s, kept))  # the first step's output is never passed in
    s.shutdown()
    rows = steps.read_raw(raw)
    assert rows["t_scheduled"].tolist() == [2.0] and rows["t_done"].tolist() == [3.0]
    assert s._sr_unpaired == 1 and lost.total_num_scheduled_tokens == 40


def test_rows_reach_the_file_when_the_engine_goes_idle(parts, raw):
    s = make(parts)
    s.add_request(req(parts, "A", range(30), max_tokens=2))
    while s.requests:
        out = s.schedule()
        s.update_from_output(out, output_for(s, out))
    assert len(steps.read_raw(raw)) == 2  # no shutdown yet: flushed because nothing is left to run
    s.shutdown()


def test_without_the_variable_nothing_is_recorded(parts, tmp_path, monkeypatch):
    monkeypatch.delenv(steps.STEPS_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    s = make(parts, cls=scheduler_class(False, "budget"))
    s.add_request(req(parts, "A", range(30), max_tokens=2))
    while s.requests:
        out = s.schedule()
        s.update_from_output(out, output_for(s, out))
    s.shutdown()
    assert not s._sr_on and s._sr_fd is None and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_rows_match_each_requests_own_count_through_preemptions(parts, raw, async_scheduling):
    """A KV cache too small for the batch: vLLM preempts, the preempted requests come back
    and recompute. Each row's prefill/decode split must equal the plain rule applied to
    every scheduled request (computed before the step below its prompt: prefill)."""
    s = make(parts, async_scheduling=async_scheduling, mbt=128, num_blocks=24)
    for k in range(6):
        s.add_request(req(parts, f"R{k}", range(1000 * k, 1000 * k + 40 + 8 * k), max_tokens=40))
    expect, queue = [], []
    for _ in range(2000):
        if not (s.requests or queue):
            break
        if s.requests and len(queue) < (2 if async_scheduling else 1):
            out = s.schedule()
            if out.total_num_scheduled_tokens:
                p = [(n, s.requests[r].num_computed_tokens - n < s.requests[r].num_prompt_tokens)
                     for r, n in out.num_scheduled_tokens.items()]
                expect.append((sum(n for n, pre in p if pre), sum(pre for _, pre in p),
                               sum(not pre for _, pre in p), sum(n for n, pre in p if not pre),
                               len(out.preempted_req_ids or ())))
                queue.append(out)
                if async_scheduling and len(queue) < 2:
                    continue
            elif not queue:
                continue
        out = queue.pop(0)
        s.update_from_output(out, output_for(s, out))
    assert not s.requests
    s.shutdown()
    rows = steps.read_raw(raw)
    got = list(zip(*(rows[c].tolist() for c in ("prefill_tokens", "prefill_reqs", "decode_reqs", "decode_tokens",
                                                  "preempted"))))
    assert got == expect
    assert rows["preempted"].sum() > 0  # the case this test is for


def test_an_empty_step_in_the_batch_queue_loses_no_row(parts, raw, monkeypatch):
    """EngineCore's batch queue (step_with_batch_queue) holds the empty steps schedule()
    returns too (under async scheduling, when every running request already has a step in
    flight) and hands each back to update_from_output in its turn. The mixin never queued
    an empty step: its output must leave the steps scheduled after it where they are."""
    from vllm.v1.outputs import ModelRunnerOutput
    clock = Clock()
    monkeypatch.setattr(step_records, "time", clock)
    s = make(parts, async_scheduling=True, mbt=256)
    clock.now = 1.0
    empty = s.schedule()                    # nothing to run: an empty step, queued by the engine
    s.add_request(req(parts, "R", range(40), max_tokens=4))
    clock.now = 2.0
    first = s.schedule()                    # scheduled behind it
    clock.now = 3.0
    s.update_from_output(empty, ModelRunnerOutput(req_ids=[], req_id_to_index={}))
    clock.now = 4.0
    s.update_from_output(first, output_for(s, first))
    s.shutdown()
    rows = steps.read_raw(raw)
    assert empty.total_num_scheduled_tokens == 0 and first.total_num_scheduled_tokens == 40
    assert rows["t_scheduled"].tolist() == [2.0] and rows["t_done"].tolist() == [4.0]
    assert s._sr_unpaired == 0
