"""The base of every study-file model: strict (an unknown key is refused, with a
did-you-mean), the error a bad study raises, and the engine arguments a point sets."""
from __future__ import annotations

import difflib

from pydantic import BaseModel, ConfigDict, Field


class StudyError(ValueError):
    """A study definition that cannot run; the message lists every problem found."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class EngineArgs(_Strict):
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

    def cli(self) -> list[str]:
        args = []
        for name, value in self.model_dump(exclude_none=True).items():
            flag = "--" + name.replace("_", "-")
            if isinstance(value, bool):
                if name == "enforce_eager":
                    args += [flag] if value else []
                else:
                    args.append(flag if value else "--no-" + flag[2:])
            else:
                args += [flag, str(value)]
        return args


def _did_you_mean(key: str, options) -> str:
    close = difflib.get_close_matches(key, list(options), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def parse_flags(args: list[str]) -> dict:
    """['--a', '1', '--b=2', '--c'] -> {'a': '1', 'b': '2', 'c': True}: the kit's one reading
    of vLLM flags given as a list (server.extra_cli_args), for every lookup and for the
    exported config. Keys are as written (vLLM takes --a_b for --a-b; a caller that
    compares names says which form it wants)."""
    out, i = {}, 0
    while i < len(args):
        tok = args[i]
        if not tok.startswith("--"):
            i += 1
            continue
        key, eq, value = tok[2:].partition("=")
        if eq:
            out[key] = value
        elif i + 1 < len(args) and not args[i + 1].startswith("--"):
            out[key] = args[i + 1]
            i += 1
        else:
            out[key] = True
        i += 1
    return out
