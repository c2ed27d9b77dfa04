"""A replayed trace: one request per trace row, with the row's exact prompt length, its
output length as max_tokens, and its prefix blocks as shared text.

Exactness rests on the template being a constant lead-in (L tokens) and tail (T
tokens) around the user content, and on content made of single-token " word" pieces
(workload.word_pieces), so that the rendered prompt is lead + one token per piece +
tail. Block j of the trace covers rendered tokens [j*B, (j+1)*B): its content is the
first B - L pieces of the block's text for j = 0 and B pieces after, so requests that
share their first k ids render the same first k*B tokens. Every built request is
checked token for token against that layout.
"""
from __future__ import annotations

from itertools import islice
from typing import NamedTuple

from ..define.traces import Trace, TraceRequest, read_trace
from .workload import Request, TemplateError, WorkloadBase

WARMUP_MAX_INPUT = 1024  # warmup prompts: the trace's first lengths, capped to keep warmup short
_CHUNK = 32               # requests rendered and checked per tokenizer batch
# What the user content starts with: nothing, or (a template that trims it) a word that
# word_pieces checked pieces stay single tokens after.
ANCHORS = ("", "the")


class _Draft(NamedTuple):
    """A request before rendering: its content as piece indices."""
    index: int
    content: list[int]
    max_tokens: int
    want: int | None      # the trace's input tokens; None: too short to be exact


class TraceWorkload(WorkloadBase):
    """The requests of a trace window; `schedule(speed)` gives their send times."""

    def __init__(self, tokenizer, *, api: str, seed: int, trace: Trace, stream: str = "measure"):
        super().__init__(tokenizer, api, seed)
        self.trace = trace
        # the random stream of rows without prefix ids: priming's rows draw from their own,
        # so they never share content with a measured row of the same index
        self.stream = stream
        self._piece_ids = self._single_ids()
        self._anchor, self._lead, self._tail = self._frame()
        self._blocks: dict[int, list[int]] = {}  # block id -> its piece indices (block_tokens of them)
        self._measured: list[Request] | None = None
        self._batch_ok: bool | None = None  # does the batch encoder agree with WorkloadBase._ids?

    # ------------------------------------------------------------ the template's frame

    def _single_ids(self) -> list[int]:
        """The one token id each piece encodes to after other text (as word_pieces checked)."""
        encoded = self.tok(["the" + c for c in self._pieces], add_special_tokens=False)["input_ids"]
        return [e[-1] for e in encoded]

    def _frame(self) -> tuple[str, list[int], list[int]]:
        """The rendered tokens before the user content (lead) and after it (tail), from two
        prompts that differ only in their content. A template that trims the content
        (Llama 3's) would take the first piece's space: the content then starts with an
        anchor word, which joins the lead. A rendering that still merges pieces with the
        template cannot give exact lengths."""
        seen = []
        for anchor in ANCHORS:
            (a, ia), (b, ib) = [(anchor + self._pieces[i] * 3, self._piece_ids[i]) for i in (0, 1)]
            ra, rb = self._render(None, a), self._render(None, b)
            lead = 0
            while lead < min(len(ra), len(rb)) and ra[lead] == rb[lead]:
                lead += 1
            tail = 0
            while tail < min(len(ra), len(rb)) - lead and ra[-1 - tail] == rb[-1 - tail]:
                tail += 1
            if ra[lead:len(ra) - tail] == [ia] * 3 and rb[lead:len(rb) - tail] == [ib] * 3:
                return anchor, ra[:lead], (ra[len(ra) - tail:] if tail else [])
            seen.append(f"{ra[lead:len(ra) - tail]} for {ia} x 3 after {anchor!r}")
        raise TemplateError(f"the {self.api} rendering does not keep the user content as tokens of its own "
                            f"(content {'; '.join(seen)}): a trace cannot be replayed with exact lengths; "
                            "try the other api")

    @property
    def lead_tokens(self) -> int:
        return len(self._lead)

    @property
    def tail_tokens(self) -> int:
        return len(self._tail)

    @property
    def prompt_floor(self) -> int:
        """The shortest prompt the kit can send: the template's lead-in and tail around
        one content token. A trace's shorter prompts are sent at this length."""
        return len(self._lead) + 1 + len(self._tail)

    # ------------------------------------------------------------ content

    def _block(self, block_id: int) -> list[int]:
        """A prefix block's pieces: a function of (seed, block id) alone, cached."""
        b = self._blocks.get(block_id)
        if b is None:
            rng = self._rng("block", block_id)
            b = self._blocks[block_id] = rng.choices(range(len(self._pieces)), k=self.trace.block_tokens)
        return b

    def _prefix_content(self, prefix: tuple[int, ...], n: int) -> list[int]:
        """n content pieces laid on the trace's blocks: block j's rendered tokens are
        [j*B, (j+1)*B), so its content is what of that range lies after the lead-in."""
        B, L, out = self.trace.block_tokens, len(self._lead), []
        for j, h in enumerate(prefix):
            width = max(0, (j + 1) * B - L) - max(0, j * B - L)
            out += self._block(h)[:min(width, n - len(out))]
            if len(out) == n:
                return out
        raise AssertionError(f"{len(prefix)} prefix ids cover {len(prefix) * B - L} content tokens, not {n}")

    def _own_content(self, n: int, *key) -> list[int]:
        return self._rng(*key).choices(range(len(self._pieces)), k=n)

    def _content_tokens(self, input_tokens: int) -> int:
        """Content tokens for a prompt of input_tokens (below 1: it cannot be exact)."""
        return input_tokens - len(self._lead) - len(self._tail)

    # ------------------------------------------------------------ requests

    def _draft(self, index: int, r: TraceRequest) -> _Draft | Request:
        """What request `index` will carry; a jsonl prompt is final as it is (its length is
        whatever the template makes of it)."""
        if r.prompt is not None:
            return self._request(index, None, r.prompt, r.output_tokens, {})
        n = self._content_tokens(r.input_tokens)
        if n < 1:  # shorter than the template alone: the nearest the kit can send (prompt_floor)
            return _Draft(index, self._own_content(1, self.stream, index), r.output_tokens, None)
        content = (self._prefix_content(r.prefix, n) if r.prefix and self.trace.block_tokens
                   else self._own_content(n, self.stream, index))
        return _Draft(index, content, r.output_tokens, r.input_tokens)

    def _warmup_draft(self, i: int) -> _Draft:
        """Warmup request i: trace row i's lengths (wrapping round), input capped at
        WARMUP_MAX_INPUT, content from a stream of its own (no block of a measured prompt)."""
        r = self.trace.requests[i % len(self.trace.requests)]
        want = min(r.input_tokens, WARMUP_MAX_INPUT)
        n = self._content_tokens(want)
        return _Draft(i, self._own_content(max(1, n), "warmup", i), r.output_tokens, want if n >= 1 else None)

    def _shape(self, text: str) -> tuple[list[dict] | None, str | None]:
        return ([{"role": "user", "content": text}], None) if self.api == "chat" else (None, text)

    def _encode_many(self, shapes: list[tuple]) -> list[list[int]]:
        """WorkloadBase._ids of each (messages, prompt), in one batch: the tokenizer's own Rust
        encoder without offsets, which is what tokenizer.encode runs, ~2x faster; a
        tokenizer without one, or whose batch differs from _ids on the first, goes one
        by one."""
        backend = getattr(self.tok, "backend_tokenizer", None)
        fast = getattr(backend, "encode_batch_fast", None) or getattr(backend, "encode_batch", None)
        if fast is None:
            return [self._ids(m, p) for m, p in shapes]
        texts = [self.tok.apply_chat_template(m, tokenize=False, add_generation_prompt=True) if m is not None else p
                 for m, p in shapes]
        ids = [e.ids for e in fast(texts, add_special_tokens=self.api != "chat")]
        if self._batch_ok is None:
            self._batch_ok = ids[0] == self._ids(*shapes[0])
        return ids if self._batch_ok else [self._ids(m, p) for m, p in shapes]

    def _finish(self, drafts: list) -> list[Request]:
        """Requests from drafts, each rendered and checked token for token against
        lead + one token per piece + tail (and its length against the trace's)."""
        out = list(drafts)
        todo = [k for k, d in enumerate(drafts) if isinstance(d, _Draft)]
        for c in range(0, len(todo), _CHUNK):  # in chunks: 600 x 12k token ids as lists is ~200 MB
            ks = todo[c:c + _CHUNK]
            shapes = [self._shape(self._anchor + "".join(self._pieces[i] for i in drafts[k].content))
                      for k in ks]
            for k, shape, ids in zip(ks, shapes, self._encode_many(shapes)):
                d = drafts[k]
                self._check(d, ids)
                out[k] = Request(d.index, *shape, len(ids), d.max_tokens, {})
        return out

    def _check(self, d: _Draft, ids: list[int]) -> None:
        L, T = len(self._lead), len(self._tail)
        ok = (len(ids) == L + len(d.content) + T and ids[:L] == self._lead and ids[len(ids) - T:] == self._tail
              and ids[L:len(ids) - T] == [self._piece_ids[i] for i in d.content])
        if not ok or (d.want is not None and len(ids) != d.want):
            built = self._lead + [self._piece_ids[i] for i in d.content] + self._tail
            first = next((k for k, (x, y) in enumerate(zip(ids, built)) if x != y), min(len(ids), len(built)))
            raise TemplateError(f"trace request {d.index}: the {self.api} rendering has {len(ids)} tokens where "
                                f"{len(built)} were built (the trace says {d.want}), first different at token "
                                f"{first}: the tokenizer merges ' word' pieces with each other or with the "
                                "template here; try the other api")

    def _all(self) -> list[Request]:
        if self._measured is None:
            self._measured = self._finish([self._draft(i, r) for i, r in enumerate(self.trace.requests)])
        return self._measured

    @property
    def inexact(self) -> int:
        """Measured requests shorter than prompt_floor: sent with 1 content token, so
        longer than the trace says (counted from the lengths: nothing is rendered)."""
        return sum(1 for r in self.trace.requests if r.prompt is None and r.input_tokens < self.prompt_floor)

    def request(self, index: int, stream: str = "measure") -> Request:
        return self._all()[index] if stream == "measure" else self._finish([self._warmup_draft(index)])[0]

    def requests(self, n: int | None = None, stream: str = "measure") -> list[Request]:
        """measure: the window's requests (the first n, where n is given); warmup: n of
        them (the window's length when n is None)."""
        if stream == "measure":
            return list(islice(self._all(), n))
        return self._finish([self._warmup_draft(i) for i in range(len(self.trace.requests) if n is None else n)])

    def schedule(self, speed: float) -> list[float]:
        """Send times in seconds from the round's start: the trace's arrivals / speed."""
        if speed <= 0:
            raise ValueError(f"trace speed must be above 0, not {speed}")
        return [r.t_s / speed for r in self.trace.requests]

    def expected_hit_rate(self) -> float | None:
        """A never-evicting cache's token hit rate on the window (Trace.expected_hit_rate)."""
        return self.trace.expected_hit_rate()

    def fidelity(self, results: list[dict]) -> dict:
        """Does the replay send what the trace says? The trace's input lengths over a
        round's answered requests (client result dicts, by request index), and the
        server's prompt tokens (usage) against them: 0.0 when every prompt was exact."""
        ok = [r for r in results if r.get("error") is None]
        want = sum(self.trace.requests[r["index"]].input_tokens for r in ok)
        sent = sum(r.get("prompt_tokens") or 0 for r in ok)
        return {"trace_prompt_tokens": want if ok else None,
                "prompt_tokens_vs_trace": sent / want - 1 if want else None}



def fitted_workload(tokenizer, w, trace: Trace, max_model_len: int | None) -> tuple[TraceWorkload, dict]:
    """`trace`, less the requests longer than the server allows, as a TraceWorkload of
    params.Workload `w`, and what its start records of it (windows.build lists one a window)."""
    kept, dropped = trace.fit(max_model_len) if max_model_len else (trace, 0)
    wl = TraceWorkload(tokenizer, api=w.api, seed=w.seed, trace=kept)
    return wl, {"source": trace.source, "requests": len(kept.requests), "dropped_over_max_model_len": dropped,
                "inexact": wl.inexact, "rate": kept.rate, "duration_s": kept.duration_s}


def window_workload(tokenizer, w, max_model_len: int | None) -> tuple[TraceWorkload, dict]:
    """params.Workload `w`'s one trace window as a fitted workload, and the start's trace
    record (windows.build does the same for trace.windows)."""
    wl, fitted = fitted_workload(tokenizer, w, read_trace(w.trace), max_model_len)
    return wl, {**fitted, "format": w.trace.format, "start_s": w.trace.start_s, "max_model_len": max_model_len,
                "skipped": wl.trace.skipped, "prompt_floor": wl.prompt_floor}
