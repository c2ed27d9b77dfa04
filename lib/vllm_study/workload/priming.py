"""Priming a trace window (`trace.prime: history`): the traffic that preceded the window
in its file, sent unmeasured before each round as prefill-only requests, so the round
meets the prefix cache a server running that trace would hold, not a cold one.

How much: back from the window's start until the history's distinct full prompt blocks
fill the server's KV cache (prefix_cache_model.history_start); anything older an LRU cache
would have evicted. A window whose history runs out first starts part cold, and says so.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from collections.abc import Sequence

from . import prefix_cache_model as pcm
from .trace_workload import TraceWorkload
from .workload import Request
from ..define.traces import Trace, TraceRequest


@dataclass(frozen=True)
class History:
    requests: list[TraceRequest]  # what priming sends, oldest first
    available: int                # requests before the window in the file (those the server can take)
    available_tokens: int         # their prompt tokens
    full: bool                    # the sent history fills the cache; False: it runs off the trace's start
    kv_tokens: int

    @property
    def prompt_tokens(self) -> int:
        return sum(r.input_tokens for r in self.requests)

    def note(self, fix: str = "move trace.start_s later for a full history") -> str | None:
        """A statement (not an error) where the history runs off the trace's start."""
        if self.full:
            return None
        return (f"trace.prime: history: the window's history runs off the trace's start: {self.available} requests, "
                f"{self.available_tokens:,} prompt tokens before it, fewer distinct blocks than the server's "
                f"{self.kv_tokens:,}-token KV cache holds; each round starts part cold ({fix})")


def select_history(before: Sequence[TraceRequest], window: Sequence[TraceRequest], *, block_tokens: int,
                   kv_tokens: int, block_size: int, max_model_len: int | None = None) -> History:
    """The rows of `before` (the file's rows ahead of the window, oldest first) that
    priming sends for a cache of kv_tokens in blocks of block_size: the most recent ones
    whose distinct full blocks reach the cache's size. Rows the server cannot take
    (prompt + 1 output token over max_model_len) are left out, as the window's are."""
    fits = [r for r in before if max_model_len is None or r.input_tokens + 1 <= max_model_len]
    h, full = pcm.history_start(fits + list(window), len(fits), block_tokens=block_tokens,
                                kv_tokens=kv_tokens, block_size=block_size)
    return History(fits[h:], len(fits), sum(r.input_tokens for r in fits), full, kv_tokens)


def prime_requests(tokenizer, *, api: str, seed: int, history: History, block_tokens: int) -> list[Request]:
    """The history as requests of one output token (prefill only), with the same prefix
    blocks' content as the window's requests (a block's text is a function of the seed
    and its id alone)."""
    if not history.requests:
        return []
    wl = TraceWorkload(tokenizer, api=api, seed=seed, trace=Trace(list(history.requests), block_tokens, "history"),
                       stream="prime")
    return [replace(r, max_tokens=1, tags={"prime": True}) for r in wl.requests()]
