"""Workloads on chat templates other than ChatML: a Llama-3-style header template and a
Mistral-style [INST] template (tokenizers built offline). Prompt lengths stay exact,
the shared prefix is found from the rendered prompts, and templates the kit cannot use
are refused with a fix."""
from __future__ import annotations

import pytest
from transformers import AutoTokenizer

import offline_tokenizers as ot
from vllm_study.define.params import Workload
from vllm_study.workload.build_workload import check_template, make_workload
from vllm_study.workload.workload import SharedPrefixWorkload, word_pieces


@pytest.fixture(scope="module")
def tokenizers(qwen_dir):
    qwen = AutoTokenizer.from_pretrained(qwen_dir)
    return {"chatml": qwen, "llama3": ot.llama3_style(), "mistral": ot.mistral_style()}


FAMILIES = ["chatml", "llama3", "mistral"]


@pytest.mark.parametrize("family", FAMILIES)
def test_pieces_are_single_tokens_in_sequence(tokenizers, family):
    tok = tokenizers[family]
    pieces = word_pieces(tok)
    assert len(pieces) >= 100
    text = "".join(pieces[i * 7 % len(pieces)] for i in range(300))
    assert len(tok.encode(text, add_special_tokens=False)) == 300


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("api", ["chat", "completions"])
def test_prompt_tokens_are_what_the_server_counts(tokenizers, family, api):
    """The recorded length is the rendered prompt's, as vLLM tokenizes it: chat through
    the template without added special tokens, completions with them (a BOS)."""
    tok = tokenizers[family]
    w = SharedPrefixWorkload(tok, api=api, system_prompt_tokens=300, question_tokens=20, output_tokens=8, seed=1)
    for r in w.requests(4):
        if api == "chat":
            ids = tok.apply_chat_template(r.messages, tokenize=True, add_generation_prompt=True,
                                          return_dict=True)["input_ids"]
        else:
            ids = tok.encode(r.prompt, add_special_tokens=True)
        assert r.prompt_tokens == len(ids)
        # the template adds a bounded number of tokens around 300 + 20
        assert 320 <= r.prompt_tokens <= 320 + 32


@pytest.mark.parametrize("family", FAMILIES)
def test_shared_prefix_is_the_common_start_of_two_rendered_prompts(tokenizers, family):
    tok = tokenizers[family]
    w = SharedPrefixWorkload(tok, api="chat", system_prompt_tokens=256, question_tokens=16, output_tokens=8, seed=2)
    a, b = (tok.apply_chat_template(r.messages, tokenize=False, add_generation_prompt=True) for r in w.requests(2))
    ia, ib = tok.encode(a, add_special_tokens=False), tok.encode(b, add_special_tokens=False)
    common = next(i for i, (x, y) in enumerate(zip(ia, ib)) if x != y)
    shared = w.shared_prefix_tokens(w.system_prompt)
    # the probe questions differ from these, so the two agree up to a token or two
    assert abs(shared - common) <= 2
    assert 256 <= shared < len(ia)  # the whole system prompt, plus the template's lead-in
    # every later request reuses that prefix's full blocks, the first none
    rate = w.expected_hit_rate(8, block_size=16)
    total = sum(r.prompt_tokens for r in w.requests(8))
    assert rate == pytest.approx(7 * (shared // 16 * 16) / total)


def test_templates_it_cannot_use_are_refused_with_a_fix(tokenizers):
    tok = ot.mistral_style()
    tok.chat_template = ot.NO_SYSTEM_TEMPLATE
    problems, _ = check_template(tok, Workload(system_prompt_tokens=200))
    assert len(problems) == 1 and "System role not supported" in problems[0]
    assert "api: completions" in problems[0] and "system_prompt_tokens: 0" in problems[0]
    # without a system prompt that template works
    assert check_template(tok, Workload(system_prompt_tokens=0)) == ([], [])
    tok.chat_template = None
    problems, _ = check_template(tok, Workload())
    assert "no chat template" in problems[0] and "api: completions" in problems[0]
    assert check_template(tok, Workload(api="completions")) == ([], [])


@pytest.mark.parametrize("family", FAMILIES)
def test_every_workload_kind_builds_on_every_family(tokenizers, family):
    tok = tokenizers[family]
    for kind in ("shared_prefix", "mixed", "multi_turn", "random"):
        params = {"kind": kind, "system_prompt_tokens": 64, "question_tokens": 8, "output_tokens": 4,
                  "input_tokens": 64, "long_prompt_tokens": {"uniform": [100, 120]}, "turns": 2,
                  "requests_per_round": 4}
        w = make_workload(tok, Workload(**params))
        assert [r.prompt_tokens > 0 for r in w.requests(4)] == [True] * 4
