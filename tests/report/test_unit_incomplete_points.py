"""A point that did not complete every planned round is never surely within the SLO:
its failed requests count against SLO attainment and goodput, the report does not count
it among the points that meet the SLO, and export refuses it (exit 3) without --force."""
from __future__ import annotations

from synthetic_run import make_run
from vllm_study import cli
from vllm_study.analysis import decision
from vllm_study.report import export
from vllm_study.report import answer, report

A, B, C, D = "mbt=256__kv=16MiB", "mbt=256__kv=128MiB", "mbt=512__kv=16MiB", "mbt=512__kv=128MiB"
SLO = {"slo": {"ttft_p90_ms": 1000}, "server": {"extra_cli_args": ["--distributed-executor-backend", "uni"]}}
# the round D's server was killed in: 36 of its 96 requests failed, the 60 answered met the SLO
KILLED = {"requests": 96.0, "completed": 60.0, "failed": 36.0, "ttft_p90_ms": 300.0, "slo_attainment": 0.625,
          "goodput": 3.0}


def _run(tmp_path):
    values = {p: {"ttft_p90_ms": 300.0, "tpot_p50_ms": 20.0, "output_throughput": 100.0, "slo_attainment": 1.0,
                  "goodput": 5.0} for p in (A, B, C, D)}
    return make_run(tmp_path / "r", values, SLO, round_sd=0.0, start_sd=0.0, died={D: (1, 1)},
                    died_round={D: KILLED})


def test_failed_requests_count_against_slo_attainment_and_goodput(tmp_path):
    r = report.Run.load(_run(tmp_path).path)
    att = r.interval(D, "slo_attainment")
    assert att["value"] < 1.0 and att["rounds"] == 5  # the killed round is in it, with its 36 failures
    assert r.interval(A, "slo_attainment")["value"] == 1.0
    assert r.interval(D, "goodput")["value"] < r.interval(A, "goodput")["value"]
    s = next(x for x in r.summaries if x.point == D)
    assert s.estimates["slo_attainment"].min == 0.625 and "ttft_p90_ms" in s.estimates


def test_an_incomplete_point_is_not_counted_as_meeting_the_slo(tmp_path):
    r = report.Run.load(_run(tmp_path).path)
    assert "3 of 4 points meet every bound" in answer.answer_context(r)
    t = decision.slo_table(r.intervals, r.slo, [D])
    assert t.at[D, "SLO"] == "not resolved" and t.at[A, "SLO"] == "meets"


def test_export_of_an_incomplete_point_exits_3_and_says_why(tmp_path, capsys):
    run = _run(tmp_path)
    e = export.export_point(run.path, D, tmp_path / "out")
    assert e.shortfall and "only 4 of its 6 planned rounds completed" in e.shortfall
    assert "server died during round 2" in e.shortfall
    assert export.export_point(run.path, A, tmp_path / "out").shortfall is None
    assert cli.main(["export", str(run.path), "--point", D, "--out", str(tmp_path / "o")]) == export.EXIT_SLO_NOT_MET
    assert "planned rounds completed" in capsys.readouterr().err
    assert cli.main(["export", str(run.path), "--point", D, "--out", str(tmp_path / "o"), "--force"]) == 0
    assert cli.main(["export", str(run.path), "--point", A, "--out", str(tmp_path / "o")]) == 0
