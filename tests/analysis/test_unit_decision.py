"""From study to decision, on synthetic runs whose answers are known: SLO verdicts on
intervals, the recommendation and its ties, Pareto fronts with ties, the exported serve
config, the comparison of two runs, and the slices of a resumed run."""
from __future__ import annotations

import datetime as dt

import pandas as pd
import pytest
import yaml

from drawn import assert_drawn
from synthetic_run import make_run
from vllm_study.report import compare, export, report
from vllm_study.report import binding
from vllm_study.analysis import decision
from vllm_study.records.results import Resume
from paths import FAKE_ENGINE

A, B, C, D = "mbt=256__kv=16MiB", "mbt=256__kv=128MiB", "mbt=512__kv=16MiB", "mbt=512__kv=128MiB"


def _values(goodput: dict[str, float], ttft: dict[str, float]) -> dict:
    return {p: {"goodput": goodput[p], "output_throughput": 100 * goodput[p], "ttft_p90_ms": ttft[p],
                "tpot_p50_ms": 20.0, "itl_p90_ms": 25.0} for p in goodput}


@pytest.fixture
def run(tmp_path):
    """D has the most goodput but misses the TTFT bound; B meets it with the most
    goodput; C is B's equal within noise; A is clearly worse."""
    vals = _values({A: 5.0, B: 8.0, C: 8.1, D: 12.0}, {A: 300.0, B: 350.0, C: 340.0, D: 900.0})
    return make_run(tmp_path, vals, {"slo": {"ttft_p90_ms": 500}})


def test_slo_verdicts_are_taken_on_intervals(run):
    r = report.Run.load(run.path)
    t = decision.slo_table(r.intervals, {"ttft_p90_ms": 500})
    assert t.loc[[A, B, C], "SLO"].tolist() == ["meets"] * 3 and t.loc[D, "SLO"] == "misses"
    # a bound inside a point's interval is not resolved either way
    near = decision.slo_table(r.intervals, {"ttft_p90_ms": r.interval(B, "ttft_p90_ms")["value"]})
    assert near.loc[B, "SLO"] == "not resolved"


def test_the_recommendation_meets_the_slo_and_names_its_ties(run):
    r = report.Run.load(run.path)
    rec = decision.recommend(r.rounds, r.intervals, {"ttft_p90_ms": 500})
    assert rec.point in (B, C) and set([rec.point] + rec.tied) == {B, C}
    assert rec.metric == "goodput" and rec.low < rec.value < rec.high
    assert "meet every SLO bound" in rec.reason and D not in rec.tied
    assert rec.runner_up in (B, C)
    text = rec.text()
    assert rec.point in text and "Not told apart" in text


def test_no_point_meeting_the_slo_is_said_plainly(run):
    r = report.Run.load(run.path)
    rec = decision.recommend(r.rounds, r.intervals, {"ttft_p90_ms": 50})
    assert rec.point is None and "no point meets the SLO" in rec.text()


def test_pareto_keeps_ties_and_drops_dominated_points():
    pts = pd.DataFrame({"x": [1.0, 1.0, 1.0, 2.0, 0.5], "y": [1.0, 1.0, 0.5, 0.5, 0.9]}, index=list("abcde"))
    on = decision.pareto(pts, "x", "y")
    assert on.to_dict() == {"a": True, "b": True, "c": False, "d": True, "e": False}
    # lower is better on x: (0.5, 0.9) now beats (1, 0.5) and (2, 0.5)
    on_low = decision.pareto(pts, "x", "y", x_better="lower")
    assert on_low.to_dict() == {"a": True, "b": True, "c": False, "d": False, "e": True}


def test_export_writes_a_serve_config_and_its_evidence(run, tmp_path):
    cfg_path, note = export.export(run.path, out=tmp_path / "out")
    cfg = yaml.safe_load(cfg_path.read_text())
    rec_point = note.read_text().splitlines()[0].split(": ", 1)[1]
    assert rec_point in (B, C)
    assert cfg["max-num-batched-tokens"] in (256, 512) and cfg["served-model-name"] == "tiny"
    assert cfg["enable-prefix-caching"] is True and cfg["dtype"] == "float32"
    assert "custom-histogram-buckets" not in cfg
    text = note.read_text()
    assert f"--config {cfg_path.name}" in cfg_path.read_text().splitlines()[1] and "ttft_p90_ms <= 500" in text
    assert "| TTFT P90 (ms) |" in text and "[" in text
    with pytest.raises(ValueError, match="is not a point"):
        export.export(run.path, point="mbt=1__kv=1MiB", out=tmp_path / "out")


def test_compare_two_runs_says_better_worse_or_not_resolved(tmp_path):
    base = _values({A: 5.0, B: 5.0, C: 5.0, D: 5.0}, {A: 300.0, B: 300.0, C: 300.0, D: 300.0})
    changed = _values({A: 5.0, B: 5.0, C: 5.0, D: 5.0}, {A: 600.0, B: 300.0, C: 150.0, D: 300.0})
    ra = make_run(tmp_path / "a", base, seed=1)
    rb = make_run(tmp_path / "b", changed, seed=2)
    df = compare.compare(ra.path, rb.path)
    ttft = df[df["metric"] == "ttft_p90_ms"].set_index("point")
    assert ttft.at[A, "verdict"] == "worse" and ttft.at[A, "change"] == pytest.approx(1.0, abs=0.2)
    assert ttft.at[C, "verdict"] == "better"
    assert ttft.at[B, "verdict"] == "not resolved" and ttft.at[D, "verdict"] == "not resolved"
    _, t, line = compare.compare_runs(ra.path, rb.path, out=tmp_path / "cmp")
    assert "worse" in t.loc[A, "TTFT P90"]
    assert_drawn(tmp_path / "cmp" / "compare.png")
    moved = df[df["verdict"] != "not resolved"]
    assert line.startswith(f"{len(df) - len(moved)} of {len(df)} point x metric pairs agree")
    assert f"{A} TTFT P90 +" in line and f"{C} TTFT P90 -" in line and f"{B} TTFT P90" not in line


def test_report_header_points_to_compare_when_starts_overlapped(tmp_path):
    run = make_run(tmp_path / "r", _values({A: 5.0, B: 5.0, C: 5.0, D: 5.0}, {A: 300.0, B: 300.0, C: 300.0, D: 300.0}))
    assert "at the same time" not in report.describe(report.Run.load(run.path))  # nothing ran side by side
    m = run.manifest()
    m.executor = "gpus"
    m.overlaps = [{"a": f"{A}#s1", "b": f"{B}#s1", "seconds": 80.0, "hosts": ["h"], "gpus": [[0], [1]]}]
    m.save(run.manifest_path)
    header = report.describe(report.Run.load(run.path))
    assert "executor gpus: 1 pair(s) of server starts ran at the same time" in header
    assert "vllm_study compare" in header


def test_a_run_not_served_by_vllm_says_so_and_exports_nothing(tmp_path):
    vllm = make_run(tmp_path / "v", _values({A: 5.0, B: 5.0, C: 5.0, D: 5.0}, {A: 300.0, B: 300.0, C: 300.0, D: 300.0}))
    assert "NOT vLLM" not in report.describe(report.Run.load(vllm.path))
    fake = str(FAKE_ENGINE)
    run = make_run(tmp_path / "f", _values({A: 5.0, B: 5.0, C: 5.0, D: 5.0}, {A: 300.0, B: 300.0, C: 300.0, D: 300.0}),
                   study_over={"server": {"command": ["python", fake]}})
    header = report.describe(report.Run.load(run.path)).splitlines()
    assert header[2] == (f"NOT vLLM: every start ran `python {fake}` (server.command) with vLLM's command line; "
                         "no figure here is vLLM's")
    with pytest.raises(ValueError, match="not vLLM: a config is exported from a run vLLM served"):
        export.export(run.path, point=B, out=tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert export.export(vllm.path, point=B, out=tmp_path / "out")[0].exists()  # the same run vLLM served


def test_sweep_of_names_the_slice_a_moment_belongs_to(tmp_path):
    run = make_run(tmp_path / "r", _values({A: 5.0}, {A: 300.0}))
    m = run.manifest()  # created 2026-01-01T00:00:00Z
    resumed = Resume(utc="2026-01-01T01:00:00+00:00", git=m.git, versions=m.versions, machine=m.machine,
                     units_left=[f"{A}#s2"])
    m.resumes = [resumed, resumed.model_copy(update={"utc": "2026-01-01T02:00:00+00:00"})]
    t0 = dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc).timestamp()
    assert [m.sweep_of(t0 + s) for s in (-5, 0, 3599, 3600, 7300)] == [0, 0, 0, 1, 2]


def test_the_chunk_binds_where_a_prefill_was_split_and_coarse_buckets_are_not_claimed():
    from types import SimpleNamespace
    rows = [{"point": p, "start": 1, "round": k, "round_status": "ok", "group": "all", "long_prefills": n,
             "long_prefill_edge_tokens": edge} for p, n, edge in
            (("c256", 3, 256), ("c8192", 0, 8192), ("coarse", 5, 200), ("coarse0", 0, 200)) for k in (0, 1)]
    measured = [SimpleNamespace(point=p, effective=SimpleNamespace(max_num_batched_tokens=m))
                for p, m in (("c256", 256), ("c8192", 8192), ("coarse", 256), ("coarse0", 256))]
    r = SimpleNamespace(rounds=pd.DataFrame(rows), measured=measured)
    note = binding._chunk_binding(r, "max_num_batched_tokens", binding._per_point(r, "long_prefills", "median"))
    assert note.startswith("max_num_batched_tokens bound at 1 of 4 points (prefills longer than the chunk")
    assert ": c256;" in note  # coarse (5 above 200 tokens) is not called bound, and none below is
    assert "whether the chunk split them is not known at: coarse (above 200)" in note and "coarse0" not in note
    none = SimpleNamespace(rounds=pd.DataFrame([{**x, "long_prefills": 0} for x in rows]), measured=measured)
    assert binding._chunk_binding(none, "max_num_batched_tokens",
                                 binding._per_point(none, "long_prefills", "median")).endswith(
        "never bound: no prefill was longer than the chunk; this study cannot show its effect")
