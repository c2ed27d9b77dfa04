"""Every comparison of two configs or two tools says, where either side was measured from
one server start, that its interval is over that start's rounds and leaves out
start-to-start spread (intervals.one_start_note); where both sides had 2 or more starts
it says nothing of the kind."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

from synthetic_run import make_run
from vllm_study.analysis import intervals
from vllm_study.analysis.intervals import ONE_START_A_SIDE, one_start_note
from vllm_study.report import report
from paths import REPO

BENCHMARKS = REPO / "benchmarks"
A, B = "mbt=256__kv=16MiB", "mbt=512__kv=16MiB"


def _benchmark(name: str):
    sys.path.insert(0, str(BENCHMARKS))  # some import their neighbours
    try:
        spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod
    finally:
        sys.path.remove(str(BENCHMARKS))


def _run(root: Path, replicates: int, seed: int = 0):
    values = {p: {"output_throughput": 100.0, "ttft_p90_ms": 300.0, "tpot_p50_ms": 20.0, "itl_p90_ms": 25.0,
                  "prefix_cache_hit_rate": 0.5} for p in (A, B)}
    return make_run(root, values, {"replicates": replicates}, seed=seed)


def test_the_note_is_owed_where_either_side_had_fewer_than_two_starts():
    assert one_start_note(1, 5).startswith(ONE_START_A_SIDE)
    assert one_start_note(4, 1) == one_start_note(1, 4)
    assert one_start_note(0, 3) is not None     # a side measured from no start at that point
    assert one_start_note(1, 1, why="so") == f"{ONE_START_A_SIDE}; so"
    assert one_start_note(2, 2) is None and one_start_note(2, 7, why="so") is None
    with pytest.raises(ValueError, match="each side's count"):
        one_start_note()


def test_starts_per_point_counts_a_runs_most_replicated_point(tmp_path):
    assert intervals.starts_per_point(report.Run.load(_run(tmp_path / "one", 1).path).rounds) == 1
    assert intervals.starts_per_point(report.Run.load(_run(tmp_path / "two", 2).path).rounds) == 2


def test_executor_speedup_prints_the_note_only_where_a_run_had_one_start_a_point(tmp_path):
    speedup = _benchmark("executor_speedup")
    one, two, two_b = _run(tmp_path / "one", 1), _run(tmp_path / "two", 2, 1), _run(tmp_path / "two_b", 2, 2)
    text = "\n".join(speedup.agreement(one.path, two.path))
    assert text.startswith(ONE_START_A_SIDE) and "A measured each point from one server start" in text
    assert ONE_START_A_SIDE not in "\n".join(speedup.agreement(two.path, two_b.path))


def test_rerun_check_says_a_one_start_studys_prediction_interval_holds_no_restart(tmp_path):
    rerun_check = _benchmark("rerun_check")
    note = rerun_check.one_start_line(report.Run.load(_run(tmp_path / "one", 1).path))
    assert note.startswith(ONE_START_A_SIDE) and "prediction interval" in note
    assert rerun_check.one_start_line(report.Run.load(_run(tmp_path / "two", 2).path)) is None


def test_the_within_run_note_stands_where_no_point_had_two_starts(tmp_path):
    r = report.Run.load(_run(tmp_path / "one", 1).path)
    assert report.within_run_note(r) == intervals.SINGLE_START_NOTE
    assert report.within_run_note(report.Run.load(_run(tmp_path / "two", 2).path)) is None


def test_the_sweep_speed_table_counts_the_kits_starts_a_point():
    sweep_speed = _benchmark("sweep_speed")
    live = [{"serves": [A, B]}]                                  # one live-knobs start served both
    replicated = [{"serves": [A, B]}, {"serves": [A, B]}]
    assert sweep_speed.kit_starts_per_point(live, [A, B]) == 1
    assert sweep_speed.kit_starts_per_point(replicated, [A, B]) == 2
    assert sweep_speed.kit_starts_per_point([{"serves": [A]}, {"serves": [A]}, {"serves": [B]}], [A, B]) == 1


def test_the_one_server_benchmarks_say_both_sides_are_its_one_start(tmp_path, capsys):
    assert ONE_START_A_SIDE in _benchmark("start_ahead_neighbour").heading(6)
    agreement = _benchmark("client_agreement")
    rng = np.random.default_rng(0)
    runs = {who: [{"ttft_ms": 30 + rng.normal(), "ttft_mean_ms": 32 + rng.normal(),
                   "server_ttft_mean_ms": 27 + rng.normal(), "tpot_ms": 5.0 + rng.normal(0, 0.01),
                   "itl_ms": 5.0 + rng.normal(0, 0.01), "order": i, "completed": 10, "prompt_tokens": 1000,
                   "prefix_hit": 0.5} for i in range(4)] for who in ("kit", "vllm_bench")}
    agreement.summarize(runs, A, tmp_path)
    assert ONE_START_A_SIDE in capsys.readouterr().out


def test_primed_vs_cold_says_its_two_rounds_are_two_starts(capsys):
    primed_vs_cold = _benchmark("primed_vs_cold")
    window = {"window": 1, "first": 0, "last": 9, "hit_cold": 0.1, "hit_primed": 0.5, "model_primed": 0.5,
              "model_gap": 0.0, "bound_alone": 0.2, "bound_with_history": 0.6, "block_size": 16,
              "max_model_len": 8192, "prime_s": 3.0, "prime_prompt_tokens": 1e5, "requests": 10}
    for q in ("p50", "p90"):
        window |= {f"ttft_{q}_cold_ms": 100.0, f"ttft_{q}_primed_ms": 80.0, f"ttft_{q}_ratio": 0.8,
                   f"ttft_{q}_lo": 0.7, f"ttft_{q}_hi": 0.9}
    primed_vs_cold.show({"cold": "c", "primed": "p", "windows": [window]})
    assert ONE_START_A_SIDE in capsys.readouterr().out


def test_explore_against_another_run_says_so_where_either_had_one_start(tmp_path, capsys):
    from vllm_study import notebook_support
    one, two, two_b = (report.Run.load(_run(tmp_path / n, k, s).path)
                       for n, k, s in (("one", 1, 0), ("two", 2, 1), ("two_b", 2, 2)))
    notebook_support.explore(two, "ttft_p90_ms", other=one)
    assert ONE_START_A_SIDE in capsys.readouterr().out
    notebook_support.explore(two, "ttft_p90_ms", other=two_b)
    assert ONE_START_A_SIDE not in capsys.readouterr().out
