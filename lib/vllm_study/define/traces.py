"""Public LLM serving traces read as they were published: arrival times, exact input and
output lengths and (Mooncake, the kit's jsonl) prefix blocks, cut to a window.

Formats (`params.TRACE_FORMATS`):
- mooncake (JSONL): `timestamp` in milliseconds, `input_length`, `output_length`,
  `hash_ids`: one id per 512-token prefix block, `ceil(input_length / 512)` of them;
  requests whose lists start with the same k ids share their first k x 512 tokens.
- azure (CSV, Azure LLM inference 2023/2024): `TIMESTAMP,ContextTokens,GeneratedTokens`.
- burstgpt (CSV): `Timestamp` (seconds), `Request tokens`, `Response tokens`, ...;
  failed requests (0 response tokens) are skipped and counted.
- jsonl (the kit's own): `t_s`, `input_tokens`, `output_tokens`, optional `prefix`
  (block ids of `trace.block_tokens` tokens, Mooncake's rule) or `prompt` (sent as is).

Files may be gzipped (found by their magic bytes, not their name). Every error names
the file and the 1-based line and says how to fix it.
"""
from __future__ import annotations

import csv
import difflib
import gzip
import io
import json
import math
import re
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from functools import lru_cache
from itertools import pairwise
from pathlib import Path

MOONCAKE_BLOCK = 512
DATA = Path(__file__).parent / "data" / "traces"


class TraceError(ValueError):
    """A trace file or window the kit cannot replay; names the file, the line and the fix."""


@dataclass(frozen=True)
class TraceRequest:
    t_s: float                       # seconds from the window's first request (the first is 0.0)
    input_tokens: int
    output_tokens: int
    prefix: tuple[int, ...] | None   # prefix block ids, block_tokens tokens each
    prompt: str | None               # a jsonl row's own text, sent as is
    line: int                        # 1-based line in the file (the record's last line for CSV)


@dataclass(frozen=True)
class Trace:
    requests: list[TraceRequest]
    block_tokens: int | None         # tokens per prefix id; None: the trace has no prefix ids
    source: str                      # the file and the window, for reports
    skipped: dict[str, int] = field(default_factory=dict)  # reason -> rows left out

    @property
    def duration_s(self) -> float:
        """The last arrival (the first is at 0): 0.0 for a single request."""
        return self.requests[-1].t_s if self.requests else 0.0

    @property
    def rate(self) -> float:
        """Arrivals per second of real time: (n - 1) / duration_s, the mean of the n - 1
        gaps' inverse (n / duration would count the first arrival, which has no gap).
        inf when every request arrives at once (one request, or one timestamp)."""
        n = len(self.requests)
        return (n - 1) / self.duration_s if self.duration_s > 0 else math.inf

    def fit(self, max_model_len: int) -> tuple[Trace, int]:
        """The requests a server with this max_model_len can serve (prompt + output within
        it), re-based to start at 0, and how many were dropped."""
        kept = [r for r in self.requests if r.input_tokens + r.output_tokens <= max_model_len]
        dropped = len(self.requests) - len(kept)
        if not dropped:
            return self, 0
        if not kept:
            raise TraceError(f"{self.source}: every one of its {dropped} requests is longer than "
                             f"max_model_len {max_model_len} (prompt + output); raise max_model_len "
                             "or pick another window")
        t0 = kept[0].t_s
        skipped = {**self.skipped, f"longer than max_model_len {max_model_len}": dropped}
        return replace(self, requests=[replace(r, t_s=r.t_s - t0) for r in kept], skipped=skipped), dropped

    def expected_hit_rate(self) -> float | None:
        """The token hit rate of a prefix cache that never evicts, at the trace's block
        granularity: a request reuses its leading blocks whose ids earlier requests of the
        window carried (ids are prefix-chained, so a seen id means its whole prefix was
        seen), but never its last token (the server always computes one). A block seen
        only as a shorter, partial last block counts as unseen past that length (on a
        consistent trace, Mooncake's, partial ids recur only as the same partial block).
        None: the window has no prefix ids."""
        if self.block_tokens is None or not any(r.prefix for r in self.requests):
            return None
        B, seen = self.block_tokens, {}  # block id -> the most of its tokens an earlier request had
        hits = total = 0
        for r in self.requests:
            sizes = [min(B, r.input_tokens - j * B) for j in range(len(r.prefix or ()))]
            reused = 0
            for h, size in zip(r.prefix or (), sizes):
                if seen.get(h, 0) < size:
                    break
                reused += size
            hits += min(reused, r.input_tokens - 1)
            total += r.input_tokens
            for h, size in zip(r.prefix or (), sizes):
                seen[h] = max(seen.get(h, 0), size)
        return hits / total


def floor_warning(short: int, of: int, floor: int) -> str:
    """The words for a trace's prompts shorter than the template allows (the dry run,
    the sweep and the report say the same)."""
    return (f"{short} of {of} trace prompts are shorter than the chat template's floor of {floor} tokens "
            f"(its lead-in and tail around one content token): they are sent as {floor} tokens, longer than "
            "the trace says; use workload.api: completions (a shorter floor) or another window")


@dataclass(frozen=True)
class ShippedTrace:
    """A window of a public trace that ships with the kit (cut by tools/cut_trace_windows.py)."""
    format: str
    file: str            # the file in data/traces
    original: str        # the full trace's file name in the traces folder the tool reads
    source: str          # repository @ commit, path
    licence: str
    licence_file: str
    requests: int        # the first N requests of the original
    span_s: float        # last arrival - first, in the window

    @property
    def path(self) -> Path:
        return DATA / self.file

    @property
    def attribution(self) -> str:
        return (f"{self.source}, {self.licence} ({self.licence_file}); "
                f"first {self.requests} requests ({self.span_s:.1f} s), unchanged")


_MOONCAKE = "kvcache-ai/Mooncake @ 3b5a594, FAST25-release/traces/"
_AZURE = "Azure/AzurePublicDataset @ b469a11, data/"
SHIPPED: dict[str, ShippedTrace] = {
    "mooncake_conversation": ShippedTrace(
        "mooncake", "mooncake_conversation.jsonl.gz", "mooncake_conversation_trace.jsonl.gz",
        _MOONCAKE + "conversation_trace.jsonl", "Apache-2.0", "LICENSE-mooncake-Apache-2.0.txt", 600, 200.999),
    "mooncake_synthetic": ShippedTrace(
        "mooncake", "mooncake_synthetic.jsonl.gz", "mooncake_synthetic_trace.jsonl.gz",
        _MOONCAKE + "synthetic_trace.jsonl", "Apache-2.0", "LICENSE-mooncake-Apache-2.0.txt", 400, 109.429),
    "azure_conv": ShippedTrace(
        "azure", "azure_conv.csv.gz", "AzureLLMInferenceTrace_conv.csv.gz",
        _AZURE + "AzureLLMInferenceTrace_conv.csv (2023)", "CC-BY-4.0", "LICENSE-azure-CC-BY-4.0.txt",
        1000, 216.027393),
    "azure_code": ShippedTrace(
        "azure", "azure_code.csv.gz", "AzureLLMInferenceTrace_code.csv.gz",
        _AZURE + "AzureLLMInferenceTrace_code.csv (2023)", "CC-BY-4.0", "LICENSE-azure-CC-BY-4.0.txt",
        1000, 521.588576),
}


# ---------------------------------------------------------------- reading a file

@contextmanager
def _open_text(path: Path, label: str) -> Iterator[io.TextIOBase]:
    """Text of a plain or gzipped file (told by its magic bytes, not its name); a UTF-8
    byte-order mark is dropped; newlines are left to the csv module (newline="")."""
    try:
        raw = path.open("rb")
    except OSError as e:
        raise TraceError(f"{label}: cannot read it ({e}); check trace.file") from None
    with raw, (gzip.GzipFile(fileobj=raw) if raw.peek(2)[:2] == b"\x1f\x8b" else nullcontext(raw)) as data:
        yield io.TextIOWrapper(data, encoding="utf-8-sig", newline="")


def _err(label: str, line: int, what: str, fix: str) -> TraceError:
    return TraceError(f"{label} line {line}: {what}; {fix}")


def _length(label, line, name, value, fix) -> int:
    """A token count: a whole number of at least 1."""
    if isinstance(value, bool) or not isinstance(value, int) and not (isinstance(value, float) and value.is_integer()):
        raise _err(label, line, f"{name} is {value!r}, not a whole number", fix)
    if value < 1:
        raise _err(label, line, f"{name} is {value}, not a positive token count", fix)
    return int(value)


def _seconds(label, line, name, value, fix) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise _err(label, line, f"{name} is {value!r}, not a number", fix)
    return float(value)


def _prefix(label, line, name, ids, input_tokens, block, fix) -> tuple[int, ...]:
    """Prefix block ids: whole numbers, one per `block` tokens of the prompt."""
    if not isinstance(ids, list) or not all(isinstance(h, int) and not isinstance(h, bool) for h in ids):
        raise _err(label, line, f"{name} is not a list of whole numbers", fix)
    need = math.ceil(input_tokens / block)
    if len(ids) != need:
        raise _err(label, line, f"{len(ids)} {name} for {input_tokens} input tokens, which needs "
                   f"ceil({input_tokens}/{block}) = {need} (one id per {block}-token block)", fix)
    return tuple(ids)


def _json_rows(f, label: str, fmt: str):
    """(line, object) per non-blank line."""
    first = True
    for line, text in enumerate(f, 1):
        if not text.strip():
            continue
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as e:
            other = _sniff(text) if first else None
            if other not in (None, fmt):
                raise _err(label, line, f"not JSON: this looks like {_a(other)} file",
                           f"set trace.format: {other}") from None
            # json's own position counts lines of this one line: a line cut short is
            # "line 2 column 1", which would contradict the file's line number
            cut = e.pos >= len(text.rstrip()) or e.msg.startswith("Unterminated string")
            what = ("the line ends before its object does (cut short?)" if cut else
                    f"{e.msg.removesuffix(' at')} at character {e.pos + 1}")
            raise _err(label, line, f"not JSON ({what})", "each line must be one JSON object") from None
        first = False
        if not isinstance(obj, dict):
            raise _err(label, line, f"a JSON {type(obj).__name__}, not an object", "each line must be one "
                       "JSON object")
        yield line, obj


def _need(label, line, obj: dict, keys, fmt: str):
    for k in keys:
        if k not in obj:
            raise _err(label, line, f"missing key {k!r}", f"a {fmt} row has {', '.join(keys)}" + _hint(obj, fmt))


def _hint(keys, fmt: str) -> str:
    other = _other_format(keys)
    return f"; this looks like {_a(other)} file: set trace.format: {other}" if other not in (None, fmt) else ""


def _a(fmt: str) -> str:
    return ("an " if fmt[0] in "aeiou" else "a ") + fmt


def _sniff(first_line: str) -> str | None:
    """The format a file's first line says it is in: a JSON object's keys, or a CSV
    header's columns (None: neither that the kit knows)."""
    text = first_line.strip()
    if text.startswith("{"):
        try:
            obj = json.loads(text)
        except json.JSONDecodeError:
            return None
        return _other_format(obj) if isinstance(obj, dict) else None
    return _other_format(c.strip() for c in next(csv.reader([text]), []))


def _other_format(row) -> str | None:
    """The format whose keys a row has, to say so when trace.format is wrong."""
    keys = set(row)
    for fmt, k in (("mooncake", "input_length"), ("jsonl", "input_tokens"), ("azure", "ContextTokens"),
                   ("burstgpt", "Request tokens")):
        if k in keys:
            return fmt
    return None


def _parse_mooncake(f, label, block_tokens):
    fix = "a Mooncake row is {\"timestamp\": ms, \"input_length\": n, \"output_length\": n, \"hash_ids\": [...]}"
    for line, o in _json_rows(f, label, "mooncake"):
        _need(label, line, o, ("timestamp", "input_length", "output_length", "hash_ids"), "mooncake")
        n = _length(label, line, "input_length", o["input_length"], fix)
        yield TraceRequest(_seconds(label, line, "timestamp", o["timestamp"], fix) / 1000, n,
                           _length(label, line, "output_length", o["output_length"], fix),
                           _prefix(label, line, "hash_ids", o["hash_ids"], n, MOONCAKE_BLOCK, fix), None, line)


_JSONL_KEYS = ("t_s", "input_tokens", "output_tokens", "prefix", "prompt")


def _parse_jsonl(f, label, block_tokens):
    fix = "a jsonl row is {\"t_s\": s, \"input_tokens\": n, \"output_tokens\": n} plus an optional " \
          "\"prefix\": [block ids] or \"prompt\": text"
    for line, o in _json_rows(f, label, "jsonl"):
        _need(label, line, o, _JSONL_KEYS[:3], "jsonl")
        extra = [k for k in o if k not in _JSONL_KEYS]
        if extra:
            close = difflib.get_close_matches(extra[0], _JSONL_KEYS, n=1)
            raise _err(label, line, f"unknown key {extra[0]!r}" + (f" (did you mean {close[0]!r}?)" if close else ""),
                       fix)
        n = _length(label, line, "input_tokens", o["input_tokens"], fix)
        prefix, prompt = o.get("prefix"), o.get("prompt")
        if prefix is not None and prompt is not None:
            raise _err(label, line, "both `prefix` and `prompt`", "give one: block ids, or the text itself")
        if prefix is not None:
            if block_tokens is None:
                raise _err(label, line, "`prefix` block ids but trace.block_tokens is not set",
                           "set trace.block_tokens to the tokens each id stands for (Mooncake's are 512)")
            prefix = _prefix(label, line, "prefix ids", prefix, n, block_tokens, fix)
        if prompt is not None and not isinstance(prompt, str):
            raise _err(label, line, f"`prompt` is a {type(prompt).__name__}, not a text", fix)
        yield TraceRequest(_seconds(label, line, "t_s", o["t_s"], fix), n,
                           _length(label, line, "output_tokens", o["output_tokens"], fix), prefix, prompt, line)


def _csv_rows(f, label, columns: tuple[str, ...], fmt: str):
    """(line, row dict) per CSV record, after checking the header has `columns`."""
    reader = csv.DictReader(f)
    header = reader.fieldnames or []
    missing = [c for c in columns if c not in header]
    if missing and header and header[0].lstrip().startswith("{"):  # a JSON line read as CSV: not its "header"
        other = _sniff(",".join(header))
        looks = f": this looks like {_a(other)} file" if other else ""
        raise _err(label, 1, "a JSON object, not a CSV header" + looks, f"set trace.format: {other}" if other
                   else f"a {fmt} trace is CSV with the header {','.join(columns)}")
    if missing:
        raise _err(label, 1, f"the header has no column {missing[0]!r} (it has {', '.join(header) or 'nothing'})",
                   f"a {fmt} trace's header has {', '.join(columns)}" + _hint(header, fmt))
    for row in reader:
        if not any(row.values()):
            continue
        yield reader.line_num, row


def _int(label, line, name, text, fix) -> int:
    try:
        value = int(text)
    except (TypeError, ValueError):
        raise _err(label, line, f"{name} is {text!r}, not a whole number", fix) from None
    return _length(label, line, name, value, fix)


_FRACTION = re.compile(r"\.(\d+)")


def _azure_time(label, line, text, fix) -> float:
    """POSIX seconds of an Azure timestamp: 2023's are naive with 7 fractional digits
    (read as UTC), 2024's end in +00:00; fromisoformat takes exactly 6 digits on
    Python 3.10, so the fraction is cut or padded to 6."""
    iso = _FRACTION.sub(lambda m: "." + (m.group(1) + "000000")[:6], (text or "").strip(), count=1)
    try:
        t = datetime.fromisoformat(iso.replace("Z", "+00:00"))
    except ValueError:
        raise _err(label, line, f"TIMESTAMP {text!r} is not a date and time", fix) from None
    return (t if t.tzinfo else t.replace(tzinfo=timezone.utc)).timestamp()


def _parse_azure(f, label, block_tokens):
    cols = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
    fix = "an Azure row is TIMESTAMP,ContextTokens,GeneratedTokens, e.g. 2023-11-16 18:15:46.6805900,374,44"
    for line, row in _csv_rows(f, label, cols, "azure"):
        yield TraceRequest(_azure_time(label, line, row["TIMESTAMP"], fix),
                           _int(label, line, "ContextTokens", row["ContextTokens"], fix),
                           _int(label, line, "GeneratedTokens", row["GeneratedTokens"], fix), None, None, line)


BURSTGPT_FAILED = "failed (0 output tokens)"


def _parse_burstgpt(f, label, block_tokens):
    """Failed requests (BurstGPT's mark: 0 response tokens) come back with output_tokens 0,
    so the window can count those it skips."""
    cols = ("Timestamp", "Request tokens", "Response tokens")
    fix = "a BurstGPT row has Timestamp (seconds), Model, Request tokens, Response tokens, Total tokens, Log Type"
    for line, row in _csv_rows(f, label, cols, "burstgpt"):
        try:
            t = float(row["Timestamp"])
        except (TypeError, ValueError):
            raise _err(label, line, f"Timestamp is {row['Timestamp']!r}, not a number of seconds", fix) from None
        failed = (row["Response tokens"] or "").strip() == "0"
        yield TraceRequest(t, _int(label, line, "Request tokens", row["Request tokens"], fix),
                           0 if failed else _int(label, line, "Response tokens", row["Response tokens"], fix),
                           None, None, line)


_PARSERS = {"mooncake": _parse_mooncake, "azure": _parse_azure, "burstgpt": _parse_burstgpt, "jsonl": _parse_jsonl}


@lru_cache(maxsize=16)
def _parse_file(path: str, mtime_ns: int, fmt: str, block_tokens: int | None, label: str) -> tuple[TraceRequest, ...]:
    """Every row of a file, sorted by arrival (stably) and timed from the first. Cached:
    a sweep reads the same trace at every point (mtime_ns in the key re-reads a file
    that changed)."""
    with _open_text(Path(path), label) as f:
        try:
            rows = list(_PARSERS[fmt](f, label, block_tokens))
        except (UnicodeDecodeError, EOFError, OSError, csv.Error) as e:  # OSError: a broken gzip stream
            raise TraceError(f"{label}: cannot read it as {fmt} text ({type(e).__name__}: {e}); check the file "
                             "and trace.format") from None
    if not any(r.output_tokens for r in rows):
        raise TraceError(f"{label}: no requests in it" + (f" ({len(rows)} failed ones)" if rows else "")
                         + "; check trace.file")
    if any(a.t_s > b.t_s for a, b in pairwise(rows)):
        rows.sort(key=lambda r: r.t_s)  # stable: equal arrivals keep the file's order
    t0 = rows[0].t_s
    return tuple(replace(r, t_s=r.t_s - t0) for r in rows)


# ---------------------------------------------------------------- the window

def _locate(spec) -> tuple[Path, str]:
    """The file of trace.file (a path, or a shipped window's name) and its label in errors.
    With trace.windows, a shipped name is its whole trace (the windows are cut from it)."""
    if spec.file in SHIPPED:
        s = SHIPPED[spec.file]
        p = DATA / s.original if getattr(spec, "windows", None) else s.path
        return p, p.name
    p = Path(spec.file).expanduser()
    if not p.is_file():
        raise TraceError(f"{spec.file}: no such file; trace.file is a path or a shipped window "
                         f"({', '.join(SHIPPED)})")
    return p, spec.file


def _window(rows, spec, label) -> tuple[list[TraceRequest], int]:
    """Requests from start_s on: the first `requests` of them, those before
    start_s + duration_s, or all; timed from the window's first. Also how many failed
    rows (output_tokens 0) arrived within the window's span: skipped, not replayed."""
    later = [r for r in rows if r.t_s >= spec.start_s]
    ok = [r for r in later if r.output_tokens]
    span = f"the trace has {sum(1 for r in rows if r.output_tokens)} requests over 0 to {rows[-1].t_s:.1f} s"
    if spec.requests is not None:
        if len(ok) < spec.requests:
            raise TraceError(f"{label}: the window asks for {spec.requests} requests from start_s {spec.start_s:g} "
                             f"but {len(ok)} arrive from then on ({span}); lower trace.requests or trace.start_s")
        chosen = ok[:spec.requests]
    elif spec.duration_s is not None:
        chosen = [r for r in ok if r.t_s < spec.start_s + spec.duration_s]
    else:
        chosen = ok
    if not chosen:
        end = f" to {spec.start_s + spec.duration_s:g} s" if spec.duration_s is not None else " on"
        raise TraceError(f"{label}: the window from {spec.start_s:g} s{end} selects no request ({span}); "
                         "move trace.start_s into that span or widen trace.duration_s")
    failed = sum(1 for r in later if not r.output_tokens and r.t_s <= chosen[-1].t_s)
    t0 = chosen[0].t_s
    return [replace(r, t_s=r.t_s - t0) for r in chosen], failed


def _block_tokens(spec, label) -> int | None:
    """Tokens per prefix id: Mooncake's are 512 by definition; jsonl's are trace.block_tokens."""
    if spec.format == "mooncake":
        if spec.block_tokens not in (None, MOONCAKE_BLOCK):
            raise TraceError(f"{label}: Mooncake's hash_ids stand for {MOONCAKE_BLOCK}-token blocks, not "
                             f"{spec.block_tokens}; leave trace.block_tokens out")
        return MOONCAKE_BLOCK
    return spec.block_tokens if spec.format == "jsonl" else None


def read_trace(spec) -> Trace:
    """The window of the trace that params.TraceSpec `spec` names."""
    path, label = _locate(spec)
    block = _block_tokens(spec, label)
    rows = _parse_file(str(path.resolve()), path.stat().st_mtime_ns, spec.format, block, label)
    requests, failed = _window(rows, spec, label)
    cap = spec.max_output_tokens
    if cap is not None:
        requests = [replace(r, output_tokens=min(r.output_tokens, cap)) for r in requests]
    window = (f"{len(requests)} requests from {spec.start_s:g} s" if spec.requests is not None else
              f"{spec.start_s:g} s to {spec.start_s + spec.duration_s:g} s" if spec.duration_s is not None else
              f"from {spec.start_s:g} s" if spec.start_s else "whole file")
    if cap is not None:
        window += f", outputs capped at {cap} tokens"
    return Trace(requests, block if any(r.prefix for r in requests) else None,
                 f"{label} ({spec.format}, {window})", {BURSTGPT_FAILED: failed} if failed else {})


def read_whole(spec) -> Trace:
    """All of the file that trace.windows cuts its windows from (a shipped name's whole
    original), outputs capped as the spec says."""
    return read_trace(spec.model_copy(update={"requests": None, "duration_s": None, "start_s": 0.0}))


def read_history(spec) -> list[TraceRequest]:
    """The rows of the same file before the window's start_s (failed rows left out), in
    arrival order, timed as in the file: what trace.prime: history sends first."""
    path, label = _locate(spec)
    rows = _parse_file(str(path.resolve()), path.stat().st_mtime_ns, spec.format, _block_tokens(spec, label), label)
    return [r for r in rows if r.t_s < spec.start_s and r.output_tokens]
