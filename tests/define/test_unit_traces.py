"""Trace replay: the shipped windows parse to the rows `zcat` shows, every format the kit
reads (Mooncake, Azure 2023/2024, BurstGPT, the kit's jsonl), bad input refused with
the file and line, windows, fit, the expected hit rate; and the replayed prompts with
the real Qwen tokenizer: exact lengths, and requests that share k block ids share
exactly k blocks of rendered tokens, for api chat and completions."""
from __future__ import annotations

import gzip
import json
import math
from pathlib import Path

import pytest
from offline_tokenizers import WithBos
from transformers import AutoTokenizer

from vllm_study.define import traces
from vllm_study.workload import workload
from vllm_study.define.params import TraceSpec
from vllm_study.workload.trace_workload import WARMUP_MAX_INPUT, TraceWorkload
from vllm_study.define.traces import SHIPPED, Trace, TraceError, TraceRequest, read_trace
from vllm_study.workload.workload import word_pieces
from paths import REPO

FULL_TRACES = REPO.parent / "shared" / "traces"


def _spec(file, **kw) -> TraceSpec:
    return TraceSpec(file=str(file), **kw)


def _write(path: Path, text: str, gz: bool = False, bom: bool = False) -> Path:
    data = (b"\xef\xbb\xbf" if bom else b"") + text.encode()
    path.write_bytes(gzip.compress(data) if gz else data)
    return path


def _trace(rows, block=None) -> Trace:
    """A hand-made trace: rows of (t_s, input, output, prefix)."""
    return Trace([TraceRequest(t, n, o, tuple(p) if p else None, None, i + 1)
                  for i, (t, n, o, p) in enumerate(rows)], block, "hand-made", {})


# ---------------------------------------------------------------- the shipped windows

def test_mooncake_conversation_first_and_last_rows():
    # zcat mooncake_conversation.jsonl.gz | head -2, and its line 600
    t = read_trace(TraceSpec(file="mooncake_conversation"))
    assert len(t.requests) == 600 and t.block_tokens == 512 and t.skipped == {}
    a, b = t.requests[:2]
    assert (a.t_s, a.input_tokens, a.output_tokens, a.prefix, a.line) == (0.0, 6758, 500, tuple(range(14)), 1)
    assert (b.t_s, b.input_tokens, b.output_tokens, b.prefix) == (0.0, 7322, 490, (0, *range(14, 28)))
    last = t.requests[-1]
    assert (last.t_s, last.input_tokens, last.output_tokens, last.line) == (200.999, 2352, 14, 600)
    assert last.prefix[:4] == (0, 13708, 13709, 13710) and len(last.prefix) == math.ceil(2352 / 512)
    # timestamps are milliseconds, on the conversation trace's ~3 s grid
    assert sorted({r.t_s for r in t.requests})[:4] == [0.0, 3.0, 5.999, 9.0]
    assert t.duration_s == 200.999 and t.rate == pytest.approx(599 / 200.999)
    assert all(r.prompt is None for r in t.requests)


def test_mooncake_synthetic_first_row():
    t = read_trace(TraceSpec(file="mooncake_synthetic"))
    assert len(t.requests) == 400 and t.duration_s == pytest.approx(109.429)
    r = t.requests[0]
    assert (r.input_tokens, r.output_tokens, r.prefix) == (40160, 6, tuple(range(79)))


def test_azure_first_rows():
    # 2023-11-16 18:15:46.6805900,374,44 / 18:15:50.9951690,396,109 / 18:15:51.2224670,879,55
    conv = read_trace(TraceSpec(file="azure_conv"))
    assert len(conv.requests) == 1000 and conv.block_tokens is None and conv.expected_hit_rate() is None
    assert [(r.input_tokens, r.output_tokens) for r in conv.requests[:3]] == [(374, 44), (396, 109), (879, 55)]
    assert [r.t_s for r in conv.requests[:3]] == pytest.approx([0.0, 4.314579, 4.541877], abs=1e-6)
    assert [r.line for r in conv.requests[:2]] == [2, 3]  # line 1 is the header
    # 2023-11-16 18:17:03.9799600,4808,10 / 18:17:04.0319600,3180,8 / ...,110,27; the last 18:25:45.5685360,94,54
    code = read_trace(TraceSpec(file="azure_code"))
    assert [(r.input_tokens, r.output_tokens) for r in code.requests[:3]] == [(4808, 10), (3180, 8), (110, 27)]
    assert code.requests[1].t_s == pytest.approx(0.052, abs=1e-6)
    assert (code.requests[-1].input_tokens, code.requests[-1].output_tokens) == (94, 54)
    assert code.duration_s == pytest.approx(8 * 60 + 45.568536 - 3.97996)  # 18:17:03.97996 to 18:25:45.568536


def test_shipped_windows_files_licences_attribution():
    readme = (traces.DATA / "README.md").read_text()
    for name, s in SHIPPED.items():
        t = read_trace(TraceSpec(file=name))
        assert s.path.is_file() and s.path.stat().st_size < 200_000
        assert (traces.DATA / s.licence_file).is_file()
        assert len(t.requests) == s.requests and t.duration_s == pytest.approx(s.span_s, abs=1e-6)
        assert TraceSpec(file=name).format == s.format
        line = s.attribution
        assert "\n" not in line and "@" in line and s.licence in line and f"first {s.requests} requests" in line
        assert s.file in readme and line in readme
    assert SHIPPED["mooncake_conversation"].licence == "Apache-2.0"
    assert SHIPPED["azure_conv"].licence == "CC-BY-4.0"


@pytest.mark.skipif(not FULL_TRACES.is_dir(), reason="the full traces are not beside the repository")
def test_shipped_windows_are_the_originals_first_rows_byte_for_byte():
    for s in SHIPPED.values():
        header = 1 if s.format == "azure" else 0
        with gzip.open(FULL_TRACES / s.original, "rb") as f:
            want = b"".join(line for _, line in zip(range(header + s.requests), f))
        assert gzip.decompress(s.path.read_bytes()) == want
        assert s.path.read_bytes()[4:8] == b"\0\0\0\0"  # gzip mtime 0: re-cutting gives the same file


def test_parsed_files_are_cached():
    traces._parse_file.cache_clear()
    read_trace(TraceSpec(file="azure_code"))
    read_trace(TraceSpec(file="azure_code", requests=10))
    info = traces._parse_file.cache_info()
    assert (info.misses, info.hits) == (1, 1)


# ---------------------------------------------------------------- other formats

def test_azure_2024_timestamps_and_bom(tmp_path):
    f = _write(tmp_path / "az24.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\r\n"
               "2024-05-10 00:00:00.009930+00:00,2162,5\r\n2024-05-10 00:00:01.5+00:00,10,1\r\n", bom=True)
    t = read_trace(_spec(f, format="azure"))
    assert [(r.t_s, r.input_tokens, r.output_tokens) for r in t.requests] == [
        (0.0, 2162, 5), (pytest.approx(1.49007), 10, 1)]


def test_burstgpt_skips_and_counts_failed_requests(tmp_path):
    f = _write(tmp_path / "burst.csv", "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
               "5,ChatGPT,472,18,490,Conversation log\n"
               "7,ChatGPT,1087,0,1087,Conversation log\n"       # failed
               "45,GPT-4,417,235,652,API log\n"
               "6,ChatGPT,30,2,32,Conversation log\n", gz=True)  # out of order: sorted
    t = read_trace(_spec(f, format="burstgpt"))
    assert [(r.t_s, r.input_tokens, r.output_tokens, r.line) for r in t.requests] == [
        (0.0, 472, 18, 2), (1.0, 30, 2, 5), (40.0, 417, 235, 4)]
    assert t.skipped == {"failed (0 output tokens)": 1} and t.block_tokens is None
    # a window that ends before the failed request does not count it
    assert read_trace(_spec(f, format="burstgpt", requests=2)).skipped == {}


def test_jsonl_prefix_prompt_and_sorting(tmp_path):
    rows = [{"t_s": 2.5, "input_tokens": 40, "output_tokens": 3, "prefix": [0, 1, 2]},
            {"t_s": 1.0, "input_tokens": 20, "output_tokens": 4, "prefix": [0, 5]},
            {"t_s": 1.0, "input_tokens": 7, "output_tokens": 2, "prompt": "hello there"},
            {"t_s": 3.0, "input_tokens": 9, "output_tokens": 1}]
    f = _write(tmp_path / "t.jsonl", "".join(json.dumps(r) + "\n" for r in rows) + "\n")
    t = read_trace(_spec(f, format="jsonl", block_tokens=16))
    # sorted by time, stably: the two at 1.0 keep the file's order
    assert [r.line for r in t.requests] == [2, 3, 1, 4]
    assert [r.t_s for r in t.requests] == [0.0, 0.0, 1.5, 2.0]
    assert t.requests[0].prefix == (0, 5) and t.requests[1].prompt == "hello there"
    assert t.requests[3].prefix is None and t.block_tokens == 16
    assert t.rate == pytest.approx(3 / 2.0)


# ---------------------------------------------------------------- bad input

def _mooncake_row(ts=0, n=2000, out=5, ids=None):
    return json.dumps({"timestamp": ts, "input_length": n, "output_length": out,
                       "hash_ids": list(range(math.ceil(n / 512))) if ids is None else ids})


GOOD = [_mooncake_row(0), _mooncake_row(1000)]


@pytest.mark.parametrize("bad, match", [
    (_mooncake_row(ids=[1, 2, 3]), r"line 3: 3 hash_ids for 2000 input tokens, which needs ceil\(2000/512\) = 4"),
    ('{"timestamp": 5, "input_length": 10,', r"line 3: not JSON \("),
    ('{"timestamp": 5, "input_length": 10, "hash_ids": [0]}', r"line 3: missing key 'output_length'"),
    (_mooncake_row(out=0), r"line 3: output_length is 0, not a positive token count"),
    (_mooncake_row(n=-4, ids=[]), r"line 3: input_length is -4, not a positive token count"),
    (_mooncake_row(out="5"), r"line 3: output_length is '5', not a whole number"),
    ('[1, 2]', r"line 3: a JSON list, not an object"),
    ('{"t_s": 0, "input_tokens": 5, "output_tokens": 1}',
     r"line 3: missing key 'timestamp'.*this looks like a jsonl file: set trace\.format: jsonl"),
])
def test_bad_mooncake_rows_name_the_line(tmp_path, bad, match):
    f = _write(tmp_path / "mooncake_x.jsonl.gz", "\n".join(GOOD + [bad]) + "\n", gz=True)
    with pytest.raises(TraceError, match=r"mooncake_x\.jsonl\.gz " + match):
        read_trace(_spec(f, format="mooncake"))


@pytest.mark.parametrize("row, match", [
    ('{"t_s": 1, "input_tokens": 40, "output_tokens": 2, "prefix": [0, 1]}',
     r"line 2: 2 prefix ids for 40 input tokens, which needs ceil\(40/16\) = 3"),
    ('{"t_s": 1, "input_tokens": 40, "output_tokens": 2, "prefix": [0, 1, 2], "prompt": "x"}',
     r"line 2: both `prefix` and `prompt`"),
    ('{"t_s": 1, "input_tokens": 40, "output_tokens": 2, "prefx": [0, 1, 2]}',
     r"line 2: unknown key 'prefx' \(did you mean 'prefix'\?\)"),
    ('{"t_s": "soon", "input_tokens": 40, "output_tokens": 2}', r"line 2: t_s is 'soon', not a number"),
    ('{"t_s": 1, "input_tokens": 0, "output_tokens": 2}', r"line 2: input_tokens is 0"),
])
def test_bad_jsonl_rows_name_the_line(tmp_path, row, match):
    f = _write(tmp_path / "k.jsonl", '{"t_s": 0, "input_tokens": 5, "output_tokens": 1}\n' + row + "\n")
    with pytest.raises(TraceError, match=match):
        read_trace(_spec(f, format="jsonl", block_tokens=16))


def test_jsonl_prefix_needs_block_tokens(tmp_path):
    f = _write(tmp_path / "k.jsonl", '{"t_s": 0, "input_tokens": 5, "output_tokens": 1, "prefix": [3]}\n')
    with pytest.raises(TraceError, match=r"k\.jsonl line 1: `prefix` block ids but trace\.block_tokens is not set; "
                                         r"set trace\.block_tokens"):
        read_trace(_spec(f, format="jsonl"))


@pytest.mark.parametrize("body, match", [
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,374,44\nyesterday,5,5\n",
     r"az\.csv line 3: TIMESTAMP 'yesterday' is not a date and time"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,374,-1\n",
     r"az\.csv line 2: GeneratedTokens is -1, not a positive token count"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,lots,4\n",
     r"az\.csv line 2: ContextTokens is 'lots', not a whole number"),
    ("TIMESTAMP,Context,Generated\n2023-11-16 18:15:46.6805900,374,44\n",
     r"az\.csv line 1: the header has no column 'ContextTokens'"),
    ("Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n5,ChatGPT,472,18,490,x\n",
     r"az\.csv line 1: the header has no column 'TIMESTAMP'.*this looks like a burstgpt file: "
     r"set trace\.format: burstgpt"),
])
def test_bad_azure_rows_name_the_line(tmp_path, body, match):
    f = _write(tmp_path / "az.csv", body)
    with pytest.raises(TraceError, match=match):
        read_trace(_spec(f, format="azure"))


def test_a_line_cut_short_says_so_with_the_file_line_alone(tmp_path):
    """json's own "line 2 column 1" (the newline after a cut line) would contradict the file's line."""
    f = _write(tmp_path / "m.jsonl", "\n".join(GOOD + ['{"timestamp": 5, "input_length": 10,', GOOD[0]]) + "\n")
    with pytest.raises(TraceError) as e:
        read_trace(_spec(f, format="mooncake"))
    assert "m.jsonl line 3: not JSON (the line ends before its object does" in str(e.value)
    assert "line 2" not in str(e.value) and "column" not in str(e.value)
    g = _write(tmp_path / "n.jsonl", GOOD[0] + "\n" + '{"timestamp": 5, x}\n')
    with pytest.raises(TraceError, match=r"n\.jsonl line 2: not JSON \(Expecting property name enclosed in "
                                         r"double quotes at character 18\)"):
        read_trace(_spec(g, format="mooncake"))


AZURE_ROWS = "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,374,44\n"


@pytest.mark.parametrize("body, name, fmt, match", [
    ("\n".join(GOOD) + "\n", "m.jsonl", "azure",
     r"m\.jsonl line 1: a JSON object, not a CSV header: this looks like a mooncake file; "
     r"set trace\.format: mooncake$"),
    ("\n".join(GOOD) + "\n", "m.jsonl", "burstgpt", r"this looks like a mooncake file; set trace\.format: mooncake$"),
    (AZURE_ROWS, "a.csv", "mooncake", r"a\.csv line 1: not JSON: this looks like an azure file; "
                                      r"set trace\.format: azure$"),
    (AZURE_ROWS, "a.csv", "jsonl", r"this looks like an azure file; set trace\.format: azure$"),
    ('{"t_s": 0, "input_tokens": 5, "output_tokens": 1}\n', "k.jsonl", "azure",
     r"this looks like a jsonl file; set trace\.format: jsonl$"),
])
def test_a_file_in_another_format_is_named_by_what_it_looks_like(tmp_path, body, name, fmt, match):
    with pytest.raises(TraceError, match=match) as e:
        read_trace(_spec(_write(tmp_path / name, body), format=fmt))
    assert "timestamp" not in str(e.value)  # the JSON line is not quoted back as "the header"


def test_max_output_tokens_caps_the_window_outputs_only():
    spec = dict(file="mooncake_conversation", requests=50)
    whole, capped = read_trace(TraceSpec(**spec)), read_trace(TraceSpec(**spec, max_output_tokens=16))
    assert max(r.output_tokens for r in whole.requests) > 16
    assert [r.output_tokens for r in capped.requests] == [min(r.output_tokens, 16) for r in whole.requests]
    assert [(r.t_s, r.input_tokens, r.prefix) for r in capped.requests] == \
        [(r.t_s, r.input_tokens, r.prefix) for r in whole.requests]
    assert "outputs capped at 16 tokens" in capped.source


def test_a_missing_file_and_a_wrong_mooncake_block(tmp_path):
    with pytest.raises(TraceError, match=r"nope\.jsonl: no such file; .*mooncake_conversation"):
        read_trace(_spec(tmp_path / "nope.jsonl", format="jsonl"))
    with pytest.raises(TraceError, match=r"512-token blocks, not 16; leave trace\.block_tokens out"):
        read_trace(TraceSpec(file="mooncake_conversation", block_tokens=16))


def test_a_window_that_selects_nothing_says_the_span_and_size():
    with pytest.raises(TraceError, match=r"mooncake_conversation\.jsonl\.gz: the window from 500 s on selects no "
                                         r"request \(the trace has 600 requests over 0 to 201\.0 s\)"):
        read_trace(TraceSpec(file="mooncake_conversation", start_s=500))
    with pytest.raises(TraceError, match=r"asks for 700 requests from start_s 0 but 600 arrive"):
        read_trace(TraceSpec(file="mooncake_conversation", requests=700))


# ---------------------------------------------------------------- windows, fit, hit rate

def _raw_mooncake():
    with gzip.open(SHIPPED["mooncake_conversation"].path, "rt") as f:
        return [json.loads(line) for line in f]


def test_window_by_requests_and_by_duration():
    raw = _raw_mooncake()
    t = read_trace(TraceSpec(file="mooncake_conversation", start_s=30, requests=5))
    later = [r for r in raw if r["timestamp"] >= 30_000][:5]
    assert [r.input_tokens for r in t.requests] == [r["input_length"] for r in later]
    assert t.requests[0].t_s == 0.0
    assert [r.t_s for r in t.requests] == pytest.approx([(r["timestamp"] - later[0]["timestamp"]) / 1000
                                                         for r in later])
    d = read_trace(TraceSpec(file="mooncake_conversation", start_s=30, duration_s=9))
    inside = [r for r in raw if 30_000 <= r["timestamp"] < 39_000]
    assert [r.line for r in d.requests] == [raw.index(r) + 1 for r in inside]
    assert d.duration_s == (inside[-1]["timestamp"] - inside[0]["timestamp"]) / 1000
    assert "30 s to 39 s" in d.source


def test_single_request_window():
    t = read_trace(TraceSpec(file="azure_conv", requests=1))
    assert t.duration_s == 0.0 and t.rate == math.inf


def test_fit_drops_and_counts():
    t = _trace([(0.0, 100, 10, None), (1.0, 5000, 100, None), (2.5, 200, 20, None), (4.0, 8000, 1, None)])
    kept, dropped = t.fit(4096)
    assert dropped == 2 and [r.input_tokens for r in kept.requests] == [100, 200]
    assert kept.skipped == {"longer than max_model_len 4096": 2}
    assert t.fit(10_000) == (t, 0)
    kept, _ = _trace([(1.0, 9000, 1, None), (3.0, 10, 1, None)]).fit(4096)
    assert kept.requests[0].t_s == 0.0  # re-based on the first kept request
    with pytest.raises(TraceError, match="every one of its 1 requests is longer than max_model_len 16"):
        _trace([(0.0, 100, 1, None)]).fit(16)
    mooncake = read_trace(TraceSpec(file="mooncake_conversation"))
    kept, dropped = mooncake.fit(32768)
    assert dropped == 50 and len(kept.requests) == 550  # zcat | awk: 50 rows over 32768


def test_expected_hit_rate_by_hand():
    t = _trace([(0, 8, 1, [1, 2]),        # new: 0
                (1, 10, 1, [1, 2, 3]),    # ids 1, 2 seen: 8
                (2, 8, 1, [1, 2]),        # the same prompt again: all but its last token, 7
                (3, 3, 1, [5]),           # new: 0
                (4, 6, 1, [5, 6]),        # id 5 seen only as a 3-token partial block: 0
                (5, 9, 1, None)], block=4)  # no prefix ids: 0
    assert t.expected_hit_rate() == pytest.approx((8 + 7) / (8 + 10 + 8 + 3 + 6 + 9))
    assert _trace([(0, 8, 1, None)]).expected_hit_rate() is None


def test_expected_hit_rate_of_the_mooncake_window():
    raw = _raw_mooncake()
    seen, hits = set(), 0
    for r in raw:  # Mooncake's rule, computed here independently of the kit
        k = next((j for j, h in enumerate(r["hash_ids"]) if h not in seen), len(r["hash_ids"]))
        hits += min(k * 512, r["input_length"] - 1)
        seen.update(r["hash_ids"])
    want = hits / sum(r["input_length"] for r in raw)
    got = read_trace(TraceSpec(file="mooncake_conversation")).expected_hit_rate()
    assert got == pytest.approx(want) and got == pytest.approx(0.1716, abs=1e-4)


# ---------------------------------------------------------------- the replayed prompts

@pytest.fixture(scope="module")
def tok(qwen_dir, qwen_pieces):
    """The real Qwen tokenizer; word_pieces, which decodes the whole vocabulary, ran once
    (tests/conftest.py) and every workload here gets its list."""
    tokenizer = AutoTokenizer.from_pretrained(str(qwen_dir))
    with pytest.MonkeyPatch.context() as mp:  # other tokenizers get their own
        mp.setattr(workload, "word_pieces", lambda t: list(qwen_pieces) if t is tokenizer else word_pieces(t))
        yield tokenizer


# real rows of the conversation window: pairs sharing 2 to 26 blocks (133/66, 137/1, 218/21,
# 134/10, 191/30, 240/170) and, through id 0, 1 block with every other
ROWS = [0, 1, 3, 10, 13, 16, 21, 30, 66, 133, 134, 137, 170, 191, 218, 240]


@pytest.fixture(scope="module")
def mooncake_rows() -> Trace:
    t = read_trace(TraceSpec(file="mooncake_conversation"))
    return Trace([t.requests[i] for i in ROWS], 512, "rows of mooncake_conversation", {})


def _shared_ids(a, b) -> int:
    return next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


@pytest.mark.parametrize("api", ["chat", "completions"])
def test_prompts_are_exact_and_share_exactly_their_blocks(tok, mooncake_rows, api):
    w = TraceWorkload(tok, api=api, seed=0, trace=mooncake_rows)
    reqs = w.requests()
    assert w.inexact == 0 and len(reqs) == len(ROWS)
    ids = []
    for r, row in zip(reqs, mooncake_rows.requests):
        assert r.prompt_tokens == row.input_tokens == w._count(r.messages, r.prompt)  # as the server counts
        assert r.max_tokens == row.output_tokens and r.tags == {}
        assert (r.messages is None) == (api == "completions")
        ids.append(w._ids(r.messages, r.prompt))
    B, T, pairs = 512, w.tail_tokens, 0
    for i in range(len(reqs)):
        for j in range(i):
            pa, pb = mooncake_rows.requests[i].prefix, mooncake_rows.requests[j].prefix
            k = _shared_ids(pa, pb)
            end = min(len(ids[i]), len(ids[j])) - T  # where the shorter one's content ends
            assert k >= 1 and end > k * B  # every pair here goes on past its shared blocks
            assert ids[i][:k * B] == ids[j][:k * B]
            # block k is each request's own text (or the tail): different as a whole
            assert ids[i][k * B:min(end, (k + 1) * B)] != ids[j][k * B:min(end, (k + 1) * B)]
            pairs += k >= 2
    assert pairs == 6


def test_chat_lead_in_and_tail_are_the_template(tok, mooncake_rows):
    w = TraceWorkload(tok, api="chat", seed=0, trace=mooncake_rows)
    assert tok.decode(w._lead) == "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
    assert tok.decode(w._tail) == "<|im_end|>\n<|im_start|>assistant\n"
    c = TraceWorkload(tok, api="completions", seed=0, trace=mooncake_rows)
    assert (c.lead_tokens, c.tail_tokens) == (0, 0)


def test_blocks_depend_on_seed_and_id_only(tok, mooncake_rows):
    a = TraceWorkload(tok, api="chat", seed=0, trace=mooncake_rows).requests()
    b = TraceWorkload(tok, api="chat", seed=0, trace=mooncake_rows).requests()
    c = TraceWorkload(tok, api="chat", seed=1, trace=mooncake_rows).requests()
    assert [r.messages for r in a] == [r.messages for r in b]
    assert a[0].messages != c[0].messages and a[0].prompt_tokens == c[0].prompt_tokens


def test_small_blocks_and_a_bos_token(tok):
    """Blocks smaller than the chat lead-in (14 tokens), and a completions BOS: the
    rendered block boundaries are still the trace's."""
    B = 8
    t = _trace([(0, 40, 2, [0, 1, 2, 3, 4]), (1, 30, 2, [0, 1, 2, 9]), (2, 45, 2, [0, 1, 7, 8, 10, 11])], block=B)
    for w in (TraceWorkload(tok, api="chat", seed=0, trace=t),
              TraceWorkload(WithBos(tok), api="completions", seed=0, trace=t)):
        ids = [w._ids(r.messages, r.prompt) for r in w.requests()]
        assert [len(i) for i in ids] == [40, 30, 45]
        # request 1's 4th block holds 1 content token in chat (then the tail): compare that one
        assert ids[0][:3 * B] == ids[1][:3 * B] and ids[0][3 * B:25] != ids[1][3 * B:25]
        assert ids[0][:2 * B] == ids[2][:2 * B] and ids[0][2 * B:3 * B] != ids[2][2 * B:3 * B]
    assert w._lead == [WithBos.BOS]


@pytest.mark.parametrize("family", ["llama3_style", "mistral_style"])
def test_other_templates_keep_blocks_exact(tok, family):
    """Llama 3's template trims the content (the first piece would lose its space: an
    anchor word leads the content); Mistral's [INST] over a SentencePiece-style BPE."""
    import offline_tokenizers as ot
    other = getattr(ot, family)()
    t = _trace([(0, 300, 2, [0, 1, 2]), (1, 400, 2, [0, 1, 3, 4])], block=128)
    w = TraceWorkload(other, api="chat", seed=0, trace=t)
    ids = [w._ids(r.messages, None) for r in w.requests()]
    assert [len(i) for i in ids] == [300, 400]
    assert ids[0][:256] == ids[1][:256] and ids[0][256:295] != ids[1][256:295]


def test_short_requests_azure_and_jsonl_prompts(tok, tmp_path):
    rows = [{"t_s": 0, "input_tokens": 3, "output_tokens": 2},            # below the chat template's 19
            {"t_s": 1, "input_tokens": 300, "output_tokens": 4},
            {"t_s": 2, "input_tokens": 1, "output_tokens": 1, "prompt": "Say hello."}]
    f = _write(tmp_path / "t.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
    w = TraceWorkload(tok, api="chat", seed=0, trace=read_trace(_spec(f, format="jsonl")))
    short, long, own = w.requests()
    assert w.inexact == 1 and short.prompt_tokens == w.lead_tokens + 1 + w.tail_tokens
    assert long.prompt_tokens == 300 == w._count(long.messages, None)
    assert own.messages[-1]["content"] == "Say hello." and own.prompt_tokens == w._count(own.messages, None)
    # Azure rows have no prefix: each prompt is its own text, beyond the template's lead-in
    az = read_trace(TraceSpec(file="azure_code", requests=12))
    wa = TraceWorkload(tok, api="chat", seed=0, trace=az)
    ra = wa.requests()
    assert [r.prompt_tokens for r in ra] == [r.input_tokens for r in az.requests]
    first = [wa._ids(r.messages, None) for r in ra[:4]]
    assert max(_shared_ids(a, b) for a in first for b in first if a is not b) < wa.lead_tokens + 4


def test_prompts_under_the_template_floor_are_counted_and_warned(tok, tmp_path):
    """The chat template's lead-in and tail around one content token are the shortest prompt
    the kit can send: shorter trace prompts are sent at that floor, said before the study runs."""
    from vllm_study.workload.build_workload import check_template
    from vllm_study.define.params import Workload
    rows = [{"t_s": t, "input_tokens": n, "output_tokens": 2} for t, n in ((0, 3), (1, 17), (2, 300))]
    f = _write(tmp_path / "t.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
    w = TraceWorkload(tok, api="chat", seed=0, trace=read_trace(_spec(f, format="jsonl")))
    floor = w.lead_tokens + 1 + w.tail_tokens
    assert w.prompt_floor == floor and 17 < floor < 300
    assert w.inexact == 2 and [r.prompt_tokens for r in w.requests()] == [floor, floor, 300]
    wl = Workload(kind="trace", trace={"file": str(f), "format": "jsonl"})
    problems, warnings = check_template(tok, wl)
    assert problems == [] and warnings == [f"2 of 3 trace prompts are shorter than the chat template's floor of "
                                           f"{floor} tokens (its lead-in and tail around one content token): they "
                                           f"are sent as {floor} tokens, longer than the trace says; use "
                                           "workload.api: completions (a shorter floor) or another window"]
    assert check_template(tok, wl.model_copy(update={"api": "completions"})) == ([], [])


def test_the_output_cap_reaches_the_requests(tok):
    trace = read_trace(TraceSpec(file="azure_conv", requests=30, max_output_tokens=16))
    w = TraceWorkload(tok, api="completions", seed=0, trace=trace)
    whole = read_trace(TraceSpec(file="azure_conv", requests=30))
    assert max(r.output_tokens for r in whole.requests) > 16
    assert [r.max_tokens for r in w.requests()] == [min(r.output_tokens, 16) for r in whole.requests]
    assert all(r.max_tokens <= 16 for r in w.requests(4, "warmup"))


def test_warmup_is_capped_and_shares_nothing_with_the_measured(tok, mooncake_rows):
    w = TraceWorkload(tok, api="completions", seed=0, trace=mooncake_rows)
    warm = w.requests(3, "warmup")
    assert [r.prompt_tokens for r in warm] == [min(WARMUP_MAX_INPUT, r.input_tokens)
                                               for r in mooncake_rows.requests[:3]]
    assert [r.max_tokens for r in warm] == [r.output_tokens for r in mooncake_rows.requests[:3]]
    measured = [w._ids(None, r.prompt) for r in w.requests()]
    for r in warm:
        mine = w._ids(None, r.prompt)
        assert max(_shared_ids(mine, m) for m in measured) < 16  # not one vLLM block
    assert len(w.requests(20, "warmup")) == 20  # more than the window: its rows again


def test_schedule_and_hit_rate(tok, mooncake_rows):
    t = read_trace(TraceSpec(file="mooncake_conversation", start_s=3, requests=30))
    w = TraceWorkload(tok, api="completions", seed=0, trace=t)
    assert w.schedule(1.0) == [r.t_s for r in t.requests]
    assert w.schedule(2.0) == [r.t_s / 2 for r in t.requests]
    assert w.schedule(2.0)[-1] == pytest.approx(t.duration_s / 2)
    assert w.expected_hit_rate() == t.expected_hit_rate()


def test_fidelity_compares_usage_with_the_trace(tok):
    t = _trace([(0, 100, 1, None), (1, 200, 1, None), (2, 300, 1, None)])
    w = TraceWorkload(tok, api="completions", seed=0, trace=t)
    results = [{"index": 0, "error": None, "prompt_tokens": 100}, {"index": 1, "error": "timeout",
                                                                   "prompt_tokens": None},
               {"index": 2, "error": None, "prompt_tokens": 303}]
    assert w.fidelity(results) == {"trace_prompt_tokens": 400, "prompt_tokens_vs_trace": pytest.approx(0.0075)}
    assert w.fidelity([{"index": 0, "error": "timeout", "prompt_tokens": None}]) == {
        "trace_prompt_tokens": None, "prompt_tokens_vs_trace": None}
