"""vLLM's prefix cache replayed over a trace: the hit rate a window's requests should see
at the server's own KV size, with the traffic before the window in the cache.

How the kit will call it (per measured round of a trace study, beside vLLM's measured
hit rate and the never-evicting bound; `kv_tokens` is what the server's log reports as
"GPU KV cache size: N tokens", `block_size` its --block-size):

    from vllm_study.workload import prefix_cache_model as pcm, windows
    w = plan.windows[i]                                   # windows.plan_windows(...)
    m = pcm.simulate(whole.requests[w.start:w.stop], block_tokens=whole.block_tokens,
                     kv_tokens=kv, block_size=16, timing=pcm.Timing(ttft_s, tpot_s),
                     history=whole.requests[w.history_start:w.start])  # prime: none -> history=()
    m.hit_rate                                            # the model's prediction
    pcm.hit_rate_curve(whole, [kv / 4, kv, 4 * kv])       # the report's curve, kv marked

Checked against vLLM's own KV cache manager run by the simulator (vllm_study.predict;
results/predict-vs-measured/20261206-cpu): on a primed Mooncake conversation window on
the CPU (blocks of 128, 32 to 512 blocks) this model and vLLM's cache gave the same hit
rate to 4 decimals at every pool size, and both matched the 26 measured rounds (0.387).
The evidence does not separate them; the simulator uses vLLM's own cache (no timing
input, nothing to keep in step with vLLM), and this model stays where no simulator
runs: choosing priming's history and flagging a round whose measured rate departs.

The model, following vllm/v1/core (block_pool.py, kv_cache_manager.py,
single_type_kv_cache_manager.py):
- Blocks of `block_size` tokens; only full blocks are cached (hashed). A prompt block is
  named by the trace's prefix id of the trace block holding its last token and its end
  position: ids are prefix-chained, so that pair names its whole prefix (a block that
  straddles two trace blocks is named by the later one).
- A request's hit is its leading cached blocks, at most (prompt - 1) // block_size of
  them (vLLM always computes the last prompt token). Hit blocks are taken out of the
  eviction queue while the request holds them.
- On arrival a request allocates its prompt's blocks (the whole prefill at once: chunked
  prefill takes the same blocks within its first token's time); each full prompt block is
  cached at once, so a request arriving while another runs can hit it. Decode takes a
  new block each block_size tokens. A request runs for ttft_s + (output - 1) * tpot_s.
- New blocks come from never-cached free blocks first (vLLM puts uncached freed blocks at
  the queue's front), then by evicting the least recently freed cached block.
- A finished request frees its blocks last block first, so its tail is evicted before its
  prefix. Its full blocks stay cached; those holding output tokens can never be hit (the
  replay's outputs are not the next prompt's text) but take room until evicted.
- History (priming) is sent before the window as prefill-only requests, one after another,
  each with 1 output token: each leaves its full prompt blocks cached.

Not modelled: queueing and preemption when running requests need more blocks than the
cache has (counted in `short_blocks`: then vLLM queues requests and the model's room is
too small), vLLM's duplicate physical block when a block already held by a running
request is recomputed (rare: only when the hit stops at the prompt-1 cap), and the chat
template's tail tokens (the trace's ids name the whole prompt's content).

Written here, not taken from a library: no package simulates vLLM's free-block queue.
"""
from __future__ import annotations

import heapq
import math
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import pandas as pd

from ..define.traces import Trace, TraceRequest

DEFAULT_BLOCK_SIZE = 16  # vLLM's default --block-size on GPU


@dataclass(frozen=True)
class Timing:
    """How long a request holds its blocks: ttft_s, then tpot_s per further output token.
    Zero (the default) runs requests one after another: a cache with no running request."""
    ttft_s: float = 0.0
    tpot_s: float = 0.0

    def __post_init__(self):
        if self.ttft_s < 0 or self.tpot_s < 0:
            raise ValueError(f"Timing: ttft_s and tpot_s are seconds of at least 0, not {self.ttft_s}, {self.tpot_s}")


@dataclass
class CacheResult:
    """What the model predicts for the measured requests."""
    hit_tokens: list[int]           # per measured request, tokens served from the cache
    prompt_tokens: list[int]        # per measured request
    history_requests: int = 0       # priming requests sent before the window
    history_tokens: int = 0         # their prompt tokens
    short_blocks: int = 0           # the most blocks the running requests lacked (0: the cache held them)
    capacity_blocks: int | None = None

    @property
    def hit_rate(self) -> float:
        """Hit tokens over prompt tokens: vLLM's prefix_cache_hits / prefix_cache_queries."""
        return sum(self.hit_tokens) / sum(self.prompt_tokens)


def capacity_blocks(kv_tokens: int | None, block_size: int) -> int | None:
    """Blocks the cache can use: the server's KV tokens in blocks, less vLLM's null block."""
    if kv_tokens is None:
        return None
    blocks = int(kv_tokens) // block_size - 1
    if blocks < 1:
        raise ValueError(f"kv_tokens {kv_tokens} holds no {block_size}-token block; give the server's KV size "
                         "in tokens (its log's 'GPU KV cache size')")
    return blocks


def prompt_keys(r: TraceRequest, block_tokens: int | None, block_size: int, serial: int) -> list:
    """Names of a prompt's full blocks, in order. A request without prefix ids shares
    nothing: its blocks are named by `serial`, unique to it."""
    n = r.input_tokens // block_size
    if not r.prefix or block_tokens is None:
        return [(None, serial, j) for j in range(n)]
    # (id, end) packed in one int: a dict looks ints up ~2x faster than tuples
    ids = r.prefix
    return [ids[(end - 1) // block_tokens] << 40 | end for end in range(block_size, (n + 1) * block_size, block_size)]


@dataclass
class _Cache:
    """vLLM's block pool, by block name: `lru` holds the cached blocks no request holds
    (eviction order, first out first), `ref` the cached blocks running requests hold."""
    capacity: int | None
    free: float = field(init=False)            # never-cached free blocks (negative: short)
    lru: OrderedDict = field(default_factory=OrderedDict)
    ref: dict = field(default_factory=dict)
    short: int = 0
    serial: int = 0

    def __post_init__(self):
        self.free = math.inf if self.capacity is None else self.capacity

    def allocate(self, n: int) -> None:
        self.free -= n
        if self.free < 0:
            evict = min(int(-self.free), len(self.lru))
            pop = self.lru.popitem
            for _ in range(evict):
                pop(last=False)
            self.free += evict
            if self.free < 0:
                self.short = max(self.short, int(-self.free))

    def admit(self, keys: list, input_tokens: int, block_size: int) -> tuple[int, list]:
        """A request's arrival: (hit blocks, the blocks it holds, in order; None: a block
        that is not cached yet)."""
        ref, lru = self.ref, self.lru  # locals: this loop runs once per block of the trace
        hit, most = 0, min(len(keys), (input_tokens - 1) // block_size)
        while hit < most and (keys[hit] in ref or keys[hit] in lru):
            hit += 1
        for k in keys[:hit]:  # touch: out of the eviction queue while held
            if k in lru:
                del lru[k]
                ref[k] = 1
            else:
                ref[k] += 1
        for k in keys[hit:]:
            if k in lru:  # a stale copy (past the prompt - 1 cap): the new block takes its name
                del lru[k]
                self.free += 1
        blocks = keys[:hit]
        n = -(-input_tokens // block_size)
        self.allocate(n - hit)
        for k in keys[hit:]:
            if k in ref:  # held by a running request: a second, unnamed copy
                blocks.append(None)
            else:
                ref[k] = 1
                blocks.append(k)
        blocks += [None] * (n - len(blocks))
        return hit, blocks

    def finish(self, blocks: list, computed_tokens: int, block_size: int) -> None:
        """Free a request's blocks, last first. Full blocks stay cached (unnamed ones under
        a name of their own, never hit); the partial last block returns to the free pool."""
        ref, lru = self.ref, self.lru
        full = computed_tokens // block_size
        for pos in range(len(blocks) - 1, -1, -1):
            k = blocks[pos]
            if k is None:
                if pos < full:
                    self.serial += 1
                    lru[(None, -1, self.serial)] = None
                else:
                    self.free += 1
            else:
                c = ref[k]
                if c == 1:
                    del ref[k]
                    lru[k] = None
                else:
                    ref[k] = c - 1


def simulate(measured: Sequence[TraceRequest], *, block_tokens: int | None, kv_tokens: int | None,
             block_size: int = DEFAULT_BLOCK_SIZE, history: Sequence[TraceRequest] = (),
             timing: Timing = Timing()) -> CacheResult:
    """The hit rate `measured` sees on a cache of kv_tokens (None: never evicts), after
    `history` was sent as prefill-only requests. Arrivals are the requests' t_s."""
    if block_size < 1:
        raise ValueError(f"block_size is tokens per KV block (vLLM's --block-size), at least 1, not {block_size}")
    if not measured:
        raise ValueError("simulate: no measured request")
    cache = _Cache(capacity_blocks(kv_tokens, block_size))
    serial = 0
    for r in history:
        serial += 1
        _, blocks = cache.admit(prompt_keys(r, block_tokens, block_size, serial), r.input_tokens, block_size)
        cache.finish(blocks, r.input_tokens, block_size)  # one output token: its KV is never computed
    hits, held = [0] * len(measured), {}
    # events: (time, kind, order, request); at one time a request's decode blocks come
    # before its finish, and finishes free blocks before arrivals look up the cache
    GROW, FINISH, ARRIVE = 0, 1, 2
    events = [(r.t_s, ARRIVE, i, i) for i, r in enumerate(measured)]
    heapq.heapify(events)
    order = len(events)
    while events:
        t, kind, _, i = heapq.heappop(events)
        r = measured[i]
        computed = r.input_tokens + r.output_tokens - 1  # the last output token's KV is never computed
        if kind == ARRIVE:
            serial += 1
            hit, blocks = cache.admit(prompt_keys(r, block_tokens, block_size, serial), r.input_tokens,
                                      block_size)
            hits[i], held[i] = hit * block_size, blocks
            start = t + timing.ttft_s
            for b in range(len(blocks), math.ceil(computed / block_size)):
                # block b is needed when token b * block_size is computed: output token k's
                # KV is computed in the step after it is sampled
                k = b * block_size - r.input_tokens + 1
                order += 1
                heapq.heappush(events, (start + (k - 1) * timing.tpot_s, GROW, order, i))
            order += 1
            heapq.heappush(events, (start + (r.output_tokens - 1) * timing.tpot_s, FINISH, order, i))
        elif kind == GROW:
            cache.allocate(1)
            held[i].append(None)
        else:
            cache.finish(held.pop(i), computed, block_size)
    return CacheResult(hits, [r.input_tokens for r in measured], len(history),
                       sum(r.input_tokens for r in history), cache.short, cache.capacity)


def history_start(requests: Sequence[TraceRequest], start: int, *, block_tokens: int | None,
                  kv_tokens: int | None, block_size: int = DEFAULT_BLOCK_SIZE) -> tuple[int, bool]:
    """Where priming for requests[start:] begins, and whether that history fills the
    cache: the latest request from which the history's distinct full prompt blocks reach
    the cache's blocks (anything older an LRU cache would have evicted). (0, False) when
    the history runs off the trace's start (always, for a cache that never evicts)."""
    cap = capacity_blocks(kv_tokens, block_size)
    if cap is None:
        return 0, False
    seen: set = set()
    for j in range(start - 1, -1, -1):
        seen.update(prompt_keys(requests[j], block_tokens, block_size, -j - 1))
        if len(seen) >= cap:
            return j, True
    return 0, False


def bound_hit_tokens(trace: Trace, start: int, stop: int, *, with_history: bool) -> tuple[int, int]:
    """(hit tokens, prompt tokens) of requests[start:stop] under the kit's never-evicting
    bound at the trace's block size (Trace.expected_hit_rate), alone or with every
    earlier request of the trace seen first. The bound's own code: its hits over
    history + window less its hits over the history."""
    reqs = trace.requests
    first = 0 if with_history else start

    def hits(rs):
        if not rs:
            return 0
        rate = Trace(list(rs), trace.block_tokens, trace.source).expected_hit_rate()
        return round((rate or 0.0) * sum(r.input_tokens for r in rs))

    return hits(reqs[first:stop]) - hits(reqs[first:start]), sum(r.input_tokens for r in reqs[start:stop])


def hit_rate_curve(trace: Trace, kv_tokens: Sequence[int | None], *, block_size: int = DEFAULT_BLOCK_SIZE,
                   timing: Timing = Timing()) -> pd.DataFrame:
    """The model's hit rate over the whole trace at each cache size (None: never
    evicts), for a curve of what a larger cache (e.g. CPU KV offloading) would buy."""
    rows = []
    for kv in kv_tokens:
        m = simulate(trace.requests, block_tokens=trace.block_tokens, kv_tokens=kv, block_size=block_size,
                     timing=timing)
        rows.append({"kv_tokens": kv, "hit_rate": m.hit_rate, "short_blocks": m.short_blocks})
    return pd.DataFrame(rows)
