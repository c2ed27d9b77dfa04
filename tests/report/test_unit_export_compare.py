"""export's command starts the point as it was measured (the recorded launch: model folder,
load format, the kit's environment); compare says what differs between two studies,
which points it left out, and calls no change an effect across different workloads."""
from __future__ import annotations

import shlex
import sys

import yaml

from synthetic_run import make_run
from vllm_study.analysis import intervals
from vllm_study.report import compare, export, report
from vllm_study.records.results import RunFolder
from vllm_study.define import models
from vllm_study.launch import server
from vllm_study.launch.machine import vllm_distribution
from vllm_study.measure.launcher import STEPS_SCHEDULER_CLS
from vllm_study.define.params import ModelSpec
from vllm_study.measure.point import summarize

A, B, C, D = "mbt=256__kv=16MiB", "mbt=256__kv=128MiB", "mbt=512__kv=16MiB", "mbt=512__kv=128MiB"
UNI = ["--distributed-executor-backend", "uni"]


def _values(points, hit=0.5, ttft=300.0) -> dict:
    return {p: {"output_throughput": 100.0, "ttft_p90_ms": ttft, "tpot_p50_ms": 20.0, "itl_p90_ms": 25.0,
                "prefix_cache_hit_rate": hit} for p in points}


def _exported_command(note) -> list[str]:
    """The command line the .md shows (indented under its title), as a shell splits it."""
    return shlex.split(note.read_text().splitlines()[2])


def test_export_prints_the_recorded_launch_with_model_folder_load_format_and_kit_env(tmp_path):
    run = make_run(tmp_path / "r", _values([A, B, C, D]), {"server": {"extra_cli_args": UNI}})
    folder = run.point(B)
    plan = folder.plan()
    # what point.py records for a start: serve_command's argv and the variables the kit set
    (tmp_path / "tiny-qwen2").mkdir()  # the folder served, still where the run was made
    command = server.serve_command(str(tmp_path / "tiny-qwen2"), 40123, plan.point.engine_args.cli(), "tiny", True,
                                   UNI + ["--custom-histogram-buckets", "[1, 256]",
                                          "--scheduler-cls", STEPS_SCHEDULER_CLS])  # step records: measurement
    kit_env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "0",
               "VLLM_STUDY_STEPS": str(tmp_path / "steps.raw")}
    for st in folder.starts():
        st.launch = st.launch.model_copy(update={"command": command, "kit_env": kit_env})
        st.save(folder.start_dir(st.start) / "start.json")
    summarize(folder, plan)

    cfg_path, note = export.export(run.path, point=B, out=tmp_path / "out")
    line = _exported_command(note)
    assert line[:2] == ["OMP_NUM_THREADS=1", "VLLM_ENABLE_V1_MULTIPROCESSING=0"]  # the slot's GPU is not the config
    head = command[:command.index("--host")]  # interpreter, entry point, the model folder served
    assert line[2:] == head + ["--load-format", "dummy", "--config", cfg_path.name]
    assert str(tmp_path / "tiny-qwen2") in head
    assert cfg_path.read_text().splitlines()[1] == "# " + note.read_text().splitlines()[2].strip()
    cfg = yaml.safe_load(cfg_path.read_text())
    assert cfg["distributed-executor-backend"] == "uni" and cfg["max-num-batched-tokens"] == 256
    assert "custom-histogram-buckets" not in cfg and "load-format" not in cfg and "scheduler-cls" not in cfg
    assert "the launch a start of this point recorded" in note.read_text()
    # the Prefix Reuse Budget's scheduler is the point's admission rule: it stays
    budget = command[:-1] + ["vllm_study.scheduler_plugin.PrefixBudgetScheduler"]
    argv, env, _ = export.launch(report.Run.load(RunFolder(run.path), None), B, {})
    assert "--scheduler-cls" not in argv and "VLLM_STUDY_STEPS" not in env
    for st in folder.starts():
        st.launch = st.launch.model_copy(update={"command": budget})
        st.save(folder.start_dir(st.start) / "start.json")
    summarize(folder, plan)
    argv, _, _ = export.launch(report.Run.load(RunFolder(run.path), None), B, {})
    assert argv[argv.index("--scheduler-cls") + 1] == "vllm_study.scheduler_plugin.PrefixBudgetScheduler"


def test_export_of_a_run_that_recorded_the_plugins_old_path_drops_or_renames_the_kits_scheduler(tmp_path):
    """A run made before the plugin's package was renamed recorded the old class paths
    (committed runs' start.json): its exported command still leaves out the kit's
    measuring schedulers, and keeps the Prefix Reuse Budget's under the path that loads."""
    run = make_run(tmp_path / "r", _values([A, B, C, D]), {"server": {"extra_cli_args": UNI}})
    folder = run.point(B)
    plan = folder.plan()
    (tmp_path / "tiny-qwen2").mkdir()
    base = server.serve_command(str(tmp_path / "tiny-qwen2"), 40123, plan.point.engine_args.cli(), "tiny", True, UNI)

    def exported(*scheduler: str) -> tuple[list[str], str]:
        for st in folder.starts():
            st.launch = st.launch.model_copy(update={"command": base + list(scheduler), "kit_env": {}})
            st.save(folder.start_dir(st.start) / "start.json")
        summarize(folder, plan)
        argv, _, source = export.launch(report.Run.load(RunFolder(run.path), None), B, {})
        return argv, source

    for old in ("vllm_study.prefix_budget.StepRecordsScheduler", "vllm_study.prefix_budget.LiveLimitsScheduler"):
        argv, source = exported("--scheduler-cls", old)
        assert "--scheduler-cls" not in argv and old not in argv and "prefix_budget" not in source
        argv, _ = exported(f"--scheduler-cls={old}")
        assert not any("scheduler" in t for t in argv)
    old = "vllm_study.prefix_budget.PrefixBudgetScheduler"
    argv, source = exported("--scheduler-cls", old)
    assert argv[argv.index("--scheduler-cls") + 1] == "vllm_study.scheduler_plugin.PrefixBudgetScheduler"
    assert old not in argv and f"its --scheduler-cls {old}" in source
    argv, _ = exported(f"--scheduler-cls={old}")
    assert "--scheduler-cls=vllm_study.scheduler_plugin.PrefixBudgetScheduler" in argv


def test_export_of_a_run_made_elsewhere_points_at_this_machines_interpreter_and_card_folder(tmp_path):
    """A committed run's launch names the interpreter and card folder of the machine it ran
    on; the printed command must start here."""
    run = make_run(tmp_path / "r", _values([A, B, C, D]), {"server": {"extra_cli_args": UNI}})
    folder = run.point(B)
    plan = folder.plan()
    elsewhere = server.serve_command("/gone/models/tiny-qwen2", 40123, plan.point.engine_args.cli(), "tiny", True, UNI)
    elsewhere[0] = "/gone/.venv/bin/python"
    for st in folder.starts():
        st.launch = st.launch.model_copy(update={"command": elsewhere, "kit_env": {}})
        st.save(folder.start_dir(st.start) / "start.json")
    summarize(folder, plan)

    cfg_path, note = export.export(run.path, point=B, out=tmp_path / "out")
    line = _exported_command(note)
    here, _ = models.resolve(ModelSpec(card="tiny-qwen2"))
    assert line[0] == sys.executable and "/gone" not in " ".join(line)
    assert line[line.index(here) - 1] in ("serve", "--model")   # the model folder, where the entry point takes it
    text = note.read_text()
    assert "its interpreter /gone/.venv/bin/python is not on this machine" in text
    assert f"the card's folder /gone/models/tiny-qwen2 was not on this machine: the kit wrote it at {here}" in text


def test_export_without_a_recorded_launch_builds_it_as_the_server_would(tmp_path):
    run = make_run(tmp_path / "r", _values([A, B, C, D]), {"server": {"extra_cli_args": UNI}})
    cfg_path, note = export.export(run.path, point=A, out=tmp_path / "out")
    line = _exported_command(note)
    folder, _ = models.resolve(ModelSpec(card="tiny-qwen2"))
    assert folder in line and line[line.index("--load-format") + 1] == "dummy"
    assert line[-2:] == ["--config", cfg_path.name] and "--port" not in line
    if vllm_distribution() != "vllm":  # the CPU build needs these for the uni backend (server.cpu_uni_env)
        assert "VLLM_ENABLE_V1_MULTIPROCESSING=0" in line and any(t.startswith("OMP_NUM_THREADS=") for t in line)
    assert "no start of this point recorded its launch" in note.read_text()


def test_compare_across_different_workloads_lists_them_and_calls_nothing_an_effect(tmp_path):
    ra = make_run(tmp_path / "a", _values([A, B, C, D]), seed=1)
    other = {"system_prompt_tokens": 256, "question_tokens": 16, "output_tokens": 64, "concurrency": 8,
             "requests_per_round": 100}
    rb = make_run(tmp_path / "b", _values([A, B], hit=0.9),
                  {"workload": other, "grid": {"max_num_batched_tokens": [256],
                                               "kv_cache_memory_bytes": [16777216, 134217728]}}, seed=2)
    df = compare.compare(ra.path, rb.path)
    hit = df[df["metric"] == "prefix_cache_hit_rate"].set_index("point")
    assert hit.at[A, "verdict"] == "higher" and hit.at[A, "change"] > 0.4  # resolved, yet no "better"
    assert not df["verdict"].isin(["better", "worse"]).any() and (df["workload"] == "different").all()
    head, table, line = compare.compare_runs(ra.path, rb.path)
    assert "* workload.output_tokens: 16 -> 64" in head and "* workload.requests_per_round:" in head
    assert "* workload.concurrency:" in head and "the workloads differ" in head
    assert f"left out, measured in A only: {C}, {D}" in head and "B only" not in head
    assert line.startswith("across different workloads") and "resolved" not in line.split(":", 1)[1]
    assert "better" not in line and "worse" not in line and "higher" in table.loc[A, "prefix-cache hit rate"]


def test_compare_of_the_same_workload_lists_other_differences_and_keeps_its_verdicts(tmp_path):
    ra = make_run(tmp_path / "a", _values([A, B, C, D]), seed=1)
    rb = make_run(tmp_path / "b", _values([A, B, C, D], ttft=600.0),
                  {"engine_args": {"max_model_len": 4096, "enable_prefix_caching": True, "dtype": "float32"}},
                  seed=2)
    head, _, line = compare.compare_runs(ra.path, rb.path)
    assert "  engine_args.max_model_len: 2048 -> 4096" in head and "workloads differ" not in head
    assert "left out" not in head
    assert f"resolved (B vs A): {A} TTFT P90 +" in line and "worse" in line


def test_compare_of_one_start_runs_of_the_same_study_calls_no_difference_resolved(tmp_path):
    """Two runs of one study, one start a point: restarts move every value by ~15% while
    rounds scatter 2%, so round-only intervals would call restart noise 'worse'."""
    one = {"replicates": 1}
    ra = make_run(tmp_path / "a", _values([A, B, C, D]), one, start_sd=0.15, round_sd=0.02, seed=1)
    rb = make_run(tmp_path / "b", _values([A, B, C, D]), one, start_sd=0.15, round_sd=0.02, seed=2)
    df = compare.compare(ra.path, rb.path)
    assert not df["verdict"].isin(["better", "worse", "higher", "lower"]).any()
    assert (df["verdict"] == compare.ONE_START).any()   # apart by more than the rounds' noise
    head, table, line = compare.compare_runs(ra.path, rb.path)
    first = head.splitlines()[0]
    assert first.startswith(intervals.ONE_START_A_SIDE) and "A and B measured each point from one server start" in first
    assert "the studies are the same" in head and "none is resolved" in line
    assert "better" not in line and "worse" not in line
    # with starts replicated on one side only, still no resolved difference
    rc = make_run(tmp_path / "c", _values([A, B, C, D]), start_sd=0.15, round_sd=0.02, seed=3)
    head, _, line = compare.compare_runs(ra.path, rc.path)
    first = head.splitlines()[0]
    assert first.startswith(intervals.ONE_START_A_SIDE) and "; A measured each point" in first and "worse" not in line
    # both replicated: start-to-start spread is in the intervals, and no note says otherwise
    rd = make_run(tmp_path / "d", _values([A, B, C, D]), start_sd=0.15, round_sd=0.02, seed=4)
    head, _, _ = compare.compare_runs(rc.path, rd.path)
    assert intervals.ONE_START_A_SIDE not in head and "one server start" not in head


def test_the_reports_comparisons_of_a_one_start_run_say_start_spread_is_not_in_them(tmp_path, capsys):
    from vllm_study.report import effects, report
    one = make_run(tmp_path / "one", _values([A, B, C, D]), {"replicates": 1}, seed=1)
    r = report.Run.load(one.path)
    effects.comparison_table(r)
    assert intervals.ONE_START_A_SIDE in intervals.SINGLE_START_NOTE
    assert intervals.SINGLE_START_NOTE in capsys.readouterr().out
    assert intervals.SINGLE_START_NOTE in effects.axis_effect_notes(r, "max_num_batched_tokens")
    two = report.Run.load(make_run(tmp_path / "two", _values([A, B, C, D]), seed=1).path)
    effects.comparison_table(two)
    assert intervals.ONE_START_A_SIDE not in capsys.readouterr().out
    assert intervals.SINGLE_START_NOTE not in effects.axis_effect_notes(two, "max_num_batched_tokens")
