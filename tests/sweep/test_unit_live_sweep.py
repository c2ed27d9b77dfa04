"""The sweep's plan with live knobs: which points share a server start, the start each
group launches as, the run order and the rounds' order within a start, what the study
refuses, and a point's round that is never run under limits the engine refused."""
from __future__ import annotations

import pytest

from e2e_support import tiny
from vllm_study.define.grid import expand, live_groups, point_limits, round_order, run_order
from vllm_study.define.study_file import study_from_dict
from vllm_study.measure import counters, live_knobs
from vllm_study.measure.unit import point_params

GRID = {"max_num_batched_tokens": [256, 512], "max_num_seqs": [2, 4]}


def _points(engine="cpu", **over):
    study = study_from_dict(tiny(**{"grid": GRID, **over}))
    return study, expand(study, engine)


def test_points_that_differ_only_in_live_limits_share_one_start_led_by_their_largest():
    study, points = _points()
    groups, why = live_groups(study, "cpu", points)
    assert why is None and len(groups) == 1
    (group,) = groups
    assert group[0].id == "mbt=512__mns=4"  # launched at the largest chunk and max_num_seqs
    assert sorted(p.id for p in group) == sorted(p.id for p in points)
    assert point_limits(next(p for p in points if p.id == "mbt=256__mns=2")) == {
        "max_num_batched_tokens": 256, "max_num_seqs": 2, "long_prefill_token_threshold": None}


def test_a_restart_axis_splits_the_groups_and_a_point_without_chunked_prefill_keeps_its_chunk():
    study, points = _points(grid={**GRID, "block_size": [16, 32]})
    groups, _ = live_groups(study, "cpu", points)
    assert sorted(len(g) for g in groups) == [4, 4]
    assert {g[0].values["block_size"] for g in groups} == {16, 32}
    assert all(g[0].values["max_num_batched_tokens"] == 512 and g[0].values["max_num_seqs"] == 4 for g in groups)
    # without chunked prefill vLLM cannot lower the chunk: only max_num_seqs is shared
    study, points = _points(grid={"max_num_batched_tokens": [2048, 4096], "max_num_seqs": [2, 4]},
                            engine_args={**tiny()["engine_args"], "enable_chunked_prefill": False})
    groups, _ = live_groups(study, "cpu", points)
    assert sorted(tuple(sorted(p.values["max_num_seqs"] for p in g)) for g in groups) == [(2, 4), (2, 4)]
    assert all(len({p.values["max_num_batched_tokens"] for p in g}) == 1 for g in groups)


def test_the_default_is_on_for_cpu_and_off_for_gpu_and_false_turns_it_off():
    study, points = _points()
    assert [len(g) for g in live_groups(study, "gpu", points)[0]] == [1, 1, 1, 1]
    study, points = _points(server={"live_knobs": False})
    assert [len(g) for g in live_groups(study, "cpu", points)[0]] == [1, 1, 1, 1]
    study, points = _points(server={"live_knobs": True})
    assert [len(g) for g in live_groups(study, "gpu", points)[0]] == [4]


@pytest.mark.parametrize("over, why", [
    ({"server": {"extra_cli_args": ["--scheduler-cls", "my.Sched"]}}, "sets --scheduler-cls"),
])
def test_what_cannot_share_a_start_is_refused_when_asked_and_falls_back_by_default(over, why):
    server = {**over.get("server", {}), "live_knobs": True}
    with pytest.raises(ValueError, match=f"server.live_knobs: .*{why}.*set server.live_knobs: false"):
        study_from_dict(tiny(grid=GRID, **{**over, "server": server}))
    study, points = _points(**over)  # the default: one start a point, and why
    groups, note = live_groups(study, "cpu", points)
    assert [len(g) for g in groups] == [1, 1, 1, 1] and why.split(":")[0] in note


PRECISION = {"metric": "ttft_p90_ms", "relative_width": 0.2, "max_starts": 3}
WIDE = "mbt=256__mns=2__bs=16"


def _widths(monkeypatch, points):
    """point_intervals as if WIDE's interval were 50% wide and every other point's 10%."""
    import pandas as pd

    from vllm_study import sweep
    rows = [{"point": p.id, "metric": "ttft_p90_ms", "value": 100.0, "ci_low": 100.0, "scale": "log",
             "ci_high": 150.0 if p.id == WIDE else 110.0} for p in points]
    monkeypatch.setattr(sweep, "point_intervals", lambda rounds, names: pd.DataFrame(rows))


def test_precision_adds_whole_shared_starts_where_one_of_their_points_is_wide(tmp_path, monkeypatch):
    """With live knobs, a group one of whose points is still wide gets one more start that
    serves the whole group again (each point's starts stay shared ones, and the group's
    points stay compared within each); the other group gets none; max_starts caps it."""
    from vllm_study.sweep import create_run, more_starts
    study, points = _points(grid={**GRID, "block_size": [16, 32]}, replicates=2, precision=PRECISION)
    run = create_run(tmp_path / "results", study, "cpu", points)
    planned = run.manifest().order
    assert len(planned) == 4 and all(len(u.serves) == 4 for u in planned)
    _widths(monkeypatch, points)
    (extra,) = more_starts(run, study)
    lead = "mbt=512__mns=4__bs=16"
    assert extra.point == lead and extra.serves[0] == lead
    assert sorted(extra.serves) == sorted(p.id for p in points if p.values["block_size"] == 16)
    assert (extra.start, extra.block) == (3, 3) and run.manifest().order[-1] == extra
    assert more_starts(run, study) == []  # the group has max_starts (3) starts now


def test_precision_adds_a_start_of_the_wide_point_alone_where_each_point_has_its_own(tmp_path, monkeypatch):
    from vllm_study.sweep import create_run, more_starts
    study, points = _points(grid={**GRID, "block_size": [16, 32]}, replicates=2, precision=PRECISION,
                            server={"live_knobs": False})
    run = create_run(tmp_path / "results", study, "cpu", points)
    _widths(monkeypatch, points)
    (extra,) = more_starts(run, study)
    assert (extra.point, extra.serves, extra.start, extra.block) == (WIDE, [], 3, 3)


def test_run_order_shuffles_groups_and_keeps_the_order_of_single_points():
    study, points = _points(grid={**GRID, "block_size": [16, 32]})
    groups, _ = live_groups(study, "cpu", points)
    units = run_order(points, 3, 7, groups)
    assert len(units) == 6 and all(len(u.serves) == 4 and u.serves[0] == u.point for u in units)
    assert [u.block for u in units] == [1, 1, 2, 2, 3, 3]
    # one point a start: the order a run made before live knobs, unchanged
    singles = run_order(points, 2, 7, [[p] for p in points])
    assert [u.point for u in singles] == [u.point for u in run_order(points, 2, 7)]
    assert all(u.serves == [] and u.points == [u.point] for u in singles)


def test_round_order_interleaves_every_point_once_a_pass_in_a_seeded_order():
    ids = ["a", "b", "c", "d"]
    order = round_order(ids, 3, 0, 1)
    assert len(order) == 12
    for r in range(3):
        assert sorted(p for i, p in order if i == r) == ids
        assert [i for i, _ in order[4 * r:4 * r + 4]] == [r] * 4  # pass r holds round r of each point
    assert order == round_order(ids, 3, 0, 1)
    passes = {tuple(p for i, p in round_order(ids, 8, 0, 1) if i == r) for r in range(8)}
    assert len(passes) > 1  # each pass shuffled anew
    assert round_order(ids, 3, 0, 2) != order  # and each block


def test_the_notebook_is_told_the_points_a_start_serves(tmp_path):
    from vllm_study.define.grid import Unit
    unit = Unit(point="a", start=1, block=1, serves=["a", "b"])
    p = point_params(tmp_path / "points/a/point.json", tmp_path / "points/a/s1", unit, None, None, tmp_path)
    assert p["serves"] == "a,b"
    assert point_params(tmp_path / "p.json", tmp_path / "s1", Unit(point="a", start=1, block=1), None, None,
                        tmp_path)["serves"] == ""


def test_a_shared_start_counts_the_long_prefills_at_each_chunk_it_serves():
    assert counters.budget_buckets(512, 256, 512) == {"request_tokens": [256, 512]}
    assert counters.budget_buckets(512) == {"request_tokens": [512]}


def test_a_round_whose_limits_the_engine_refuses_is_not_run(tmp_path):
    """The channel's launch values are below the point's chunk: the round fails the
    point's start with the reason, sends nothing, and writes no control message."""
    from e2e_support import plan_of
    from vllm_study.measure.point import PointStart
    from vllm_study.measure.rounds import RoundProtocol
    from vllm_study.scheduler_plugin import StatsRecorder
    rec = StatsRecorder(tmp_path / "stats.json", {}, interval_s=3600)
    rec.set_section("knobs", {"launch": {"max_num_batched_tokens": 256, "max_num_seqs": 4,
                                         "long_prefill_token_threshold": 0}, "seq": 0})
    rec.close()
    plan = plan_of(tiny(grid=GRID), index=3)  # mbt=512__mns=4
    start = PointStart(plan, tmp_path / "s1", 1, 1)
    live = live_knobs.Channel(tmp_path / "stats.json", tmp_path / "control.json")
    live.url = "http://127.0.0.1:9"  # nothing listens: any request would fail the round otherwise
    rounds = RoundProtocol(plan, start.log, start.launcher.served, start.launcher.work, start.nvml, live)
    assert rounds.run_round(0) is None
    assert start.failed and "Refused" in start.record.reason
    assert "max_num_batched_tokens 512 is above its launch value 256" in start.record.reason
    assert not (tmp_path / "s1" / "rounds.jsonl").exists() and not (tmp_path / "control.json").exists()
    assert start.rounds == []


def test_the_sweep_waits_for_every_point_a_start_serves(tmp_path):
    from vllm_study.define.grid import Unit
    from vllm_study.records.results import Launch, RunFolder, StartRecord
    from vllm_study.sweep import unit_finished
    run = RunFolder(tmp_path)
    unit = Unit(point="a", start=1, block=1, serves=["a", "b"])
    for pid, status in (("a", "ok"), ("b", "running")):
        d = run.point(pid).start_dir(1)
        d.mkdir(parents=True)
        StartRecord(point=pid, start=1, started_utc="x", host="h", launch=Launch(), rounds_planned=1,
                    status=status).save(d / "start.json")
    assert not unit_finished(run, unit)
    StartRecord(point="b", start=1, started_utc="x", host="h", launch=Launch(), rounds_planned=1, status="failed",
                served_by="a/s1").save(run.point("b").start_dir(1) / "start.json")
    assert unit_finished(run, unit) and not unit_finished(run, unit, retry_failed=True)


def test_a_targets_study_with_live_knobs_is_refused():
    with pytest.raises(ValueError, match="server.live_knobs: a targets study measures servers the kit does not launch"):
        study_from_dict({"name": "t", "targets": [{"name": "x", "base_url": "http://127.0.0.1:1", "model": "m"}],
                         "server": {"live_knobs": True}})


def test_the_dry_run_shows_each_start_and_the_points_it_serves(tmp_path, capsys):
    import yaml
    from vllm_study.sweep import dry_run
    study = tiny(grid={**GRID, "block_size": [16, 32]})
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(study, sort_keys=False))
    dry_run([str(tmp_path / "s.yaml")], "cpu")
    out = capsys.readouterr().out
    assert "live knobs: 2 server start(s) a block serve the 8 points" in out
    for bs in (16, 32):
        assert (f"launches as mbt=512__mns=4__bs={bs} and serves: mbt=512__mns=4__bs={bs}, "
                f"mbt=256__mns=2__bs={bs}") in out
    (tmp_path / "s.yaml").write_text(yaml.safe_dump({**study, "server": {"live_knobs": False}}, sort_keys=False))
    dry_run([str(tmp_path / "s.yaml")], "cpu")
    assert "live knobs: none shared (server.live_knobs: false); one server start a point" in capsys.readouterr().out
    # on the GPU engine they are off by default, and the dry run says on what evidence
    (tmp_path / "s.yaml").write_text(yaml.safe_dump({**study, "server": {"engine": "gpu"}}, sort_keys=False))
    dry_run([str(tmp_path / "s.yaml")], "gpu")
    out = capsys.readouterr().out
    assert "live knobs: none shared (off by default on the gpu engine: on one H200, TTFT P50 at chunk 2048" in out
    assert "3.9% [1.8%, 6.0%] below fresh starts" in out and "server.live_knobs: true turns them on" in out


def test_the_dry_run_shows_the_args_every_start_adds_as_a_shell_would_take_them(tmp_path, capsys):
    import yaml
    from vllm_study.sweep import dry_run
    extra = ["--distributed-executor-backend", "uni", "--compilation-config", '{"compile_ranges_endpoints": [128]}']
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(tiny(server={"extra_cli_args": extra}), sort_keys=False))
    dry_run([str(tmp_path / "s.yaml")], "cpu")
    assert ("--enforce-eager --distributed-executor-backend uni --compilation-config "
            """'{"compile_ranges_endpoints": [128]}'\n""") in capsys.readouterr().out


def test_export_leaves_out_the_live_limits_scheduler_and_its_control_file(tmp_path):
    """What let the kit lower the limits between rounds is no serving setting."""
    import shlex

    from synthetic_run import make_run
    from vllm_study.launch import server
    from vllm_study.measure.point import summarize
    from vllm_study.scheduler_plugin.knobs import CONTROL_ENV
    from vllm_study.report import export
    point = "mbt=512__kv=16MiB"
    run = make_run(tmp_path / "r", {p: {"output_throughput": 100.0, "ttft_p90_ms": 300.0, "tpot_p50_ms": 20.0,
                                        "itl_p90_ms": 25.0, "prefix_cache_hit_rate": 0.5}
                                    for p in ("mbt=256__kv=16MiB", point)}, {})
    folder = run.point(point)
    (tmp_path / "tiny-qwen2").mkdir()
    command = server.serve_command(str(tmp_path / "tiny-qwen2"), 40123, folder.plan().point.engine_args.cli(), "tiny",
                                   True, ["--scheduler-cls", live_knobs.SCHEDULER_CLS])
    for st in folder.starts():
        st.launch = st.launch.model_copy(update={"command": command, "kit_env": {
            CONTROL_ENV: "/x/limits.json", "VLLM_STUDY_PB_STATS": "/x/pb.json", "OMP_NUM_THREADS": "1"}})
        st.save(folder.start_dir(st.start) / "start.json")
    summarize(folder, folder.plan())
    _, note = export.export(run.path, point=point, out=tmp_path / "out")
    line = shlex.split(note.read_text().splitlines()[2])
    assert "--scheduler-cls" not in line and live_knobs.SCHEDULER_CLS not in line
    assert not any(w.startswith((CONTROL_ENV, "VLLM_STUDY_PB_STATS")) for w in line) and "OMP_NUM_THREADS=1" in line


def test_no_cap_on_one_requests_prefill_is_the_largest_long_prefill_threshold():
    study, points = _points(grid={"max_num_batched_tokens": [256, 512], "long_prefill_token_threshold": [128, 0]})
    (group,), _ = live_groups(study, "cpu", points)
    assert group[0].id == "mbt=512__lpt=0" and len(group) == 4
    assert "--long-prefill-token-threshold 0" in " ".join(group[0].engine_args.cli())
    assert point_limits(next(p for p in points if p.id == "mbt=256__lpt=128"))["long_prefill_token_threshold"] == 128
