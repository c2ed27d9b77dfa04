"""The prefix-cache model: vLLM's block pool replayed by hand on small traces (each
expected figure worked out in the comment beside it), and, with a cache that never
evicts, the kit's never-evicting bound on the Mooncake conversation window."""
from __future__ import annotations

from dataclasses import replace

import pytest

from vllm_study.workload import prefix_cache_model as pcm
from vllm_study.define.params import TraceSpec
from vllm_study.define.traces import Trace, TraceRequest, read_trace


def req(t, n, ids, out=1):
    return TraceRequest(float(t), n, out, tuple(ids), None, 0)


def hits(reqs, kv_blocks=None, bs=2, B=4, **kw):
    """Hit tokens per request, on a cache of kv_blocks usable blocks of bs tokens."""
    kv = None if kv_blocks is None else (kv_blocks + 1) * bs  # + vLLM's null block
    return pcm.simulate(reqs, block_tokens=B, kv_tokens=kv, block_size=bs, **kw).hit_tokens


# ---------------------------------------------------------------- exact arithmetic

def test_a_repeated_prefix_hits_its_full_blocks_but_never_the_last_token():
    # A: 8 tokens = blocks ending 2, 4 (id 1), 6, 8 (id 2). B: 9 tokens, ids 1, 2, 3: its
    # first 4 blocks are A's; the cap (9 - 1) // 2 = 4 blocks lets all 4 hit: 8 tokens.
    # C repeats A exactly: the cap (8 - 1) // 2 = 3 blocks: 6 tokens, never all 8.
    r = pcm.simulate([req(0, 8, [1, 2]), req(1, 9, [1, 2, 3]), req(2, 8, [1, 2])], block_tokens=4,
                     kv_tokens=None, block_size=2)
    assert r.hit_tokens == [0, 8, 6]
    assert r.hit_rate == pytest.approx(14 / 25)


def test_lru_evicts_a_finished_requests_tail_first():
    # 4 usable blocks. A (8 tokens) fills them; freed last block first, the queue is
    # [A8, A6, A4, A2]. C (4 tokens, id 9) takes 2 blocks: evicts A8, A6. B (ids 1, 2, 3)
    # then finds A2, A4 only: 4 tokens.
    assert hits([req(0, 8, [1, 2]), req(1, 4, [9]), req(2, 9, [1, 2, 3])], kv_blocks=4) == [0, 0, 4]
    # with room for all (6 blocks) B finds all four
    assert hits([req(0, 8, [1, 2]), req(1, 4, [9]), req(2, 9, [1, 2, 3])], kv_blocks=6) == [0, 0, 8]


def test_a_hit_makes_blocks_recently_used():
    # 4 blocks. A (id 1) then D (id 2), 4 tokens each: queue [A4, A2, D4, D2]. E repeats A:
    # it hits A2 (the cap: (4 - 1) // 2 = 1 block) and recomputes A4 (its stale copy goes);
    # when E ends the queue is [D4, D2, A4, A2]. F (id 3) takes 2 blocks: D's go. So a
    # probe with id 1 finds 4 tokens and one with id 2 none; without E, the reverse.
    a, d, e, f = req(0, 4, [1]), req(1, 4, [2]), req(2, 4, [1]), req(3, 4, [3])
    p1, p2 = req(4, 5, [1, 6]), req(4, 5, [2, 6])
    assert hits([a, d, e, f, p1], kv_blocks=4) == [0, 0, 2, 0, 4]
    assert hits([a, d, e, f, p2], kv_blocks=4) == [0, 0, 2, 0, 0]
    assert hits([a, d, f, p1], kv_blocks=4) == [0, 0, 0, 0]
    assert hits([a, d, f, p2], kv_blocks=4) == [0, 0, 0, 4]


def test_a_partial_last_block_is_never_cached():
    # A: 7 tokens, ids 1, 2 (4 + 3): full blocks end at 2, 4, 6; the block 6-7 is partial.
    # B: 9 tokens, ids 1, 2, 3 (cap (9 - 1) // 2 = 4 blocks): its block ending at 8 was
    # never cached: 6 tokens hit, not 8.
    assert hits([req(0, 7, [1, 2]), req(1, 9, [1, 2, 3])]) == [0, 6]
    # A's output fills its partial block (tokens 6 and 7 computed), but that block holds an
    # output token, not B's prompt: still 6.
    assert hits([req(0, 7, [1, 2], out=3), req(1, 9, [1, 2, 3])]) == [0, 6]
    # 3-token blocks: A's full blocks end at 3 and 6; the one ending at 6 straddles ids 1
    # and 2 and is named by id 2, which holds its last token: B with a different second
    # id finds only the first block
    assert hits([req(0, 7, [1, 2]), req(1, 9, [1, 2, 3])], bs=3) == [0, 6]
    assert hits([req(0, 7, [1, 2]), req(1, 9, [1, 4, 3])], bs=3) == [0, 3]


def test_output_blocks_take_room_while_the_request_runs():
    # 6 blocks; ttft 0, tpot 1 s. D (id 3, 4 tokens) at 0 leaves D2, D4 cached, 4 blocks free.
    # A (id 1, 4 tokens, 9 outputs) at 1 takes 2 blocks, then one each as tokens 4, 6, 8, 10
    # are computed: at 1, 3, 5, 7 s (token 4 + k is output k's KV, computed a step after it
    # is sampled at 1 + k - 1). At 5 s it takes the last free block... and at 5 s the queue's
    # head, D4. E (ids 3, 9, 5 tokens) at 6 s finds D2 only.
    reqs = [req(0, 4, [3]), req(1, 4, [1], out=9), req(6, 5, [3, 9])]
    timed = pcm.Timing(0.0, 1.0)
    assert hits(reqs, kv_blocks=6, timing=timed) == [0, 0, 2]
    # A with 1 output token holds no decode block: E finds D2 and D4
    assert hits([reqs[0], replace(reqs[1], output_tokens=1), reqs[2]], kv_blocks=6, timing=timed) == [0, 0, 4]
    # one at a time (no timing) A still holds its 6 blocks at once before it ends: D's go
    assert hits(reqs, kv_blocks=6) == [0, 0, 0]


def test_finished_output_blocks_are_evicted_before_the_prompt():
    # 6 blocks. A (id 1, 4 tokens, 9 outputs): 12 computed tokens, 6 full blocks, freed tail
    # first: queue [o12, o10, o8, o6, A4, A2]. B (ids 5, 6, 7; 10 tokens) needs 5 blocks:
    # evicts the 4 output blocks and A4. C (ids 1, 8) finds A2: 2 tokens.
    assert hits([req(0, 4, [1], out=9), req(1, 10, [5, 6, 7]), req(2, 5, [1, 8])], kv_blocks=6) == [0, 0, 2]
    # B of 8 tokens (4 blocks) evicts only output blocks: C finds A2, A4
    assert hits([req(0, 4, [1], out=9), req(1, 8, [5, 6]), req(2, 5, [1, 8])], kv_blocks=6) == [0, 0, 4]


def test_running_requests_that_need_more_than_the_cache_are_counted():
    # 3 blocks; A (8 tokens) needs 4 at once: 1 short
    r = pcm.simulate([req(0, 8, [1, 2])], block_tokens=4, kv_tokens=(3 + 1) * 2, block_size=2)
    assert r.short_blocks == 1 and r.capacity_blocks == 3


def test_history_is_sent_first_as_prefill_only_requests():
    # history H (ids 1, 2; 8 tokens; its output is 1 token, never computed): 4 blocks cached.
    # The window's W (ids 1, 2, 3) finds them all; without history, nothing.
    h, w = [req(0, 8, [1, 2], out=50)], [req(10, 9, [1, 2, 3])]
    r = pcm.simulate(w, block_tokens=4, kv_tokens=None, block_size=2, history=h)
    assert r.hit_tokens == [8] and (r.history_requests, r.history_tokens) == (1, 8)
    assert pcm.simulate(w, block_tokens=4, kv_tokens=None, block_size=2).hit_tokens == [0]


def test_requests_without_prefix_ids_share_nothing():
    a = TraceRequest(0.0, 8, 1, None, None, 0)
    assert pcm.simulate([a, replace(a, t_s=1.0)], block_tokens=None, kv_tokens=None, block_size=2).hit_tokens == [0, 0]


def test_history_start_is_where_the_history_fills_the_cache():
    # each request: 2 distinct blocks (4 tokens, block 2); the cache holds 4: the last two
    # requests before the window fill it
    reqs = [req(i, 4, [i]) for i in range(6)]
    assert pcm.history_start(reqs, 5, block_tokens=4, kv_tokens=(4 + 1) * 2, block_size=2) == (3, True)
    # a repeated prefix counts once
    reqs[3] = req(3, 4, [4])
    assert pcm.history_start(reqs, 5, block_tokens=4, kv_tokens=(4 + 1) * 2, block_size=2) == (2, True)
    # fills exactly at the start; runs off it; a cache that never evicts wants all of it
    assert pcm.history_start(reqs, 2, block_tokens=4, kv_tokens=(4 + 1) * 2, block_size=2) == (0, True)
    assert pcm.history_start(reqs, 2, block_tokens=4, kv_tokens=(6 + 1) * 2, block_size=2) == (0, False)
    assert pcm.history_start(reqs, 5, block_tokens=4, kv_tokens=None, block_size=2) == (0, False)


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="block_size is tokens per KV block"):
        pcm.simulate([req(0, 4, [1])], block_tokens=4, kv_tokens=None, block_size=0)
    with pytest.raises(ValueError, match="kv_tokens 16 holds no 16-token block"):
        pcm.simulate([req(0, 4, [1])], block_tokens=4, kv_tokens=16, block_size=16)
    with pytest.raises(ValueError, match="ttft_s and tpot_s"):
        pcm.Timing(-1, 0)


# ---------------------------------------------------------------- against the kit's bound

@pytest.fixture(scope="module")
def mooncake():
    return read_trace(TraceSpec(file="mooncake_conversation"))


def test_never_evicting_at_one_token_blocks_is_the_kits_bound(mooncake):
    # block 1: every token is a full block, so vLLM's cache that never evicts reuses
    # exactly what the bound counts (leading blocks seen, never the last token)
    head = Trace(mooncake.requests[:80], mooncake.block_tokens, "head")
    m = pcm.simulate(head.requests, block_tokens=512, kv_tokens=None, block_size=1)
    assert head.expected_hit_rate() > 0.03  # the window reuses something: the check can fail
    assert m.hit_rate == head.expected_hit_rate()


def test_never_evicting_at_vllms_block_is_the_bound_less_partial_blocks(mooncake):
    # block 16: the bound counts a reused partial block's tokens, vLLM only full blocks.
    # With every prompt 1 token past a whole block (cut down to 16k + 1; none of these
    # requests is a whole number of 512-token blocks, so each id keeps its size) the
    # last token is the only partial one and the two agree exactly.
    reqs = mooncake.requests
    assert not any(r.input_tokens % 512 == 0 for r in reqs)
    cut = [replace(r, input_tokens=r.input_tokens - (r.input_tokens - 1) % 16) for r in reqs]
    m = pcm.simulate(cut, block_tokens=512, kv_tokens=None, block_size=16)
    assert m.hit_rate == Trace(cut, 512, "cut").expected_hit_rate()
    # on the window as it is, below the bound by less than a block per request
    m = pcm.simulate(reqs, block_tokens=512, kv_tokens=None, block_size=16)
    bound = round(mooncake.expected_hit_rate() * sum(r.input_tokens for r in reqs))
    assert 0 < bound - sum(m.hit_tokens) < 16 * len(reqs)


def test_bound_hit_tokens_with_and_without_history(mooncake):
    hit, total = pcm.bound_hit_tokens(mooncake, 0, 40, with_history=False)
    assert hit / total == Trace(mooncake.requests[:40], 512, "x").expected_hit_rate()
    alone, _ = pcm.bound_hit_tokens(mooncake, 300, 360, with_history=False)
    both, total = pcm.bound_hit_tokens(mooncake, 300, 360, with_history=True)
    assert total == sum(r.input_tokens for r in mooncake.requests[300:360]) and both > alone


def test_the_curve_rises_with_the_cache_to_the_never_evicting_rate(mooncake):
    head = Trace(mooncake.requests[:150], mooncake.block_tokens, "head")
    curve = pcm.hit_rate_curve(head, [20_000, 200_000, 2_000_000, None])
    rates = curve["hit_rate"].tolist()
    assert rates == sorted(rates) and rates[0] < rates[-1]
    assert rates[-1] == pcm.simulate(head.requests, block_tokens=512, kv_tokens=None).hit_rate
