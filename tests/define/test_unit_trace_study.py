"""A trace study's bad input is refused before any server starts: by the study's
validation, or by the grid's expansion (which reads the trace), each message naming the
key or the line and the fix."""
from __future__ import annotations

import json

import pytest

from vllm_study.define.grid import expand
from vllm_study.define.schema import StudyError
from vllm_study.define.study_file import load_study, study_from_dict
from paths import REPO


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


def test_output_tokens_on_a_trace_is_refused_with_the_cap_to_use_instead(tmp_path):
    with pytest.raises(StudyError, match=r"workload\.output_tokens is not used by a trace .*set "
                                         r"workload\.trace\.max_output_tokens"):
        study_from_dict({**_study({"file": "azure_conv"}),
                         "workload": {"kind": "trace", "trace": {"file": "azure_conv"}, "output_tokens": 16}})
    s = study_from_dict(_study({"file": "azure_conv", "max_output_tokens": 16}))
    assert s.workload.trace.max_output_tokens == 16
    # a base file's synthetic output length is not inherited by a study that replays a trace
    (tmp_path / "base.yaml").write_text("name: b\ngrid: {max_num_batched_tokens: [512]}\n"
                                        "workload: {output_tokens: 32}\n")
    (tmp_path / "t.yaml").write_text("extends: base.yaml\nworkload: {kind: trace, trace: {file: azure_conv}}\n")
    assert load_study(tmp_path / "t.yaml").workload.kind == "trace"
    (tmp_path / "u.yaml").write_text("extends: base.yaml\n"
                                     "workload: {kind: trace, trace: {file: azure_conv}, output_tokens: 8}\n")
    with pytest.raises(StudyError, match="max_output_tokens"):
        load_study(tmp_path / "u.yaml")


def test_failed_burstgpt_rows_are_said_before_the_study_runs(tmp_path):
    f = tmp_path / "b.csv"
    f.write_text("Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
                 "0,ChatGPT,400,20,420,Conversation log\n1,ChatGPT,300,0,300,Conversation log\n"
                 "2,ChatGPT,350,0,350,Conversation log\n3,ChatGPT,200,10,210,Conversation log\n")
    (p,) = _expand(_study({"file": str(f), "format": "burstgpt"}))
    assert "2 trace rows within the window are failed (0 output tokens) and are left out (counted in each " \
           "start's record)" in p.warnings


def test_a_trace_none_of_whose_requests_fits_is_refused_by_the_kit(tmp_path):
    f = _jsonl(tmp_path, [json.dumps({"t_s": t, "input_tokens": 5000, "output_tokens": 10}) for t in (0, 1)])
    with pytest.raises(StudyError) as e:
        _expand(_study({"file": f, "format": "jsonl"}))
    assert str(e.value).startswith("the kit refuses these points of the grid") and "vLLM would" not in str(e.value)


def test_the_dry_run_warns_of_prompts_under_the_template_floor(tmp_path, capsys):
    from vllm_study.sweep import dry_run
    f = _jsonl(tmp_path, [json.dumps({"t_s": t, "input_tokens": n, "output_tokens": 2})
                          for t, n in ((0, 5), (1, 400), (2, 600))])
    study = tmp_path / "s.yaml"
    study.write_text(json.dumps(_study({"file": f, "format": "jsonl"})))  # JSON is YAML
    dry_run([str(study)], "cpu")
    out = capsys.readouterr().out
    assert "[warn] chat template: 1 of 3 trace prompts are shorter than the chat template's floor of " in out


def _trace_run(tmp_path, record: dict):
    """A plain trace run (no `capacity:`) with fidelity figures in its rounds and `record`
    as each start's trace record."""
    from synthetic_run import make_run
    values = {"ttft_p90_ms": 300.0, "output_throughput": 500.0, "prompt_tokens_vs_trace": 0.002,
              "send_lateness_p50_ms": 1.5, "send_lateness_p99_ms": 9.0}
    run = make_run(tmp_path, {p: values for p in ("mbt=256", "mbt=512")},
                   study_over={"grid": {"max_num_batched_tokens": [256, 512]},
                               "workload": {"kind": "trace", "trace": {"file": "azure_conv", "requests": 60}}})
    for start in run.path.glob("points/*/s*/start.json"):
        data = json.loads(start.read_text())
        start.write_text(json.dumps({**data, "trace": record}))
    return run


RECORD = {"source": "azure_conv.csv.gz (azure, 60 requests from 0 s)", "format": "azure", "start_s": 0.0,
          "requests": 30, "dropped_over_max_model_len": 30, "max_model_len": 2048,
          "skipped": {"longer than max_model_len 2048": 30, "failed (0 output tokens)": 4}, "inexact": 2,
          "prompt_floor": 20, "rate": 4.5, "duration_s": 12.0}


def test_a_plain_trace_run_reports_its_fidelity(tmp_path, capsys):
    import subprocess
    import sys

    from vllm_study import notebook_support as ns
    run = _trace_run(tmp_path, RECORD)
    r = ns.load_run(run, quiet=True)
    table = ns.fidelity(r)
    out = capsys.readouterr().out
    assert list(table.index) == ["mbt=256", "mbt=512"] and (table["rounds"] == 6).all()
    assert table.filter(like="send lateness").shape[1] == 2 and table.filter(like="prompt tokens").shape[1] == 1
    assert "30 requests kept, 30 longer than max_model_len=2048 left out" in out
    assert "4 rows failed (0 output tokens) left out" in out
    assert "warning: 2 of 60 trace prompts are shorter than the chat template's floor of 20 tokens" in out  # all rows
    # the report notebook shows it for every trace run
    nb = json.loads((REPO / "notebooks" / "report.ipynb").read_text())
    assert "ns.fidelity(r)" in ["".join(c["source"]) for c in nb["cells"]]
    # and the script docs/workloads.md names prints it for a plain trace run
    script = REPO / "benchmarks" / "capacity_table.py"
    done = subprocess.run([sys.executable, str(script), str(run.path)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "30 longer than max_model_len=2048 left out" in done.stdout and "mbt=512" in done.stdout


def test_fidelity_is_not_repeated_nor_invented_where_it_does_not_apply(tmp_path, capsys):
    from synthetic_run import make_run

    from vllm_study import notebook_support as ns
    run = make_run(tmp_path, {"mbt=256__kv=16MiB": {"ttft_p90_ms": 300.0}})
    assert ns.fidelity(ns.load_run(run, quiet=True)) is None
    assert capsys.readouterr().out == ""


# ---------------------------------------------------------------- trace.windows

def test_windows_with_start_s_or_without_a_length_are_refused_naming_the_key_and_the_fix():
    with pytest.raises(StudyError, match=r"trace.windows cuts its windows from across the whole trace, so "
                                         r"trace.start_s \(30\) has no meaning beside it: remove trace.start_s"):
        study_from_dict(_study({"file": "mooncake_conversation", "windows": 3, "requests": 20, "start_s": 30}))
    with pytest.raises(StudyError, match="trace.windows needs each window's length: set trace.requests or "
                                         "trace.duration_s"):
        study_from_dict(_study({"file": "mooncake_conversation", "windows": 3}))
    with pytest.raises(StudyError, match="windows"):
        study_from_dict(_study({"file": "mooncake_conversation", "windows": 0, "requests": 20}))
    # absent: the one window from start_s, as before
    assert study_from_dict(_study({"file": "mooncake_conversation", "start_s": 30})).workload.trace.windows is None


@pytest.mark.parametrize("trace, message", [
    # 12031 requests in 100 strata: each holds ~120, fewer than a window's 200
    ({"file": "mooncake_conversation", "windows": 100, "requests": 200},
     "trace.windows 100 cuts the trace into 100 strata .* the trace holds at most \\d+ such windows: lower "
     "trace.windows or the window's length"),
    ({"file": "mooncake_conversation", "windows": 2, "duration_s": 5000},
     "a window of trace.duration_s 5000 s is longer than the trace .*lower trace.duration_s"),
    ({"file": "mooncake_conversation", "windows": 2, "requests": 20000},
     "a window of trace.requests 20000 is longer than the trace \\(12031 requests\\); lower trace.requests"),
])
def test_windows_the_trace_cannot_hold_are_refused_by_the_dry_run_before_any_server(tmp_path, trace, message,
                                                                                    monkeypatch):
    from vllm_study import sweep
    f = tmp_path / "s.yaml"
    f.write_text(json.dumps(_study(trace, engine_args={"max_model_len": 8192})))
    monkeypatch.setattr(sweep.doctor, "study_findings", lambda *a, **k: pytest.fail("checked after the windows"))
    for check in (lambda: sweep.dry_run([str(f)], "cpu"), lambda: sweep.prepare(load_study(str(f)), "cpu")):
        with pytest.raises(StudyError, match="workload.trace: .*" + message):
            check()


def test_a_window_none_of_whose_requests_fits_is_refused_and_the_dry_run_states_each_window(tmp_path, capsys):
    from vllm_study import sweep
    # 40 rows, one a second; rows 20-39 are longer than max_model_len 4096
    rows = [json.dumps({"t_s": i, "input_tokens": 300 if i < 20 else 5000, "output_tokens": 4,
                        "prefix": [0, 100 + i, 200 + i] if i < 20 else list(range(10 * i, 10 * i + 40))})
            for i in range(40)]
    path = _jsonl(tmp_path, rows)
    f = tmp_path / "s.yaml"
    trace = {"file": path, "format": "jsonl", "block_tokens": 128, "windows": 2, "requests": 5, "prime": "history"}
    f.write_text(json.dumps(_study(trace)))
    with pytest.raises(StudyError, match="window 2: requests .* every one of its 5 requests is longer than "
                                         "max_model_len 4096"):
        sweep.dry_run([str(f)], "cpu")
    f.write_text(json.dumps(_study(trace, engine_args={"max_model_len": 8192}, rounds=3)))
    sweep.dry_run([str(f)], "cpu")
    out = capsys.readouterr().out
    assert "workload.trace.windows 2:" in out and "measured round r replays window r % 2" in out
    assert "window 1: requests " in out and "window 2: requests " in out
    assert "history before it: " in out and "tokens of distinct prefix blocks" in out
    assert "priming: each round of a server with prefix caching first sends about its KV cache" in out
    assert "rounds 3 is not a multiple of trace.windows 2: windows 1 to 1 get one round more" in out
    # the head window's history statement (start_s 0: "no history") is not made for windows
    assert "has no history" not in out


def test_the_dry_run_checks_the_floor_on_every_window_not_the_head(tmp_path, capsys):
    from vllm_study.sweep import dry_run
    # the head is long prompts; the second half of the trace has short ones
    f = _jsonl(tmp_path, [json.dumps({"t_s": t, "input_tokens": 400 if t < 20 else 5, "output_tokens": 2})
                          for t in range(40)])
    study = tmp_path / "s.yaml"
    study.write_text(json.dumps(_study({"file": f, "format": "jsonl", "windows": 2, "requests": 4})))
    dry_run([str(study)], "cpu")
    out = capsys.readouterr().out
    assert "[warn] chat template: 4 of 8 trace prompts are shorter than the chat template's floor of " in out
