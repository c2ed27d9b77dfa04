"""What recording engine steps costs the engine loop, per step, on this machine's CPU.

vLLM's real Scheduler (built offline, as the kit's unit tests build it) runs steps of a
batch of B long decoding requests while a 512-token request arrives every step (one
step = schedule() + update_from_output() with a sampled token per request past its
prompt). The scheduler class is StepRecordsMixin over a subclass of vLLM's Scheduler
that times its own schedule() and update_from_output(): the mixin's cost is the time of
each outer call less the inner one, measured within the same call, so the scheduler's
own variation (milliseconds a step at B=256 on a loaded 2-core machine) cancels out.
With VLLM_STUDY_STEPS set the mixin builds, pairs and writes rows; unset, it tests one
attribute; the difference between the two is the rows' cost. Printed: microseconds a
step (schedule + output) for each batch size, the median and P90 over steps, on and
off.

    python benchmarks/step_records_cost.py [--batch 32 256 1024] [--steps 300]
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import numpy as np

BS = 16


def build(model: str, records: Path | None, batch: int, cls):
    import torch
    from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    from vllm_study.scheduler_plugin import steps
    if records:
        os.environ[steps.STEPS_ENV] = str(records)
    else:
        os.environ.pop(steps.STEPS_ENV, None)
    vc = VllmConfig(
        model_config=ModelConfig(model=model, dtype="float32", seed=0, skip_tokenizer_init=True, max_model_len=4096),
        scheduler_config=SchedulerConfig(max_num_seqs=batch + 8, max_num_batched_tokens=2048, max_model_len=4096,
                                         is_encoder_decoder=False, enable_chunked_prefill=True),
        cache_config=CacheConfig(block_size=BS, enable_prefix_caching=True))
    blocks = 200_000
    vc.cache_config.num_gpu_blocks = blocks
    kv = KVCacheConfig(num_blocks=blocks, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(["layer"], FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=1,
                                                      dtype=torch.float32))])
    return cls(vllm_config=vc, kv_cache_config=kv, log_stats=True, block_size=BS,
               structured_output_manager=StructuredOutputManager(vc))


def timed_class():
    """vLLM's Scheduler timing its own schedule() and update_from_output() (the inner calls)."""
    from vllm.v1.core.sched.scheduler import Scheduler

    class Timed(Scheduler):
        inner = 0.0

        def schedule(self, *args, **kwargs):
            t0 = time.perf_counter()
            out = super().schedule(*args, **kwargs)
            self.inner += time.perf_counter() - t0
            return out

        def update_from_output(self, scheduler_output, model_runner_output):
            t0 = time.perf_counter()
            res = super().update_from_output(scheduler_output, model_runner_output)
            self.inner += time.perf_counter() - t0
            return res
    return Timed


def run(model: str, cls, records: Path | None, batch: int, n_steps: int) -> np.ndarray:
    """The mixin's time in each of n_steps steps (seconds): outer less inner."""
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request

    hasher = get_request_block_hasher(BS, sha256)
    s = build(model, records, batch + n_steps + 8, cls)
    n = 0

    def add(prompt: int, max_tokens: int) -> None:
        nonlocal n
        n += 1
        s.add_request(Request(f"r{n}", list(range(n * 7, n * 7 + prompt)),
                              SamplingParams(max_tokens=max_tokens, ignore_eos=True), None, block_hasher=hasher))

    for _ in range(batch):
        add(64, 10**6)
    cost = []
    for k in range(n_steps + 1):
        add(512, 4)
        s.inner = 0.0
        t0 = time.perf_counter()
        out = s.schedule()
        outer = time.perf_counter() - t0
        ids = list(out.num_scheduled_tokens)
        reqs = s.requests
        sampled = [[7] if reqs[r].num_computed_tokens >= reqs[r].num_prompt_tokens else [] for r in ids]
        mro = ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                sampled_token_ids=sampled)
        t0 = time.perf_counter()
        res = s.update_from_output(out, mro)  # kept: freeing it is the caller's time, not the mixin's
        outer += time.perf_counter() - t0
        del res
        if k:  # the first step admits the whole batch
            cost.append(outer - s.inner)
    s.shutdown()
    return np.array(cost)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, nargs="+", default=[32, 256, 1024])
    ap.add_argument("--steps", type=int, default=300)
    a = ap.parse_args()

    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import init_none_hash

    from vllm_study.scheduler_plugin import steps
    from vllm_study.scheduler_plugin.step_records import StepRecordsMixin

    tmp = Path(tempfile.mkdtemp())
    (tmp / "config.json").write_text(json.dumps({
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 151936,
        "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "rope_theta": 1e6, "tie_word_embeddings": True,
        "hidden_act": "silu", "torch_dtype": "float32"}))
    init_none_hash(sha256)
    cls = type("Probe", (StepRecordsMixin, timed_class()), {})
    for batch in a.batch:
        raw = tmp / f"steps-{batch}.raw"
        on = run(str(tmp), cls, raw, batch, a.steps) * 1e6
        off = run(str(tmp), cls, None, batch, a.steps) * 1e6
        rows = steps.read_raw(raw)
        print(f"batch {batch} decoding + a 512-token request arriving each step, {a.steps} steps "
              f"({len(rows)} rows written, {steps.DTYPE.itemsize} bytes each in the raw file):")
        for name, x in (("records on ", on), ("records off", off)):
            print(f"  {name}: median {np.median(x):6.1f} us/step, P90 {np.quantile(x, 0.9):6.1f}")


if __name__ == "__main__":
    main()
