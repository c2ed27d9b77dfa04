"""A trace study's bad input is refused before any server starts: by the study's
validation, or by the grid's expansion (which reads the trace), each message naming the
key or the line and the fix."""
from __future__ import annotations

import json

import pytest

from vllm_study.define.grid import expand
from vllm_study.define.schema import StudyError
from vllm_study.define.study_file import study_from_dict


def _study(trace: dict, **over) -> dict:
    base = {"name": "t", "model": {"card": "tiny-qwen2"}, "grid": {"max_num_batched_tokens": [512]},
            "engine_args": {"max_model_len": 4096},
            "workload": {"kind": "trace", "trace": trace}}
    return {**base, **over}


def _expand(study: dict):
    return expand(study_from_dict(study), "cpu")


def _jsonl(tmp_path, rows: list[str]) -> str:
    f = tmp_path / "t.jsonl"
    f.write_text("".join(r + "\n" for r in rows))
    return str(f)


def test_a_shipped_window_needs_no_format_and_expands():
    (p,) = _expand(_study({"file": "azure_conv", "requests": 20}))
    assert p.id == "mbt=512"
    assert study_from_dict(_study({"file": "mooncake_conversation"})).workload.trace.format == "mooncake"


@pytest.mark.parametrize("trace, message", [
    ({"file": "azure_conv", "format": "azur"}, "trace.format"),
    ({"file": "my_trace.csv"}, "trace.format is needed for 'my_trace.csv'"),
    ({"file": "azure_conv", "requests": 5, "duration_s": 10}, "not both"),
    ({"file": "azure_conv", "speed": 0}, "trace.speed"),
])
def test_bad_trace_keys_are_refused_by_the_study(trace, message):
    with pytest.raises(StudyError, match=message):
        study_from_dict(_study(trace))


def test_a_trace_needs_its_kind_and_no_load_of_its_own():
    with pytest.raises(StudyError, match="kind trace needs workload.trace"):
        study_from_dict({**_study({"file": "azure_conv"}), "workload": {"kind": "trace"}})
    with pytest.raises(StudyError, match="brings its own arrival times"):
        study_from_dict({**_study({"file": "azure_conv"}),
                         "workload": {"kind": "trace", "trace": {"file": "azure_conv"},
                                      "load": {"kind": "poisson", "rate": 2}}})


def test_a_file_that_does_not_parse_names_its_line(tmp_path):
    f = _jsonl(tmp_path, [json.dumps({"t_s": 0, "input_tokens": 10, "output_tokens": 2}), "{not json"])
    with pytest.raises(StudyError, match="line 2"):
        _expand(_study({"file": f, "format": "jsonl"}))


def test_prefix_ids_inconsistent_with_the_length_are_refused(tmp_path):
    f = tmp_path / "m.jsonl"
    f.write_text(json.dumps({"timestamp": 0, "input_length": 2000, "output_length": 5, "hash_ids": [1, 2, 3]}) + "\n")
    with pytest.raises(StudyError, match="line 1.*3 hash_ids.*2000"):
        _expand(_study({"file": str(f), "format": "mooncake"}))


def test_a_window_with_no_request_says_what_the_trace_spans(tmp_path):
    with pytest.raises(StudyError, match="no request"):
        _expand(_study({"file": "azure_conv", "start_s": 10 ** 6}))


def test_a_trace_longer_than_every_request_the_model_allows_is_refused(tmp_path):
    f = _jsonl(tmp_path, [json.dumps({"t_s": t, "input_tokens": 5000, "output_tokens": 10}) for t in (0, 1)])
    with pytest.raises(StudyError, match="max_model_len"):
        _expand(_study({"file": f, "format": "jsonl"}))
    # the ones that fit are kept, and the rest counted in a warning
    g = _jsonl(tmp_path, [json.dumps({"t_s": 0, "input_tokens": 5000, "output_tokens": 10}),
                          json.dumps({"t_s": 1, "input_tokens": 500, "output_tokens": 10})])
    (p,) = _expand(_study({"file": g, "format": "jsonl"}))
    assert any("1 of 2 trace requests are longer than max_model_len=4096" in w for w in p.warnings)


def test_an_slo_naming_an_unknown_metric_is_refused():
    with pytest.raises(StudyError, match="ttft_p95_ms: not a latency bound"):
        study_from_dict(_study({"file": "azure_conv"}, slo={"ttft_p95_ms": 2000},
                               capacity={"over": "speed", "lo": 0.5, "hi": 4}))


def test_a_relative_trace_path_is_resolved_where_the_study_is_loaded(tmp_path, monkeypatch):
    """The point notebook runs in the notebooks folder: the path it reads must be absolute."""
    _jsonl(tmp_path, [json.dumps({"t_s": 0, "input_tokens": 10, "output_tokens": 2})])
    monkeypatch.chdir(tmp_path)
    s = study_from_dict(_study({"file": "t.jsonl", "format": "jsonl"}))
    assert s.workload.trace.file == str(tmp_path / "t.jsonl")
    monkeypatch.chdir("/")
    (p,) = expand(s, "cpu")  # read from another folder
    assert p.id == "mbt=512"
