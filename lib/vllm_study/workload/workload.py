"""Requests with exact token lengths: a long system prompt every request shares (what
prefix caching can reuse) plus a short question of its own per request.

Text is built from " word" pieces that the model's own tokenizer turns into one token
each, and keeps one token each in any sequence (checked by encode/decode round trips,
so any tokenizer works: byte-level BPE as in Qwen and Llama 3, or SentencePiece-style
as in Mistral). Each request's prompt length is counted on the prompt as the server
renders it (chat template included), so the recorded lengths are exact.
"""
from __future__ import annotations

import random
import re
import weakref
from dataclasses import dataclass, field, replace

from ..define.params import sample_length

_WORD = re.compile(r"[a-z]{3,12}")
MAX_PIECES = 8192  # enough variety; bounds the round-trip check on large vocabularies


class TemplateError(ValueError):
    """The model's chat template cannot render what the workload needs; says how to fix."""


@dataclass(frozen=True)
class Request:
    index: int
    messages: list[dict] | None  # for /v1/chat/completions
    prompt: str | None           # for /v1/completions
    prompt_tokens: int           # as the server will count them (chat template included)
    max_tokens: int
    tags: dict = field(default_factory=dict)  # what the report groups by: class, turn, step


def word_pieces(tokenizer) -> list[str]:
    """" word" strings (3-12 lowercase letters) that encode to one token each and stay
    one token each when repeated after other text: found by decoding every ordinary
    token id and checking each candidate with an encode round trip."""
    special = set(tokenizer.all_special_ids)
    ids = [[i] for i in range(len(tokenizer)) if i not in special]
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", True):
        # the Rust decoder's own batch: what batch_decode returns where it cleans up nothing,
        # in a quarter of the CPU (batch_decode converts and decodes the ids one by one, about
        # a second of every start's workload)
        texts = backend.decode_batch(ids, skip_special_tokens=False)
    else:
        texts = tokenizer.batch_decode(ids)
    words = {t.strip() for t in texts}
    candidates = sorted(" " + w for w in words if _WORD.fullmatch(w))
    if len(candidates) > MAX_PIECES:  # an even, deterministic sample
        step = len(candidates) / MAX_PIECES
        candidates = [candidates[int(k * step)] for k in range(MAX_PIECES)]
    lead = tokenizer.encode("the", add_special_tokens=False)
    # (no candidates: skip the call, which fails on an empty batch in transformers 5)
    encoded = tokenizer(["the" + c * 3 for c in candidates], add_special_tokens=False)["input_ids"] \
        if candidates else []
    pieces = [c for c, e in zip(candidates, encoded)
              if len(e) == len(lead) + 3 and e[:len(lead)] == lead and e[-1] == e[-2] == e[-3]]
    if len(pieces) < 100:
        raise TemplateError(f"the tokenizer has only {len(pieces)} single-token ' word' pieces "
                            "(100 or more are needed to build prompts of exact length)")
    return pieces


# word_pieces takes seconds (every token decoded); a tokenizer's pieces never change, and
# the simulator builds a workload per simulated start (priming's too) from one tokenizer
_PIECES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _pieces_of(tokenizer) -> list[str]:
    try:
        pieces = _PIECES.get(tokenizer)
    except TypeError:  # a tokenizer that cannot be weakly referenced
        return word_pieces(tokenizer)
    if pieces is None:
        pieces = _PIECES[tokenizer] = word_pieces(tokenizer)
    return pieces


def random_text(pieces: list[str], n_tokens: int, rng: random.Random) -> str:
    return "".join(rng.choice(pieces) for _ in range(n_tokens))


class WorkloadBase:
    """Shared by every workload: exact-length text, the chat/completions shape, and a
    random stream per (seed, stream name, request index) so every request replays."""

    def __init__(self, tokenizer, api: str, seed: int):
        self.tok, self.api, self.seed = tokenizer, api, seed
        self._pieces = _pieces_of(tokenizer)

    def _rng(self, *key) -> random.Random:
        return random.Random("/".join(map(str, (self.seed, *key))))

    def _ids(self, messages: list[dict] | None, prompt: str | None) -> list[int]:
        """The prompt's token ids as vLLM's server makes them: chat requests render the
        template and add no special tokens; completions add them (a BOS, where the
        tokenizer has one)."""
        if messages is not None:
            text = self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            return self.tok.encode(text, add_special_tokens=False)
        return self.tok.encode(prompt, add_special_tokens=True)

    def _count(self, messages: list[dict] | None, prompt: str | None) -> int:
        return len(self._ids(messages, prompt))

    def _render(self, system: str | None, user: str) -> list[int]:
        if self.api == "chat":
            sys_msg = [{"role": "system", "content": system}] if system is not None else []
            return self._ids(sys_msg + [{"role": "user", "content": user}], None)
        return self._ids(None, (system or "") + user)

    def shared_prefix_tokens(self, system: str) -> int:
        """Tokens two requests with this system prompt share, whatever the template does:
        the common prefix of two prompts that differ only in their question."""
        a, b = self._render(system, " alpha beta"), self._render(system, " gamma delta")
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        return n

    def _request(self, index: int, system: str | None, user: str, max_tokens: int, tags: dict,
                 history: list[dict] = ()) -> Request:
        """system None: no system message (the chat template then adds its default one)."""
        if self.api == "chat":
            messages = ([{"role": "system", "content": system}] if system is not None else []) + list(history) + [
                {"role": "user", "content": user}]
            prompt = None
        else:
            messages, prompt = None, (system or "") + user
        return Request(index, messages, prompt, self._count(messages, prompt), max_tokens, tags)

    def requests(self, n: int, stream: str = "measure") -> list[Request]:
        """Requests 0..n-1 of a stream; warmup and measured requests draw from different
        streams so warmup never pre-caches a measured question."""
        return [self.request(i, stream) for i in range(n)]


class SharedPrefixWorkload(WorkloadBase):
    """Long system prompts shared by requests (what prefix caching reuses) plus a short
    question of each request's own. `prefixes` distinct prompts are used round-robin:
    together with their length they set the hit rate a perfect cache would reach."""

    def __init__(self, tokenizer, *, api: str, system_prompt_tokens: int, question_tokens,
                 output_tokens, seed: int, prefixes: int = 1):
        super().__init__(tokenizer, api, seed)
        self.question_tokens, self.output_tokens = question_tokens, output_tokens
        # The prefixes depend on the seed alone, so every round and point shares them.
        self.system_prompts = [random_text(self._pieces, system_prompt_tokens,
                                     random.Random(seed) if p == 0 else self._rng("prefix", p))
                               for p in range(prefixes)]
        self.system_prompt = self.system_prompts[0]

    def request(self, index: int, stream: str = "measure") -> Request:
        rng = self._rng(stream, index)
        question = random_text(self._pieces, sample_length(self.question_tokens, rng), rng)
        p = index % len(self.system_prompts)
        tags = {"prefix": p} if len(self.system_prompts) > 1 else {}
        return self._request(index, self.system_prompts[p], question,
                             sample_length(self.output_tokens, rng), tags)

    def expected_hit_rate(self, n: int, block_size: int) -> float:
        """What a cache that never evicts would hit on n requests: every request after the
        first of its prefix reuses the prefix's full blocks (the chat template's lead-in
        included, the request's own text not)."""
        reqs = self.requests(n)
        shared = [self.shared_prefix_tokens(s) // block_size * block_size for s in self.system_prompts]
        seen, hits = set(), 0
        for r in reqs:
            p = self.prefix_of(r)
            if p is None:  # a request that shares nothing
                continue
            hits += shared[p] if p in seen else 0
            seen.add(p)
        return hits / sum(r.prompt_tokens for r in reqs)

    def prefix_of(self, r: Request) -> int | None:
        """Which shared system prompt a request carries (None: none)."""
        return r.index % len(self.system_prompts)


class MixedWorkload(SharedPrefixWorkload):
    """Long documents beside short chats: a `long_fraction` of requests carry a
    document of `long_prompt_tokens` (its own text, no shared prefix); the rest are
    shared-prefix chats. Tagged class=long / class=short (or, as the eviction workload,
    cold / shared)."""

    def __init__(self, tokenizer, *, long_fraction: float, long_prompt_tokens,
                 classes: tuple[str, str] = ("short", "long"), **kw):
        super().__init__(tokenizer, **kw)
        self.long_fraction, self.long_prompt_tokens = long_fraction, long_prompt_tokens
        self.shared_class, self.long_class = classes

    def request(self, index: int, stream: str = "measure") -> Request:
        rng = self._rng(stream, "class", index)
        if rng.random() >= self.long_fraction:
            r = super().request(index, stream)
            return replace(r, tags={**r.tags, "class": self.shared_class})
        doc = random_text(self._pieces, sample_length(self.long_prompt_tokens, rng), rng)
        return self._request(index, None, doc, sample_length(self.output_tokens, rng), {"class": self.long_class})

    def prefix_of(self, r: Request) -> int | None:
        return None if r.tags.get("class") == self.long_class else super().prefix_of(r)


class RandomWorkload(WorkloadBase):
    """Prompts of random text (no shared prefix) with input and output lengths drawn
    from the params' distributions."""

    def __init__(self, tokenizer, *, api: str, input_tokens, output_tokens, seed: int):
        super().__init__(tokenizer, api, seed)
        self.input_tokens, self.output_tokens = input_tokens, output_tokens

    def request(self, index: int, stream: str = "measure") -> Request:
        rng = self._rng(stream, index)
        text = random_text(self._pieces, sample_length(self.input_tokens, rng), rng)
        return self._request(index, None, text, sample_length(self.output_tokens, rng), {})


class MultiTurnWorkload(SharedPrefixWorkload):
    """Conversations: each turn resends the whole history (system prompt, earlier
    questions and the answers the server actually gave) plus a new question. A
    conversation is a list of turns built one at a time, as the answers arrive."""

    def __init__(self, tokenizer, *, turns: int, **kw):
        super().__init__(tokenizer, **kw)
        self.turns = turns

    def _question(self, stream: str, conversation: int, t: int) -> str:
        rng = self._rng(stream, conversation, t)
        return random_text(self._pieces, sample_length(self.question_tokens, rng), rng)

    def turn(self, conversation: int, t: int, answers: list[str], stream: str = "measure") -> Request:
        """Turn t (0-based) of a conversation, given the answers to turns 0..t-1."""
        history = []
        for i, a in enumerate(answers[:t]):
            history += [{"role": "user", "content": self._question(stream, conversation, i)},
                        {"role": "assistant", "content": a}]
        max_tokens = sample_length(self.output_tokens, self._rng(stream, conversation, t, "out"))
        system = self.system_prompts[conversation % len(self.system_prompts)]
        return self._request(conversation * self.turns + t, system, self._question(stream, conversation, t),
                             max_tokens, {"turn": t + 1, "conversation": conversation}, history)

    def request(self, index: int, stream: str = "measure") -> Request:
        """First turns only (what warmup sends)."""
        return self.turn(index, 0, [], stream)
