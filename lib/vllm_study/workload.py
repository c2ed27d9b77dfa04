"""Requests with exact token lengths: a long system prompt every request shares (what
prefix caching can reuse) plus a short question of its own per request.

Text is built from vocabulary entries that are one token each *and* stay one token in
any sequence: " word" pieces of lowercase letters. Qwen's pre-tokenizer splits text at
every space-led word, so a run of such pieces encodes back to exactly those ids; this
is what makes the lengths exact without a round of encode-and-trim.
"""
from __future__ import annotations

import random
import re
from dataclasses import dataclass

_WORD_PIECE = re.compile(r"^ [a-z]{3,12}$")


@dataclass(frozen=True)
class Request:
    index: int
    messages: list[dict] | None  # for /v1/chat/completions
    prompt: str | None           # for /v1/completions
    prompt_tokens: int           # as the server will count them (chat template included)
    max_tokens: int


def word_pieces(tokenizer) -> list[str]:
    """Vocabulary entries that are a space and 3-12 lowercase letters, one token each."""
    pieces = []
    for tid in range(min(len(tokenizer), 151643)):
        text = tokenizer.decode([tid])
        if _WORD_PIECE.match(text):
            pieces.append(text)
    pieces.sort()  # decode order is id order already; sort makes it explicit and stable
    return pieces


def _text(pieces: list[str], n_tokens: int, rng: random.Random) -> str:
    return "".join(rng.choice(pieces) for _ in range(n_tokens))


class SharedPrefixWorkload:
    """The shared-system-prompt workload: same prefix for every request, distinct tail."""

    def __init__(self, tokenizer, *, api: str, system_prompt_tokens: int,
                 question_tokens: int, output_tokens: int, seed: int):
        self.tok = tokenizer
        self.api = api
        self.output_tokens = output_tokens
        self.question_tokens = question_tokens
        self.seed = seed
        self._pieces = word_pieces(tokenizer)
        # The prefix depends on the seed alone, so every round and point shares it.
        self.system_prompt = _text(self._pieces, system_prompt_tokens, random.Random(seed))

    def _count(self, messages: list[dict] | None, prompt: str | None) -> int:
        if messages is not None:
            prompt = self.tok.apply_chat_template(messages, tokenize=False,
                                                  add_generation_prompt=True)
        return len(self.tok.encode(prompt, add_special_tokens=False))

    def request(self, index: int, stream: str = "measure") -> Request:
        """Request `index` of a stream; warmup and measured requests draw from
        different streams so warmup never pre-caches a measured question."""
        rng = random.Random(f"{self.seed}/{stream}/{index}")
        question = _text(self._pieces, self.question_tokens, rng)
        if self.api == "chat":
            messages = [{"role": "system", "content": self.system_prompt},
                        {"role": "user", "content": question}]
            prompt = None
        else:
            messages, prompt = None, self.system_prompt + question
        return Request(index, messages, prompt, self._count(messages, prompt), self.output_tokens)

    def requests(self, n: int, stream: str = "measure") -> list[Request]:
        return [self.request(i, stream) for i in range(n)]
