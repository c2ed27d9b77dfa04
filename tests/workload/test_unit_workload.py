"""The shared-prefix workload with the real Qwen tokenizer the kit builds: exact token
lengths, shared system prompt, distinct questions, determinism; word pieces found by
round trips on any tokenizer; whether a chat template can render the workload."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from offline_tokenizers import WithBos
from transformers import AutoTokenizer

from vllm_study.define import models
from vllm_study.define.params import ModelSpec
from vllm_study.workload.build_workload import check_template
from vllm_study.workload.workload import MAX_PIECES, SharedPrefixWorkload, TemplateError, word_pieces

SYS, QUESTION, OUT = 1600, 32, 64


@pytest.fixture(scope="module")
def tok(qwen_dir):
    # loaded from the folder, as vLLM loads it
    return AutoTokenizer.from_pretrained(str(qwen_dir))


@pytest.fixture(scope="module")
def pieces(qwen_pieces):
    return list(qwen_pieces)


@pytest.fixture(scope="module", autouse=True)
def _pieces_once(pieces):
    """word_pieces decodes the whole vocabulary (~1 s); every workload here gets the list
    computed once above (test_word_pieces_are_single_tokens checks that list)."""
    import vllm_study.workload.workload as workload
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

def test_tokenizer_is_qwen(tok, qwen_dir):
    assert tok.encode("Hello world!") == [9707, 1879, 0]
    assert len(tok) == 151936
    cfg = json.loads((qwen_dir / "config.json").read_text())
    assert cfg["vocab_size"] == len(tok)
    assert tok.convert_tokens_to_ids("<|im_end|>") == cfg["eos_token_id"] == 151645
    assert tok.convert_tokens_to_ids("<|endoftext|>") == cfg["bos_token_id"] == 151643
    assert (qwen_dir / ".complete").read_text().split()[0] == "tiny-qwen2"


def test_chat_template_is_chatml(tok):
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                   add_generation_prompt=True)
    assert text == ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
                    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert _template_overhead(tok) == 13


def test_word_pieces_are_single_tokens(tok, pieces):
    # an even sample of at most MAX_PIECES candidates, most of which pass the round trip
    assert 4000 < len(pieces) <= MAX_PIECES
    assert len(set(pieces)) == len(pieces)
    assert pieces == sorted(pieces)
    sample = pieces[:: len(pieces) // 200]
    for p in sample:
        assert p.startswith(" ") and p[1:].isalpha() and p[1:].islower() and 3 <= len(p) - 1 <= 12
        assert len(tok.encode(p, add_special_tokens=False)) == 1
    # and stay one token each inside a run of them
    assert len(tok.encode("".join(sample), add_special_tokens=False)) == len(sample)
    # the whole vocabulary is searched, not only the low ids
    ids = [tok.encode(p, add_special_tokens=False)[0] for p in sample]
    assert max(ids) > 100000


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
    # grid._check_point budgets 32 tokens for the template; the real one needs 13
    assert _template_overhead(tok) <= 32


def test_completions_count_the_bos_token_and_chat_does_not(tok):
    """vLLM's /v1/completions tokenizes the prompt with special tokens (a BOS where the
    tokenizer has one); a chat prompt is rendered by the template and not given another."""
    bos = WithBos(tok)
    comp = _workload(bos, "completions").request(0)
    assert comp.prompt_tokens == SYS + QUESTION + 1
    chat = _workload(bos, "chat").request(0)
    assert chat.prompt_tokens == SYS + QUESTION + _template_overhead(tok)
    # the same prompts without the BOS wrapper
    assert _workload(tok, "completions").request(0).prompt_tokens == SYS + QUESTION


def test_shared_prefix_tokens_is_the_common_prefix_of_rendered_prompts(tok):
    comp = _workload(tok, "completions")
    assert comp.shared_prefix_tokens(comp.system_prompt) == SYS
    chat = _workload(tok, "chat")
    # "<|im_start|>system\n" + the prompt + "<|im_end|>\n" + "<|im_start|>user\n"
    assert chat.shared_prefix_tokens(chat.system_prompt) == 3 + SYS + 2 + 3
    a, b = (tok.encode(tok.apply_chat_template(r.messages, tokenize=False, add_generation_prompt=True),
                       add_special_tokens=False) for r in chat.requests(2))
    common = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
    assert chat.shared_prefix_tokens(chat.system_prompt) <= common
    # a BOS is shared too
    bos = _workload(WithBos(tok), "completions")
    assert bos.shared_prefix_tokens(bos.system_prompt) == SYS + 1


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
    from vllm_study.define.params import Workload
    return Workload.model_validate(kw)


def test_mixed_workload_long_documents_beside_short_chats(tok):
    from vllm_study.workload.build_workload import make_workload
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
    from vllm_study.workload.build_workload import make_workload
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
    from vllm_study.workload.build_workload import make_workload
    one = make_workload(tok, _spec(system_prompt_tokens=1600, question_tokens=32))
    four = make_workload(tok, _spec(system_prompt_tokens=1600, question_tokens=32, prefixes=4))
    assert len({r.messages[0]["content"] for r in four.requests(8)}) == 4
    assert [r.tags["prefix"] for r in four.requests(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    # 64 requests, blocks of 128: the shared part rounds down to 1536 of its 1600+ tokens
    per = one.requests(1)[0].prompt_tokens
    assert one.expected_hit_rate(64, 128) == pytest.approx(63 * 1536 / (64 * per))
    assert four.expected_hit_rate(64, 128) == pytest.approx(60 * 1536 / (64 * per))


def test_multi_turn_resends_the_history(tok):
    from vllm_study.workload.build_workload import make_workload
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


def test_word_pieces_through_the_rust_decoder_are_batch_decodes(tok, pieces):
    """The Rust decoder's batch (the kit's path for a tokenizer that cleans up nothing) finds
    the same pieces as transformers' batch_decode: the prompts of every committed run stay."""
    class Plain:  # the tokenizer without its backend: word_pieces takes batch_decode
        all_special_ids = tok.all_special_ids
        __len__ = lambda self: len(tok)  # noqa: E731
        batch_decode = staticmethod(tok.batch_decode)
        encode = staticmethod(tok.encode)
        __call__ = lambda self, *a, **kw: tok(*a, **kw)  # noqa: E731
    assert tok.clean_up_tokenization_spaces is False and word_pieces(Plain()) == pieces


# ---------------------------------------------------------------- word pieces on any tokenizer

class _Greedy:
    """A tokenizer with a made-up vocabulary, longest match first: enough of the
    transformers interface for word_pieces."""

    def __init__(self, vocab: list[str], special: list[int]):
        self.vocab, self.all_special_ids = vocab, special
        self.ids = {t: i for i, t in enumerate(vocab)}

    def __len__(self):
        return len(self.vocab)

    def batch_decode(self, seqs):
        return ["".join(self.vocab[i] for i in seq) for seq in seqs]

    def encode(self, text, add_special_tokens=False):
        out, i = [], 0
        while i < len(text):
            piece = max((t for t in self.vocab if text.startswith(t, i)), key=len)
            out.append(self.ids[piece])
            i += len(piece)
        return out

    def __call__(self, texts, add_special_tokens=False):
        return {"input_ids": [self.encode(t) for t in texts]}


def _words(n: int) -> list[str]:
    return ["wor" + chr(97 + i // 26) + chr(97 + i % 26) for i in range(n)]


def _greedy(n_words: int, merging: int = 0) -> _Greedy:
    words = _words(n_words)
    vocab = ["<s>", " ", "t", "h", "e", "the", "Hello", " ab", " x1y", " <s>"] + [" " + w for w in words]
    vocab += [f" {w} {w}" for w in words[:merging]]  # these merge when repeated
    return _Greedy(vocab, special=[0])


def test_word_pieces_by_round_trip_on_another_tokenizer():
    tok = _greedy(150, merging=10)
    pieces = word_pieces(tok)
    # words of 3-12 lowercase letters only; a piece that merges with itself is left out
    assert pieces == sorted(" " + w for w in _words(150)[10:])


def test_word_pieces_sample_large_vocabularies_evenly(monkeypatch):
    import vllm_study.workload.workload as workload
    monkeypatch.setattr(workload, "MAX_PIECES", 120)
    pieces = word_pieces(_greedy(300))
    # 120 of the 301 candidates are checked: " the" (decoded from "the"; there is no
    # " the" token) is one of them and fails the round trip
    assert len(pieces) == 119 and pieces == sorted(pieces)
    assert pieces[0] == " worab" and pieces[-1] == " worll"  # spread over the whole range
    assert pieces == word_pieces(_greedy(300))  # deterministic


@pytest.mark.parametrize("n_words", [0, 99])
def test_too_few_word_pieces_is_a_template_error(n_words):
    with pytest.raises(TemplateError, match=f"only {n_words} single-token ' word' pieces"):
        word_pieces(_greedy(n_words))


# ---------------------------------------------------------------- check_template

SYSTEM_LAST = ("{% for m in messages %}{% if m['role'] != 'system' %}<|im_start|>{{ m['role'] }}\n"
               "{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
               "{% for m in messages %}{% if m['role'] == 'system' %}<|im_start|>system\n{{ m['content'] }}"
               "<|im_end|>\n{% endif %}{% endfor %}<|im_start|>assistant\n")
NO_SYSTEM_ROLE = ("{% for m in messages %}{% if m['role'] == 'system' %}"
                  "{{ raise_exception('System role not supported') }}{% endif %}"
                  "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                  "<|im_start|>assistant\n")


def test_check_template_accepts_chatml(tok):
    assert check_template(tok, _spec()) == ([], [])
    assert check_template(tok, _spec(kind="multi_turn", turns=2, requests_per_round=4)) == ([], [])


def test_check_template_without_a_template(tok, monkeypatch):
    monkeypatch.setattr(tok, "chat_template", None)
    problems, warnings = check_template(tok, _spec())
    assert len(problems) == 1 and warnings == []
    assert "has no chat template" in problems[0] and "workload.api: completions" in problems[0]
    # completions need no template
    assert check_template(tok, _spec(api="completions")) == ([], [])


def test_check_template_that_refuses_a_system_message(tok, monkeypatch):
    monkeypatch.setattr(tok, "chat_template", NO_SYSTEM_ROLE)
    (problem,), warnings = check_template(tok, _spec())
    assert warnings == []
    assert problem.startswith("the chat template fails on a system + user conversation (")
    assert "System role not supported" in problem
    assert problem.endswith("use workload.api: completions, or system_prompt_tokens: 0")
    # without a system prompt it renders
    assert check_template(tok, _spec(system_prompt_tokens=0)) == ([], [])


def test_check_template_that_puts_the_question_before_the_system_prompt(tok, monkeypatch):
    monkeypatch.setattr(tok, "chat_template", SYSTEM_LAST)
    problems, (warning,) = check_template(tok, _spec())
    assert problems == []
    assert "puts per-request text before the system prompt" in warning
    assert "prefix caching cannot reuse it" in warning
    assert "the 64-token system prompt alone is 64" in warning
    # random prompts share nothing anyway: no warning
    assert check_template(tok, _spec(kind="random")) == ([], [])


def test_check_template_reports_too_few_word_pieces(monkeypatch):
    import vllm_study.workload.workload as workload
    monkeypatch.setattr(workload, "word_pieces", word_pieces)  # the real one, on this tokenizer
    (problem,), warnings = check_template(_greedy(20), _spec(api="completions"))
    assert "only 20 single-token ' word' pieces" in problem and warnings == []


# ---------------------------------------------------------------- models: folders, configs

def test_card_resolves_to_a_built_folder_in_the_cache(qwen_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_STUDY_CACHE", str(tmp_path))
    assert models.cache_dir() == tmp_path / "models"
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "tiny-qwen2").symlink_to(qwen_dir)  # built already: reused, not rebuilt
    mtime = (qwen_dir / "tokenizer.json").stat().st_mtime
    assert models.resolve(ModelSpec()) == (str(tmp_path / "models" / "tiny-qwen2"), True)
    assert (qwen_dir / "tokenizer.json").stat().st_mtime == mtime
    assert models.resolve(ModelSpec(path="org/name")) == ("org/name", False)


def test_cache_dir_default(monkeypatch):
    monkeypatch.delenv("VLLM_STUDY_CACHE", raising=False)
    assert models.cache_dir() == Path.home() / ".cache" / "vllm_study" / "models"


def test_local_config_and_max_positions(tmp_path):
    assert models.max_positions(ModelSpec()) == 8192                  # the tiny-qwen2 card
    assert models.local_config(ModelSpec(card="qwen2.5-7b"))["hidden_size"] == 3584
    assert models.max_positions(ModelSpec(card="qwen2.5-7b")) == 32768
    (tmp_path / "config.json").write_text('{"max_position_embeddings": 4096}')
    assert models.max_positions(ModelSpec(path=str(tmp_path))) == 4096
    assert models.local_config(ModelSpec(path=str(tmp_path / "nope"))) is None
    assert models.max_positions(ModelSpec(path="org/name")) is None    # a hub id: not readable here
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text("{not json")
    assert models.local_config(ModelSpec(path=str(tmp_path / "bad"))) is None


def test_check_path(tmp_path, monkeypatch):
    assert models.check_path(ModelSpec()) is None                      # a card
    (tmp_path / "config.json").write_text("{}")
    assert models.check_path(ModelSpec(path=str(tmp_path))) is None
    empty = tmp_path / "empty"
    empty.mkdir()
    assert models.check_path(ModelSpec(path=str(empty))) == f"model.path {empty} has no config.json"
    why = models.check_path(ModelSpec(path=str(tmp_path / "missing")))
    assert "is not a folder on this machine" in why
    assert "is not a folder" in models.check_path(ModelSpec(path="./models/x"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    assert models.check_path(ModelSpec(path="Qwen/Qwen2.5-7B-Instruct")) is None  # a hub id: vLLM fetches it


def test_eviction_workload_tags_shared_and_cold_and_expects_hits_only_from_shared(tok):
    """kind eviction: chats sharing a system prompt (class shared) among long distinct
    prompts (class cold); a never-evicting cache would hit the shared prefix of every
    shared request after the first, and nothing of a cold one."""
    from vllm_study.define.params import Workload
    from vllm_study.workload.build_workload import make_workload
    w = make_workload(tok, Workload(kind="eviction", system_prompt_tokens=512, question_tokens=8, output_tokens=4,
                                    long_fraction=0.5, long_prompt_tokens={"uniform": [600, 800]}))
    reqs = w.requests(20)
    classes = [r.tags["class"] for r in reqs]
    assert set(classes) == {"shared", "cold"}
    shared = [r for r in reqs if r.tags["class"] == "shared"]
    prefix = w.shared_prefix_tokens(w.system_prompt) // 16 * 16
    want = (len(shared) - 1) * prefix / sum(r.prompt_tokens for r in reqs)
    assert w.expected_hit_rate(20, 16) == pytest.approx(want)
    assert [w.prefix_of(r) is None for r in reqs] == [c == "cold" for c in classes]
