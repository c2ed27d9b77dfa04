"""The axis registry (axes.py): point ids, Effective defaults, figures and the report's
binding notes read it, not axis names of their own."""
from __future__ import annotations

from types import SimpleNamespace

import matplotlib
import pandas as pd
import pytest

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402

from synthetic_run import make_run  # noqa: E402
from vllm_study.vocab import axes  # noqa: E402
from vllm_study.report import plots, report  # noqa: E402
from vllm_study.report import binding
from vllm_study.define.grid import expand, point_id  # noqa: E402
from vllm_study.define.schema import EngineArgs  # noqa: E402
from vllm_study.define.study_file import study_from_dict  # noqa: E402

# every axis grid.expand can put in a point id: a grid axis is an engine argument the kit
# knows; the scheduler's ratio is added where it lists several values
POINT_AXES = [*EngineArgs.model_fields, axes.SCHEDULER_AXIS]


def test_every_point_axis_has_an_entry_or_the_plain_one_and_short_names_are_unique():
    assert set(axes.AXES) <= set(POINT_AXES)  # no entry for an axis no point can have
    shorts = [axes.get(a).short for a in POINT_AXES]
    assert len(set(shorts)) == len(shorts), shorts
    for a in set(POINT_AXES) - set(axes.AXES):  # dtype, seed: their own name everywhere
        plain = axes.get(a)
        assert (plain.name, plain.short, plain.label, plain.binds) == (a, a, a, None)
        assert point_id({a: 1}) == f"{a}=1"
    assert {a.name: a.short for a in axes.AXES.values()} == {
        "max_num_batched_tokens": "mbt", "gpu_memory_utilization": "gmu", "kv_cache_memory_bytes": "kv",
        "max_num_seqs": "mns", "block_size": "bs", "enable_prefix_caching": "pc", "enable_chunked_prefill": "cp",
        "max_model_len": "len", "enforce_eager": "eager", "tensor_parallel_size": "tp", "min_reuse_ratio": "mrr",
        "long_prefill_token_threshold": "lpt"}


@pytest.mark.parametrize("axis, value, shown", [
    ("enable_prefix_caching", True, "on"),
    ("enforce_eager", False, "off"),
    ("kv_cache_memory_bytes", 2**30, "1GiB"),
    ("kv_cache_memory_bytes", 1536 * 2**20, "1536MiB"),  # not a whole GiB
    ("kv_cache_memory_bytes", 16 * 2**20, "16MiB"),
    ("gpu_memory_utilization", 0.9, "0.90"),
    ("max_num_batched_tokens", 512, "512"),
    ("min_reuse_ratio", "off", "off"),
    ("min_reuse_ratio", 0.8, "0.80"),
    ("seed", 7, "7"),  # not in the registry
])
def test_fmt(axis, value, shown):
    assert axes.get(axis).fmt(value) == shown


def _study(**over) -> dict:
    return {"name": "t", "grid": {"gpu_memory_utilization": [0.5]}, **over}


@pytest.mark.parametrize("engine", ["cpu", "gpu"])
def test_the_defaults_are_those_the_effective_values_use(engine):
    """A study that leaves the chunk, max_num_seqs and the block size open gets the
    registry's defaults for its engine (max_num_seqs uncapped: no chunk below it)."""
    (p,) = expand(study_from_dict(_study()), engine)
    eff = p.effective
    assert eff.block_size == axes.get("block_size").default[engine]
    assert eff.max_num_seqs == axes.get("max_num_seqs").default[engine]
    assert eff.max_num_batched_tokens == axes.get("max_num_batched_tokens").default[engine]
    assert axes.get("block_size").default == {"cpu": 128, "gpu": 16}
    assert axes.get("max_num_seqs").default == {"cpu": 128, "gpu": 1024}
    assert axes.get("max_num_batched_tokens").default == {"cpu": 2048, "gpu": 8192}


def test_the_cpu_default_max_num_seqs_is_per_tensor_parallel_rank():
    (p,) = expand(study_from_dict(_study(engine_args={"tensor_parallel_size": 2})), "cpu")
    assert p.effective.max_num_seqs == 2 * axes.get("max_num_seqs").default["cpu"]


def _x_axis(root, grid: dict, draw=lambda r: plots.trend_vs_axis(r, names=("ttft_p90_ms",))) -> tuple:
    """(x scale, x tick labels, x label) of a figure (the trend lines) of a one-axis study."""
    ((axis, values),) = grid.items()
    truth = {point_id({axis: v}): {"ttft_p90_ms": 100.0 + i} for i, v in enumerate(values)}
    fixed = {"max_model_len": 2048, "dtype": "float32"}  # synthetic_run's, less prefix caching (an axis here)
    r = report.Run.load(make_run(root, truth, {"grid": grid, "engine_args": fixed}).path)
    plt.close("all")
    assert draw(r) is None
    ax = plt.gcf().axes[0]
    return ax.get_xscale(), [t.get_text() for t in ax.get_xticklabels()], ax.get_xlabel()


def test_the_figures_scale_and_label_their_axis_as_the_registry_says(tmp_path):
    assert _x_axis(tmp_path / "mns", {"max_num_seqs": [8, 32, 128]}) == ("log", ["8", "32", "128"], "max_num_seqs")
    assert _x_axis(tmp_path / "kv", {"kv_cache_memory_bytes": [2**24, 2**27]}) == \
        ("log", ["16MiB", "128MiB"], "KV cache size")
    assert _x_axis(tmp_path / "pc", {"enable_prefix_caching": [False, True]}) == \
        ("linear", ["off", "on"], "enable_prefix_caching")
    scale, _, label = _x_axis(tmp_path / "gmu", {"gpu_memory_utilization": [0.5, 0.9]})
    assert (scale, label) == ("linear", "gpu_memory_utilization")
    # the explore notebook's slice of one metric along an axis
    assert _x_axis(tmp_path / "slice", {"max_num_seqs": [8, 32]}, lambda r: plots.slice_plot(r, "ttft_p90_ms")) == \
        ("log", ["8", "32"], "max_num_seqs")


def _binding_run(axis: str, running_peak: float) -> SimpleNamespace:
    """A one-point run (as binding_notes reads it) whose running requests peaked at
    running_peak under max_num_seqs 8."""
    df = pd.DataFrame([{"point": "a", "start": 1, "round": r, "group": "all", "round_status": "ok",
                        "running_peak": running_peak} for r in range(3)])
    return SimpleNamespace(rounds=df, axes=[axis],
                           measured=[SimpleNamespace(point="a", effective=SimpleNamespace(max_num_seqs=8))])


def test_binding_notes_follow_the_registry_not_axis_names(monkeypatch):
    assert binding.binding_notes(_binding_run("max_num_seqs", 8)) == [
        "max_num_seqs bound (running requests, maximum over rounds, reached it) at: a"]
    # an axis no counter speaks for gets no note (no evidence is made up for it)
    assert binding.binding_notes(_binding_run("block_size", 8)) == []
    # an axis the registry says binds like max_num_seqs gets its note, whatever its name
    monkeypatch.setitem(axes.AXES, "concurrency_cap", axes.Axis("concurrency_cap", "cc", "cap", binds="seqs"))
    assert binding.binding_notes(_binding_run("concurrency_cap", 3)) == [
        "concurrency_cap never bound: running requests stayed below max_num_seqs at every point"]
