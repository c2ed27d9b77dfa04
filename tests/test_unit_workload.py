"""The shared-prefix workload with the real Qwen tokenizer the kit builds: exact token
lengths, shared system prompt, distinct questions, determinism."""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from transformers import AutoTokenizer

from vllm_study.models import build_model_dir
from vllm_study.workload import SharedPrefixWorkload, word_pieces

SYS, QUESTION, OUT = 1600, 32, 64


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """Building the tokenizer takes ~15 s: reuse the kit's cache when VLLM_STUDY_CACHE
    is set (the same folder the sweep uses), else build once for this module."""
    cache = os.environ.get("VLLM_STUDY_CACHE")
    root = Path(cache) / "models" if cache else tmp_path_factory.mktemp("models")
    return build_model_dir("tiny-qwen2", root / "tiny-qwen2")


@pytest.fixture(scope="module")
def tok(model_dir):
    # loaded from the folder, as vLLM loads it
    return AutoTokenizer.from_pretrained(str(model_dir))


@pytest.fixture(scope="module")
def pieces(tok):
    return word_pieces(tok)


@pytest.fixture(scope="module", autouse=True)
def _pieces_once(pieces):
    """word_pieces decodes the whole vocabulary (~1 s); every workload here gets the list
    computed once above (test_word_pieces_are_single_tokens checks that list)."""
    import vllm_study.workload as workload
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(workload, "word_pieces", lambda tokenizer: list(pieces))
        yield


def _workload(tok, api, seed=0, sys_tokens=SYS, q_tokens=QUESTION):
    return SharedPrefixWorkload(tok, api=api, system_prompt_tokens=sys_tokens,
                                question_tokens=q_tokens, output_tokens=OUT, seed=seed)


def _template_overhead(tok) -> int:
    """Tokens the chat template adds around a system and a user message, counted on
    empty contents (independently of the workload's own counting)."""
    text = tok.apply_chat_template([{"role": "system", "content": ""},
                                    {"role": "user", "content": ""}],
                                   tokenize=False, add_generation_prompt=True)
    return len(tok.encode(text, add_special_tokens=False))


# ---------------------------------------------------------------- the tokenizer itself

def test_tokenizer_is_qwen(tok, model_dir):
    assert tok.encode("Hello world!") == [9707, 1879, 0]
    assert len(tok) == 151936
    cfg = json.loads((model_dir / "config.json").read_text())
    assert cfg["vocab_size"] == len(tok)
    assert tok.convert_tokens_to_ids("<|im_end|>") == cfg["eos_token_id"] == 151645
    assert tok.convert_tokens_to_ids("<|endoftext|>") == cfg["bos_token_id"] == 151643
    assert (model_dir / ".complete").read_text().split()[0] == "tiny-qwen2"


def test_chat_template_is_chatml(tok):
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                   add_generation_prompt=True)
    assert text == ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
                    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert _template_overhead(tok) == 13


def test_word_pieces_are_single_tokens(tok, pieces):
    assert len(pieces) > 10000
    assert pieces == sorted(pieces)
    sample = pieces[:: len(pieces) // 200]
    for p in sample:
        assert p.startswith(" ") and p[1:].isalpha() and p[1:].islower()
        assert len(tok.encode(p, add_special_tokens=False)) == 1
    # and stay one token each inside a run of them
    assert len(tok.encode("".join(sample), add_special_tokens=False)) == len(sample)


# ---------------------------------------------------------------- exact lengths

def test_completions_prompt_tokens_exact(tok):
    w = _workload(tok, "completions")
    for i in range(3):
        r = w.request(i)
        assert r.messages is None and r.prompt is not None
        assert r.prompt_tokens == SYS + QUESTION
        assert len(tok.encode(r.prompt, add_special_tokens=False)) == SYS + QUESTION
        assert r.max_tokens == OUT
    assert len(tok.encode(w.system_prompt, add_special_tokens=False)) == SYS


def test_chat_prompt_tokens_exact(tok):
    w = _workload(tok, "chat")
    overhead = _template_overhead(tok)
    for i in range(3):
        r = w.request(i)
        assert r.prompt is None
        assert [m["role"] for m in r.messages] == ["system", "user"]
        assert r.prompt_tokens == SYS + QUESTION + overhead
        text = tok.apply_chat_template(r.messages, tokenize=False, add_generation_prompt=True)
        assert len(tok.encode(text, add_special_tokens=False)) == r.prompt_tokens
        assert len(tok.encode(r.messages[1]["content"], add_special_tokens=False)) == QUESTION


@pytest.mark.parametrize("sys_tokens, q_tokens", [(0, 1), (7, 3), (333, 50)])
def test_other_lengths_exact(tok, sys_tokens, q_tokens):
    comp = _workload(tok, "completions", sys_tokens=sys_tokens, q_tokens=q_tokens).request(5)
    chat = _workload(tok, "chat", sys_tokens=sys_tokens, q_tokens=q_tokens).request(5)
    assert comp.prompt_tokens == sys_tokens + q_tokens
    assert chat.prompt_tokens == sys_tokens + q_tokens + _template_overhead(tok)


def test_workload_fits_the_params_template_allowance(tok):
    # params._check_point budgets 32 tokens for the template; the real one needs 13
    assert _template_overhead(tok) <= 32


# ---------------------------------------------------------------- sharing, distinctness

def test_prompts_share_system_prompt_and_differ_per_index(tok):
    w = _workload(tok, "chat")
    reqs = w.requests(8)
    assert [r.index for r in reqs] == list(range(8))
    assert all(r.messages[0]["content"] == w.system_prompt for r in reqs)
    questions = [r.messages[1]["content"] for r in reqs]
    assert len(set(questions)) == 8
    # the shared part is shared as token ids, which is what prefix caching sees
    ids = [tok.encode(tok.apply_chat_template(r.messages, tokenize=False, add_generation_prompt=True),
                      add_special_tokens=False) for r in reqs[:2]]
    common = next(i for i, (a, b) in enumerate(zip(*ids)) if a != b)
    assert common >= SYS + 3  # "<|im_start|>system\n" + the system prompt


def test_completions_prompts_share_prefix(tok):
    w = _workload(tok, "completions")
    a, b = w.request(0).prompt, w.request(1).prompt
    assert a.startswith(w.system_prompt) and b.startswith(w.system_prompt)
    assert a != b


def test_warmup_stream_differs_from_measured(tok):
    w = _workload(tok, "chat")
    warm, meas = w.request(0, stream="warmup"), w.request(0)
    assert warm.messages[0] == meas.messages[0]                    # same system prompt
    assert warm.messages[1]["content"] != meas.messages[1]["content"]


def test_deterministic_for_same_seed(tok):
    a, b = _workload(tok, "chat", seed=3), _workload(tok, "chat", seed=3)
    assert a.system_prompt == b.system_prompt
    assert a.requests(4) == b.requests(4)
    c = _workload(tok, "chat", seed=4)
    assert c.system_prompt != a.system_prompt
    assert c.request(0).messages[1] != a.request(0).messages[1]


# ---------------------------------------------------------------- the other workloads

def _spec(**kw):
    from vllm_study.params import Workload
    return Workload.model_validate(kw)


def test_mixed_workload_long_documents_beside_short_chats(tok):
    from vllm_study.workload import make_workload
    w = make_workload(tok, _spec(kind="mixed", long_fraction=0.1, system_prompt_tokens=200,
                                 long_prompt_tokens={"uniform": [6000, 8000]}, output_tokens=16))
    reqs = w.requests(200)
    long = [r for r in reqs if r.tags["class"] == "long"]
    short = [r for r in reqs if r.tags["class"] == "short"]
    assert 8 <= len(long) <= 35 and len(long) + len(short) == 200  # ~10% of 200
    overhead = _template_overhead(tok)
    for r in long:  # a document of its own, no shared system prompt
        doc = r.messages[-1]["content"]
        assert 6000 <= len(tok.encode(doc, add_special_tokens=False)) <= 8000
        assert r.messages[0]["role"] == "user"
    assert all(r.prompt_tokens == 200 + 32 + overhead for r in short)
    assert [r.tags for r in make_workload(tok, _spec(kind="mixed", long_fraction=0.1, system_prompt_tokens=200,
                                                     output_tokens=16)).requests(200)] == [r.tags for r in reqs]


def test_random_workload_lengths_follow_their_distributions(tok):
    from vllm_study.workload import make_workload
    w = make_workload(tok, _spec(kind="random", api="completions",
                                 input_tokens={"lognormal": {"mean": 300, "sd": 100}},
                                 output_tokens={"uniform": [8, 24]}))
    reqs = w.requests(300)
    ins = np.array([r.prompt_tokens for r in reqs])
    outs = np.array([r.max_tokens for r in reqs])
    assert ins.mean() == pytest.approx(300, rel=0.1) and ins.std() == pytest.approx(100, rel=0.2)
    assert outs.min() >= 8 and outs.max() <= 24 and len(set(outs)) > 10
    for r in reqs[:5]:  # exact: what the request says is what the text encodes to
        assert len(tok.encode(r.prompt, add_special_tokens=False)) == r.prompt_tokens


def test_prefixes_set_the_expected_hit_rate(tok):
    from vllm_study.workload import make_workload
    one = make_workload(tok, _spec(system_prompt_tokens=1600, question_tokens=32))
    four = make_workload(tok, _spec(system_prompt_tokens=1600, question_tokens=32, prefixes=4))
    assert len({r.messages[0]["content"] for r in four.requests(8)}) == 4
    assert [r.tags["prefix"] for r in four.requests(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    # 64 requests, blocks of 128: the shared part rounds down to 1536 of its 1600+ tokens
    per = one.requests(1)[0].prompt_tokens
    assert one.expected_hit_rate(64, 128) == pytest.approx(63 * 1536 / (64 * per))
    assert four.expected_hit_rate(64, 128) == pytest.approx(60 * 1536 / (64 * per))


def test_multi_turn_resends_the_history(tok):
    from vllm_study.workload import make_workload
    w = make_workload(tok, _spec(kind="multi_turn", turns=3, requests_per_round=6, system_prompt_tokens=100,
                                 question_tokens=20, output_tokens=8))
    t1 = w.turn(0, 0, [])
    t2 = w.turn(0, 1, ["first answer"])
    t3 = w.turn(0, 2, ["first answer", "second answer"])
    assert [m["role"] for m in t3.messages] == ["system", "user", "assistant", "user", "assistant", "user"]
    assert t2.messages[:2] == t1.messages[:2] and t3.messages[:4] == t2.messages[:4]
    assert t3.messages[2]["content"] == "first answer"
    assert (t1.tags["turn"], t2.tags["turn"], t3.tags["turn"]) == (1, 2, 3)
    assert t3.prompt_tokens > t2.prompt_tokens > t1.prompt_tokens
    assert w.turn(1, 0, []).messages[1] != t1.messages[1]  # another conversation, other questions
