"""Every grid axis the kit knows, defined once: its short name in point ids, how figures
label and scale it, vLLM's default, how a value is written, and which counter tells
whether it bound. Point ids, the Effective values, figures and the report's binding
notes all read this registry, so adding an axis is one entry in AXES.

Imports nothing from the package, so any module may import it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

Scale = Literal["log2", "linear", "category"]
# The evidence binding.binding_notes reads: KV room, prefills longer than the chunk,
# running requests against the cap, the budget's deferrals; None: no counter says.
Binds = Literal["kv", "chunk", "seqs", "scheduler"] | None
SCHEDULER_AXIS = "min_reuse_ratio"  # the Prefix Reuse Budget's ratio: not an engine argument


def _both(value) -> dict[str, Any]:
    return {"cpu": value, "gpu": value}


@dataclass(frozen=True)
class Axis:
    name: str                # the engine argument (or SCHEDULER_AXIS)
    short: str               # in point ids: points/mbt=512__gmu=0.90/
    label: str               # a figure's axis label
    unit: str = ""           # "" for booleans
    scale: Scale = "linear"  # figure ticks: log2 for sizes swept in doublings, category for on/off values
    # vLLM's default per engine kind; None where vLLM derives it from what the kit cannot see
    default: dict[str, Any] = field(default_factory=lambda: _both(None))
    binds: Binds = None

    def fmt(self, value) -> str:
        """A value as point ids and figure ticks show it."""
        if isinstance(value, bool):
            return "on" if value else "off"
        if self.unit == "bytes":
            mib = value / 2**20
            return f"{mib / 1024:g}GiB" if mib >= 1024 and mib % 1024 == 0 else f"{mib:g}MiB"
        if isinstance(value, float):
            return f"{value:.2f}"
        return str(value)


# Defaults: vLLM's (vllm/engine/arg_utils.py, get_batch_defaults and
# _set_default_max_num_seqs_and_batched_tokens_args; vllm/config/cache.py), the same in 0.26
# and 0.32.
AXES: dict[str, Axis] = {a.name: a for a in (
    # gpu: cards of 70 GiB and more (H100, H200); smaller cards get less
    Axis("max_num_batched_tokens", "mbt", "max_num_batched_tokens (chunk size)", "tokens", "log2",
         {"cpu": 2048, "gpu": 8192}, "chunk"),
    # CacheConfig's 0.92 (the committed H200 runs that leave it unset report 0.92 in
    # vllm:cache_config_info); on the CPU engine a fraction of the node's RAM
    Axis("gpu_memory_utilization", "gmu", "gpu_memory_utilization", "fraction of GPU memory", "linear",
         _both(0.92), "kv"),
    # log2: sizes are swept in multiples (16 MiB to GiBs), ticks as point ids write them
    Axis("kv_cache_memory_bytes", "kv", "KV cache size", "bytes", "log2", binds="kv"),
    # cpu: per tensor-parallel rank; gpu: cards of 70 GiB and more but A100s (smaller and
    # A100s get 256). log2: caps are swept in multiples (8, 32, 128), crowded on a linear axis
    Axis("max_num_seqs", "mns", "max_num_seqs", "sequences", "log2", {"cpu": 128, "gpu": 1024}, "seqs"),
    # log2: vLLM's block sizes are powers of two (16, 32, 64, 128)
    Axis("block_size", "bs", "block_size", "tokens per block", "log2", {"cpu": 128, "gpu": 16}),
    Axis("enable_prefix_caching", "pc", "enable_prefix_caching", "", "category", _both(True)),  # vLLM v1
    Axis("enable_chunked_prefill", "cp", "enable_chunked_prefill", "", "category", _both(True)),
    # None: the model's context length; log2: context lengths are swept in doublings
    Axis("max_model_len", "len", "max_model_len", "tokens", "log2"),
    # 0 (vLLM's default with one partial prefill at a time): no cap on one request's chunk
    Axis("long_prefill_token_threshold", "lpt", "long_prefill_token_threshold", "tokens", "log2", _both(0)),
    Axis("enforce_eager", "eager", "enforce_eager", "", "category", _both(False)),
    Axis("tensor_parallel_size", "tp", "tensor_parallel_size", "GPUs", "linear", _both(1)),
    # "off" (vLLM's own scheduler) beside ratios: categories; off unless a study asks for it
    Axis(SCHEDULER_AXIS, "mrr", "min_reuse_ratio (Prefix Reuse Budget)", "share of the prompt cached", "category",
         _both("off"), "scheduler"),
)}


def get(name: str) -> Axis:
    """The axis's entry; an EngineArgs field the registry does not list (the grid sweeps
    those fields only) is plain: its own name everywhere, no default the kit can state."""
    return AXES.get(name) or Axis(name, short=name, label=name)
