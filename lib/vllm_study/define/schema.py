"""The base of every study-file model: strict (an unknown key is refused, with a
did-you-mean), the error a bad study raises, and the engine arguments a point sets."""
from __future__ import annotations

import difflib

from pydantic import BaseModel, ConfigDict, Field

from ..launch.flags import Flags


class StudyError(ValueError):
    """A study definition that cannot run; the message lists every problem found."""


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class EngineArgs(Strict):
    """vLLM engine arguments the kit knows (snake_case, as `vllm serve --help` spells
    them with dashes). None means: leave vLLM's default. Anything else goes in
    server.extra_cli_args."""
    max_num_batched_tokens: int | None = Field(None, ge=1)
    gpu_memory_utilization: float | None = Field(None, gt=0, le=1)
    kv_cache_memory_bytes: int | None = Field(None, ge=1)
    max_num_seqs: int | None = Field(None, ge=1)
    block_size: int | None = Field(None, ge=1)
    enable_prefix_caching: bool | None = None
    enable_chunked_prefill: bool | None = None
    max_model_len: int | None = Field(None, ge=16)
    dtype: str | None = None
    enforce_eager: bool | None = None
    tensor_parallel_size: int | None = Field(None, ge=1)
    seed: int | None = None
    # the most prompt tokens one request gets in a step (0: no cap); a live knob (docs/live-knobs.md)
    long_prefill_token_threshold: int | None = Field(None, ge=0)

    def flags(self) -> Flags:
        """These arguments in the kit's one codec (launch/flags.py): the argv, the serve
        config and every lookup read them from there."""
        return Flags.of(self.model_dump(exclude_none=True))

    def cli(self) -> list[str]:
        return self.flags().argv()


def did_you_mean(key: str, options) -> str:
    close = difflib.get_close_matches(key, list(options), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""
