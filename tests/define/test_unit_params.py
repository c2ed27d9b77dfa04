"""Study definitions: layered YAML, validation messages, grid expansion (grid.py),
vLLM rules, run order."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from vllm_study.vocab import axes
from vllm_study.define import grid, grid_spec, models
from vllm_study.launch import machine
from vllm_study.define.grid import Effective, Point, expand, point_id, run_order
from vllm_study.define.schema import EngineArgs, StudyError
from vllm_study.define.params import ModelSpec
from vllm_study.define.study_file import load_study, study_from_dict
from paths import REPO



def _write(path: Path, data: dict) -> Path:
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def _study(**over) -> dict:
    """A minimal valid study as a dict; keyword arguments replace top-level keys."""
    base = {"name": "t", "grid": {"max_num_batched_tokens": [512]},
            "workload": {"system_prompt_tokens": 100, "question_tokens": 8, "output_tokens": 8}}
    base.update(over)
    return base


# ---------------------------------------------------------------- loading, layering

def test_later_file_overrides_keys_of_earlier(tmp_path):
    a = _write(tmp_path / "a.yaml", {
        "name": "base", "description": "from a",
        "grid": {"max_num_batched_tokens": [256, 512]},
        "workload": {"concurrency": 4, "output_tokens": 16},
        "rounds": 5,
    })
    b = _write(tmp_path / "b.yaml", {"name": "over", "workload": {"concurrency": 8}})
    s = load_study(a, b)
    assert s.name == "over"
    assert s.workload.concurrency == 8
    # keys b does not mention keep a's values, also inside a nested mapping
    assert s.workload.output_tokens == 16
    assert s.description == "from a"
    assert s.rounds == 5
    assert s.grid == {"max_num_batched_tokens": [256, 512]}


def test_extends_key_reads_base_relative_to_file(tmp_path):
    (tmp_path / "sub").mkdir()
    _write(tmp_path / "base.yaml", {
        "name": "base", "grid": {"max_num_batched_tokens": [256]},
        "engine_args": {"max_model_len": 4096, "enforce_eager": True},
        "workload": {"api": "completions", "seed": 7},
    })
    child = _write(tmp_path / "sub" / "child.yaml", {
        "extends": "../base.yaml", "name": "child",
        "engine_args": {"max_model_len": 2048},
    })
    s = load_study(child)
    assert s.name == "child"
    assert s.engine_args.max_model_len == 2048      # child wins
    assert s.engine_args.enforce_eager is True      # inherited
    assert s.workload.api == "completions" and s.workload.seed == 7
    assert s.grid == {"max_num_batched_tokens": [256]}


def test_extends_loop_is_an_error(tmp_path):
    _write(tmp_path / "a.yaml", {"extends": "b.yaml", "name": "a"})
    _write(tmp_path / "b.yaml", {"extends": "a.yaml", "name": "b"})
    with pytest.raises(StudyError, match="loops back"):
        load_study(tmp_path / "a.yaml")


def test_missing_file_and_non_mapping(tmp_path):
    with pytest.raises(StudyError, match="not found"):
        load_study(tmp_path / "nope.yaml")
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    with pytest.raises(StudyError, match="expected a mapping"):
        load_study(tmp_path / "list.yaml")
    with pytest.raises(StudyError):
        load_study()


@pytest.mark.parametrize("path", sorted((REPO / "params").glob("*.yaml")), ids=lambda p: p.name)
def test_every_committed_study_loads_and_expands(path):
    """A change to the schema must not strand the study files a user copies from."""
    s = load_study(path)
    points = expand(s, engine="gpu" if s.server.engine == "gpu" else "cpu")
    assert points and len({p.id for p in points}) == len(points)
    if s.grid:  # every grid cell (or listed point) is a point (other axes, e.g. the scheduler's, multiply them)
        assert len(points) >= len(grid_spec.combos(s.grid))


def test_repo_default_yaml_loads_and_expands_to_four_points():
    path = REPO / "params" / "default.yaml"
    raw = yaml.safe_load(path.read_text())
    s = load_study(path)
    points = expand(s, engine="cpu")
    assert len(points) == 4
    # a 2x2 grid, chunk size x KV bytes (whole MiB), ids as the sweep names folders
    assert list(raw["grid"]) == ["max_num_batched_tokens", "kv_cache_memory_bytes"]
    mbts, kvs = raw["grid"]["max_num_batched_tokens"], raw["grid"]["kv_cache_memory_bytes"]
    assert all(k % 2**20 == 0 for k in kvs)
    assert [p.id for p in points] == [f"mbt={m}__kv={k // 2**20}MiB" for m in mbts for k in kvs]
    # the fixed engine args reach every point
    fixed = raw["engine_args"]
    for p in points:
        for key, value in fixed.items():
            assert getattr(p.engine_args, key) == value
        assert isinstance(p.effective, Effective)
        assert p.effective.max_model_len == fixed.get("max_model_len", 8192)
        # dtype is left open there: the CPU engine fills it from the CPU's capability
        assert "dtype" not in fixed
        assert p.effective.dtype == p.engine_args.dtype == machine.cpu_dtype().dtype
        assert p.effective.dtype_reason == machine.cpu_dtype().reason


# ---------------------------------------------------------------- grid expansion

def test_expand_is_product_in_axis_order_last_axis_fastest():
    s = study_from_dict(_study(grid={"max_num_batched_tokens": [512, 1024, 2048],
                                     "gpu_memory_utilization": [0.9, 0.5]}))
    points = expand(s, engine="gpu")
    assert [p.id for p in points] == [
        "mbt=512__gmu=0.90", "mbt=512__gmu=0.50",
        "mbt=1024__gmu=0.90", "mbt=1024__gmu=0.50",
        "mbt=2048__gmu=0.90", "mbt=2048__gmu=0.50",
    ]
    assert [tuple(p.values.values()) for p in points] == [
        (512, 0.9), (512, 0.5), (1024, 0.9), (1024, 0.5), (2048, 0.9), (2048, 0.5)]
    assert points[3].engine_args.max_num_batched_tokens == 1024
    assert points[3].engine_args.gpu_memory_utilization == 0.5


def test_point_id_formats_bytes_and_bools():
    s = study_from_dict(_study(grid={"max_num_batched_tokens": [256],
                                     "kv_cache_memory_bytes": [16777216, 2 * 2**30],
                                     "enable_prefix_caching": [True, False]}))
    ids = [p.id for p in expand(s, engine="cpu")]
    assert ids[0] == "mbt=256__kv=16MiB__pc=on"
    assert ids == ["mbt=256__kv=16MiB__pc=on", "mbt=256__kv=16MiB__pc=off",
                   "mbt=256__kv=2GiB__pc=on", "mbt=256__kv=2GiB__pc=off"]


def test_point_id_mbt_kv():
    s = study_from_dict(_study(grid={"max_num_batched_tokens": [256],
                                     "kv_cache_memory_bytes": [16777216]}))
    (p,) = expand(s, engine="cpu")
    assert p.id == "mbt=256__kv=16MiB"
    assert p.engine_args.kv_cache_memory_bytes == 16777216


# ---------------------------------------------------------------- validation messages

def test_unknown_key_names_key_and_suggests_close_match(tmp_path):
    f = _write(tmp_path / "s.yaml", _study(workload={"concurency": 4}))
    with pytest.raises(StudyError) as ei:
        load_study(f)
    msg = str(ei.value)
    assert "workload.concurency" in msg
    assert "did you mean 'concurrency'" in msg
    assert str(f) in msg  # the source file is named


def test_unknown_top_level_key_suggests():
    with pytest.raises(StudyError) as ei:
        study_from_dict(_study(round=3))
    assert "round: unknown key" in str(ei.value)
    assert "'rounds'" in str(ei.value)


def test_every_problem_is_listed_at_once():
    with pytest.raises(StudyError) as ei:
        study_from_dict(_study(rounds="three", workload={"concurrency": "many", "outptu_tokens": 3}))
    msg = str(ei.value)
    assert "3 problem(s)" in msg
    assert "rounds" in msg and "workload.concurrency" in msg and "workload.outptu_tokens" in msg


def test_wrong_type_names_key_and_value():
    with pytest.raises(StudyError) as ei:
        study_from_dict(_study(workload={"concurrency": "lots"}))
    msg = str(ei.value)
    assert "workload.concurrency" in msg
    assert "integer" in msg
    assert "'lots'" in msg


def test_missing_required_key():
    with pytest.raises(StudyError, match=r"name: required key is missing"):
        study_from_dict({"grid": {"max_num_batched_tokens": [256]}})


def test_grid_or_targets_exactly_one():
    with pytest.raises(StudyError, match=r"give one of `grid`.*`search`.*or `targets`.*gives none"):
        study_from_dict({"name": "t"})
    with pytest.raises(StudyError, match=r"gives grid and targets"):
        study_from_dict({"name": "t", "grid": {"max_num_batched_tokens": [256]},
                         "targets": [{"name": "a", "base_url": "http://127.0.0.1:1", "model": "m"}]})


@pytest.mark.parametrize("url", ["http://127.0.0.1:8000", "http://127.0.0.1:8000/",
                                 "http://127.0.0.1:8000/v1", "http://127.0.0.1:8000/v1/"])
def test_target_base_url_is_normalized(url):
    s = study_from_dict({"name": "t", "targets": [{"name": "a", "base_url": url, "model": "m",
                                                   "api_key_env": "KEY"}]})
    (p,) = expand(s, "cpu")
    assert p.id == "target=a" and p.target.base_url == "http://127.0.0.1:8000"


def test_target_base_url_needs_a_scheme():
    with pytest.raises(StudyError, match="must start with http"):
        study_from_dict({"name": "t", "targets": [{"name": "a", "base_url": "127.0.0.1:8000", "model": "m"}]})


@pytest.mark.parametrize("bad", [0, 1.5, -0.1])
def test_gpu_memory_utilization_out_of_range_rejected(bad):
    with pytest.raises(StudyError, match="engine_args.gpu_memory_utilization"):
        study_from_dict(_study(engine_args={"gpu_memory_utilization": bad}))


def test_gpu_memory_utilization_one_accepted():
    s = study_from_dict(_study(engine_args={"gpu_memory_utilization": 1.0}))
    assert s.engine_args.gpu_memory_utilization == 1.0


def test_gpu_memory_utilization_out_of_range_in_grid_rejected_at_expand():
    s = study_from_dict(_study(grid={"gpu_memory_utilization": [0.5, 1.5]}))
    with pytest.raises(StudyError) as ei:
        expand(s, engine="gpu")
    assert "gpu_memory_utilization" in str(ei.value)
    assert "1.5" in str(ei.value)


def test_grid_axis_not_an_engine_arg_rejected_with_suggestion():
    with pytest.raises(StudyError) as ei:
        study_from_dict(_study(grid={"max_num_batched_token": [512]}))
    msg = str(ei.value)
    assert "'max_num_batched_token' is not an engine argument" in msg
    assert "did you mean 'max_num_batched_tokens'" in msg


def test_axis_both_in_grid_and_engine_args_rejected():
    with pytest.raises(StudyError, match="both a grid axis and fixed in engine_args"):
        study_from_dict(_study(engine_args={"max_num_batched_tokens": 512}))


def test_empty_or_repeated_axis_rejected():
    with pytest.raises(StudyError, match="has no values"):
        study_from_dict(_study(grid={"max_num_batched_tokens": []}))
    with pytest.raises(StudyError, match="repeats a value"):
        study_from_dict(_study(grid={"max_num_batched_tokens": [512, 512]}))


def test_unknown_model_card_rejected_but_path_allowed():
    with pytest.raises(StudyError, match="unknown card 'nope'"):
        study_from_dict(_study(model={"card": "nope"}))
    s = study_from_dict(_study(model={"card": "nope", "path": "/models/x"}))
    assert s.model.path == "/models/x"


# ---------------------------------------------------------------- per-point vLLM rules

def test_warning_chunk_not_multiple_of_block_size():
    # 520 = 65 * 8: multiple of neither 16 nor 128
    long = {"system_prompt_tokens": 2000, "question_tokens": 8, "output_tokens": 8}
    s = study_from_dict(_study(grid={"max_num_batched_tokens": [520]}, engine_args={"block_size": 16},
                               workload=long))
    (p,) = expand(s, engine="gpu")
    assert any("not a multiple of the block size (16)" in w for w in p.warnings)
    assert any("not a multiple of 128" in w for w in p.warnings)
    # prompts no longer than one chunk are never split: nothing to warn about blocks
    (short,) = expand(study_from_dict(_study(grid={"max_num_batched_tokens": [520]},
                                             engine_args={"block_size": 16})), engine="gpu")
    assert not any("block size" in w for w in short.warnings)


def test_warning_only_for_128_when_block_divides():
    # 528 = 33 * 16: a multiple of the block size 16, not of 128
    s = study_from_dict(_study(grid={"max_num_batched_tokens": [528, 512]},
                               engine_args={"block_size": 16}))
    p528, p512 = expand(s, engine="gpu")
    assert not any("block size" in w for w in p528.warnings)
    assert any("not a multiple of 128" in w for w in p528.warnings)
    assert not any("multiple" in w for w in p512.warnings)


def test_default_block_size_depends_on_engine():
    # 1040 = 65 * 16: fine for the GPU default block (16), not for the CPU one (128)
    s = study_from_dict(_study(grid={"max_num_batched_tokens": [1040]},
                               workload={"system_prompt_tokens": 3000, "question_tokens": 8, "output_tokens": 8}))
    (gpu,) = expand(s, engine="gpu")
    (cpu,) = expand(s, engine="cpu")
    assert gpu.effective.block_size == 16 and cpu.effective.block_size == 128
    assert axes.get("block_size").default == {"cpu": 128, "gpu": 16}
    assert not any("block size" in w for w in gpu.warnings)
    assert any("block size (128)" in w for w in cpu.warnings)


def test_chunked_prefill_off_with_chunk_below_max_model_len_is_error():
    s = study_from_dict(_study(grid={"max_num_batched_tokens": [512, 4096]},
                               engine_args={"enable_chunked_prefill": False, "max_model_len": 2048}))
    with pytest.raises(StudyError) as ei:
        expand(s, engine="cpu")
    msg = str(ei.value)
    assert "point mbt=512" in msg
    assert "below max_model_len=2048" in msg
    assert "mbt=4096" not in msg  # only the offending point is listed


def test_chunked_prefill_on_allows_small_chunk():
    s = study_from_dict(_study(grid={"max_num_batched_tokens": [512]},
                               engine_args={"enable_chunked_prefill": True, "max_model_len": 2048}))
    (p,) = expand(s, engine="cpu")
    assert p.engine_args.max_num_batched_tokens == 512


def test_chunked_prefill_off_uses_card_max_model_len():
    # tiny-qwen2's max_position_embeddings is 8192
    s = study_from_dict(_study(grid={"max_num_batched_tokens": [4096]},
                               engine_args={"enable_chunked_prefill": False}))
    with pytest.raises(StudyError, match="below max_model_len=8192"):
        expand(s, engine="cpu")


def test_explicit_max_num_seqs_above_chunk_is_error():
    s = study_from_dict(_study(grid={"max_num_batched_tokens": [256, 1024]},
                               engine_args={"max_num_seqs": 512}))
    with pytest.raises(StudyError) as ei:
        expand(s, engine="cpu")
    msg = str(ei.value)
    assert "max_num_seqs=512 is above max_num_batched_tokens=256" in msg
    assert "mbt=1024" not in msg


def test_explicit_max_num_seqs_is_effective():
    s = study_from_dict(_study(grid={"max_num_batched_tokens": [1024]},
                               engine_args={"max_num_seqs": 64}))
    (p,) = expand(s, engine="gpu")
    assert p.effective.max_num_seqs == 64
    assert p.warnings == []


@pytest.mark.parametrize("engine", ["cpu", "gpu"])
def test_effective_max_num_seqs_is_capped_by_chunk_when_unset(engine):
    default = axes.get("max_num_seqs").default[engine]
    assert default == {"cpu": 128, "gpu": 1024}[engine]
    small, large = 64, 2048  # both multiples of 128 and 16: no other warning
    s = study_from_dict(_study(grid={"max_num_batched_tokens": [small, large]}))
    p_small, p_large = expand(s, engine=engine)
    assert p_small.effective.max_num_seqs == min(default, small) == 64
    assert p_large.effective.max_num_seqs == min(default, large) == default
    assert any("caps it at max_num_batched_tokens (64 instead of %d)" % default in w
               for w in p_small.warnings)
    assert not any("caps" in w for w in p_large.warnings)


def test_effective_max_num_seqs_cap_boundary_cpu_vs_gpu():
    # 512 caps the GPU default (1024) but not the CPU one (128)
    s = study_from_dict(_study(grid={"max_num_batched_tokens": [512]}))
    (cpu,) = expand(s, engine="cpu")
    (gpu,) = expand(s, engine="gpu")
    assert cpu.effective.max_num_seqs == 128 and not any("caps" in w for w in cpu.warnings)
    assert gpu.effective.max_num_seqs == 512 and any("caps" in w for w in gpu.warnings)


def test_no_chunk_axis_leaves_default_max_num_seqs():
    s = study_from_dict(_study(grid={"gpu_memory_utilization": [0.8]}))
    (p,) = expand(s, engine="gpu")
    assert p.effective.max_num_seqs == 1024
    assert p.id == "gmu=0.80"


def test_workload_longer_than_max_model_len_rejected():
    s = study_from_dict(_study(engine_args={"max_model_len": 1024},
                               workload={"system_prompt_tokens": 1000, "question_tokens": 32,
                                         "output_tokens": 64}))
    with pytest.raises(StudyError) as ei:
        expand(s, engine="cpu")
    msg = str(ei.value)
    assert "max_model_len is 1024" in msg
    assert "1128 tokens" in msg  # 1000 + 32 + 32 (template allowance) + 64


def test_workload_that_fits_is_accepted():
    s = study_from_dict(_study(engine_args={"max_model_len": 2048},
                               workload={"system_prompt_tokens": 1000, "question_tokens": 32,
                                         "output_tokens": 64}))
    (p,) = expand(s, engine="cpu")
    assert p.effective.max_model_len == 2048


def test_real_model_path_leaves_max_model_len_unknown():
    s = study_from_dict(_study(model={"path": "/models/x"},
                               engine_args={"enable_chunked_prefill": False},
                               workload={"system_prompt_tokens": 100000}))
    (p,) = expand(s, engine="cpu")  # nothing to check against: no error
    assert p.effective.max_model_len is None


# ---------------------------------------------------------------- EngineArgs.cli

def test_cli_flags():
    args = EngineArgs(max_num_batched_tokens=512, gpu_memory_utilization=0.9,
                      enable_prefix_caching=True, enable_chunked_prefill=False,
                      enforce_eager=True, dtype="bfloat16")
    cli = args.cli()
    assert cli[cli.index("--max-num-batched-tokens") + 1] == "512"
    assert cli[cli.index("--gpu-memory-utilization") + 1] == "0.9"
    assert cli[cli.index("--dtype") + 1] == "bfloat16"
    assert "--enable-prefix-caching" in cli
    assert "--no-enable-chunked-prefill" in cli
    assert "--enforce-eager" in cli
    assert len(cli) == 9  # three flag/value pairs and three bare flags


def test_cli_bool_off_and_unset():
    cli = EngineArgs(enable_prefix_caching=False, enforce_eager=False).cli()
    assert cli == ["--no-enable-prefix-caching"]  # enforce_eager False: vLLM's default, no flag
    assert EngineArgs().cli() == []
    assert EngineArgs(kv_cache_memory_bytes=16777216).cli() == ["--kv-cache-memory-bytes", "16777216"]


def test_point_ids_are_unique_for_distinct_round_values():
    s = study_from_dict(_study(grid={"gpu_memory_utilization": [0.9, 0.95],
                                     "kv_cache_memory_bytes": [2**24, 2**26]}))
    ids = [p.id for p in expand(s, engine="gpu")]
    assert len(set(ids)) == len(ids) == 4


@pytest.mark.parametrize("axis, values", [("gpu_memory_utilization", [0.9, 0.901]),
                                          ("kv_cache_memory_bytes", [16777216, 16777217])])
def test_point_ids_never_collide(axis, values):
    s = study_from_dict(_study(grid={axis: values}))
    try:
        ids = [p.id for p in expand(s, engine="gpu")]
    except StudyError as e:  # refusing such a grid is a fix too
        assert "point id" in str(e)
        return
    assert len(set(ids)) == len(ids)


def test_max_model_len_above_the_card_is_rejected_before_start():
    s = study_from_dict(_study(engine_args={"max_model_len": 16384}))  # tiny-qwen2: 8192 positions
    with pytest.raises(StudyError, match=r"max_model_len=16384 is above what the model supports \(8192 "
                                         r"positions in its config.json\)"):
        expand(s, engine="cpu")


# ---------------------------------------------------------------- workloads and load models

@pytest.mark.parametrize("workload, match", [
    ({"load": {"kind": "poisson"}}, "poisson needs load.rate"),
    ({"load": {"kind": "ladder", "rates": [10]}}, "ladder needs load.rates with two or more"),
    ({"kind": "multi_turn", "turns": 5, "requests_per_round": 12}, "multiple of turns"),
    ({"kind": "multi_turn", "api": "completions", "requests_per_round": 10}, "multi_turn needs api: chat"),
    ({"output_tokens": {"uniform": [9, 3]}}, r"needs 1 <= low <= high"),
    ({"input_tokens": {"lognormal": {"mean": 0, "sd": 1}}}, "greater than 0"),
    ({"question_tokens": {"normal": [1, 2]}}, "question_tokens"),
])
def test_bad_workloads_are_explained(workload, match):
    with pytest.raises(StudyError, match=match):
        study_from_dict(_study(workload={**_study()["workload"], **workload}))


def test_long_documents_must_fit_max_model_len():
    s = study_from_dict(_study(engine_args={"max_model_len": 4096},
                               workload={"kind": "mixed", "long_prompt_tokens": {"uniform": [6000, 8000]},
                                         "system_prompt_tokens": 100, "output_tokens": 16}))
    with pytest.raises(StudyError, match=r"longest request needs about 8048 tokens"):
        expand(s, engine="cpu")


def test_lengths_accept_int_uniform_lognormal():
    s = study_from_dict(_study(workload={"kind": "random", "input_tokens": {"lognormal": {"mean": 500, "sd": 100}},
                                         "output_tokens": {"uniform": [16, 64]}, "question_tokens": 8,
                                         "load": {"kind": "ladder", "rates": [1, 2.5]}}))
    assert s.workload.longest_request() == 500 + 4 * 100 + 64
    assert s.workload.load.rates == [1.0, 2.5]


def test_local_model_folder_config_bounds_max_model_len(tmp_path):
    """A model.path folder with a config.json is checked like a card: its
    max_position_embeddings is what vLLM derives max_model_len from."""
    (tmp_path / "config.json").write_text('{"max_position_embeddings": 2048}')
    spec = {"path": str(tmp_path)}
    (p,) = expand(study_from_dict(_study(model=spec)), engine="gpu")
    assert p.effective.max_model_len == 2048
    with pytest.raises(StudyError, match=r"max_model_len=4096 is above what the model supports \(2048 "):
        expand(study_from_dict(_study(model=spec, engine_args={"max_model_len": 4096})), engine="gpu")


# ---------------------------------------------------------------- new keys: replicates, order, model, targets

def test_missing_extends_names_the_including_file_and_its_folder(tmp_path):
    (tmp_path / "studies").mkdir()
    child = _write(tmp_path / "studies" / "child.yaml", {"extends": "base.yaml", "name": "c"})
    with pytest.raises(StudyError) as ei:
        load_study(child)
    msg = str(ei.value)
    assert f"params file not found: {tmp_path / 'studies' / 'base.yaml'}" in msg
    assert f"named by `extends:` in {child}" in msg
    assert f"resolved against that file's folder, {tmp_path / 'studies'}" in msg


def test_missing_top_level_file_does_not_blame_extends(tmp_path):
    with pytest.raises(StudyError) as ei:
        load_study(tmp_path / "nope.yaml")
    assert str(ei.value) == f"params file not found: {tmp_path / 'nope.yaml'}"


def test_replicates_and_order_seed_defaults_and_bounds():
    s = study_from_dict(_study())
    assert s.replicates == 1 and s.order_seed == 0
    s = study_from_dict(_study(replicates=3, order_seed=42))
    assert s.replicates == 3 and s.order_seed == 42
    with pytest.raises(StudyError, match="replicates"):
        study_from_dict(_study(replicates=0))
    with pytest.raises(StudyError, match="order_seed"):
        study_from_dict(_study(order_seed="x"))


def test_dummy_weights_default_follows_card_or_path():
    assert ModelSpec().dummy is True                                   # a card: dummy weights
    assert ModelSpec(path="/models/x").dummy is False                  # a path: its own weights
    assert ModelSpec(path="/models/x", dummy_weights=True).dummy is True
    assert ModelSpec(dummy_weights=False).dummy is False
    assert study_from_dict(_study(model={"path": "/m", "dummy_weights": True})).model.dummy_weights is True


def test_resolve_a_path_keeps_it_and_its_dummy_choice():
    assert models.resolve(ModelSpec(path="/models/x")) == ("/models/x", False)
    assert models.resolve(ModelSpec(path="/models/x", dummy_weights=True)) == ("/models/x", True)


def test_target_proxy_is_kept_and_optional():
    s = study_from_dict({"name": "t", "targets": [
        {"name": "a", "base_url": "http://10.0.0.1:8000/v1", "model": "m", "proxy": "http://proxy:3128"},
        {"name": "b", "base_url": "http://127.0.0.1:8000", "model": "m"}]})
    a, b = expand(s, engine="gpu")
    assert a.target.proxy == "http://proxy:3128" and b.target.proxy is None
    assert a.target.base_url == "http://10.0.0.1:8000"


@pytest.mark.parametrize("arg, why", [
    ("--port", "picks a free port"), ("--port=8000", "picks a free port"),
    ("--host", "127.0.0.1"), ("--model", "model.card or model.path"),
    ("--served-model-name", "model.served_name"), ("--load-format=dummy", "model.dummy_weights"),
])
def test_extra_cli_args_refuse_flags_the_kit_sets(arg, why):
    with pytest.raises(StudyError) as ei:
        study_from_dict(_study(server={"extra_cli_args": [arg, "1"] if "=" not in arg else [arg]}))
    msg = str(ei.value)
    flag = arg.split("=")[0]
    assert f"server.extra_cli_args: {flag} is set by the kit" in msg
    assert why in msg
    assert "remove it from extra_cli_args" in msg


@pytest.mark.parametrize("arg, owned", [("--served_model_name", "--served-model-name"),
                                        ("--served-model", "--served-model-name"), ("--load_format", "--load-format")])
def test_extra_cli_args_refuse_the_kits_flags_spelled_otherwise(arg, owned):
    """vLLM's parser takes underscores and unique abbreviations: they would win too."""
    with pytest.raises(StudyError, match=f"{arg} is set by the kit \\(as {owned}\\)"):
        study_from_dict(_study(server={"extra_cli_args": [arg, "x"]}))


def test_extra_cli_args_pass_other_flags():
    args = ["--seed", "1", "--swap-space=4", "--portable-thing"]  # a prefix of --port is not --port
    s = study_from_dict(_study(server={"extra_cli_args": args}))
    assert s.server.extra_cli_args == args


# ---------------------------------------------------------------- dtype on the CPU engine

def _choice(dtype):
    return machine.DtypeChoice(dtype=dtype, reason=f"because {dtype}")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cpu_engine_fills_an_unset_dtype_from_the_cpu(monkeypatch, dtype):
    monkeypatch.setattr(grid, "cpu_dtype", lambda: _choice(dtype))
    (p,) = expand(study_from_dict(_study()), engine="cpu")
    assert p.engine_args.dtype == dtype and "--dtype" in p.engine_args.cli()
    assert p.effective.dtype == dtype and p.effective.dtype_reason == f"because {dtype}"


def test_a_set_dtype_and_the_gpu_engine_are_left_alone(monkeypatch):
    monkeypatch.setattr(grid, "cpu_dtype", lambda: pytest.fail("the CPU must not be asked"))
    (p,) = expand(study_from_dict(_study(engine_args={"dtype": "bfloat16"})), engine="cpu")
    assert p.engine_args.dtype == "bfloat16" and p.effective.dtype_reason is None
    (g,) = expand(study_from_dict(_study()), engine="gpu")
    assert g.engine_args.dtype is None and g.effective.dtype is None and g.effective.dtype_reason is None


# ---------------------------------------------------------------- ids and run order

def test_point_id():
    assert point_id({"max_num_batched_tokens": 512, "tensor_parallel_size": 2, "seed": 1}) == \
        "mbt=512__tp=2__seed=1"  # an axis without an abbreviation keeps its name
    assert point_id({"kv_cache_memory_bytes": 2**30, "enable_prefix_caching": False}) == "kv=1GiB__pc=off"


def _points(n: int) -> list[Point]:
    return [Point(id=f"p{i}", values={}, engine_args=EngineArgs()) for i in range(n)]


def test_run_order_holds_every_point_once_per_block():
    pts = _points(6)
    units = run_order(pts, replicates=3, seed=0)
    assert len(units) == 18
    for block in (1, 2, 3):
        in_block = [u for u in units if u.block == block]
        assert sorted(u.point for u in in_block) == sorted(p.id for p in pts)
        assert all(u.start == block for u in in_block)  # start k of each point lies in block k
    assert [u.block for u in units] == sorted(u.block for u in units)  # blocks run one after another


def test_run_order_is_a_seeded_shuffle():
    pts = _points(8)
    order = [u.point for u in run_order(pts, 1, seed=5)]
    assert order == [u.point for u in run_order(pts, 1, seed=5)]  # replays
    assert sorted(order) == [p.id for p in pts]
    others = {tuple(u.point for u in run_order(pts, 1, seed=s)) for s in range(6)}
    assert len(others) > 1                                          # the seed matters
    assert any(o != tuple(p.id for p in pts) for o in others)       # not just the grid order
    b1, b2 = (run_order(pts, 2, seed=5)[i * 8:(i + 1) * 8] for i in range(2))
    assert [u.point for u in b1] != [u.point for u in b2]           # each block its own shuffle


def test_a_second_block_does_not_reorder_the_first():
    pts = _points(7)
    one = run_order(pts, 1, seed=11)
    three = run_order(pts, 3, seed=11)
    assert three[:7] == one
    assert run_order(pts, 2, seed=11) == three[:14]


# ---------------------------------------------------------------- the Prefix Reuse Budget in a study

def test_scheduler_ratios_are_an_axis_beside_the_grid():
    s = study_from_dict(_study(grid={"max_num_batched_tokens": [128, 256]},
                               scheduler={"min_reuse_ratio": ["off", 0.8], "max_defer_ms": 300}))
    pts = expand(s, "cpu")
    assert [p.id for p in pts] == ["mbt=128__mrr=off", "mbt=128__mrr=0.80", "mbt=256__mrr=off", "mbt=256__mrr=0.80"]
    assert pts[0].prefix_budget is None
    assert pts[1].prefix_budget.min_reuse_ratio == 0.8 and pts[1].prefix_budget.max_defer_ms == 300
    assert "min_reuse_ratio" not in pts[1].engine_args.model_dump()


def test_a_single_ratio_is_fixed_for_every_point():
    pts = expand(study_from_dict(_study(scheduler={"min_reuse_ratio": 0.5})), "cpu")
    assert all(p.prefix_budget.min_reuse_ratio == 0.5 and "mrr" not in p.id for p in pts)


@pytest.mark.parametrize("scheduler, match", [
    ({"min_reuse_ratio": [0.5, 1.5]}, "less than or equal to 1"),
    ({"min_reuse_ratio": ["off", "off"]}, "repeats a value"),
    ({"min_reuse_ratio": 0.8, "max_defer_ms": -1}, "greater than or equal to 0"),
])
def test_bad_scheduler_settings_are_explained(scheduler, match):
    with pytest.raises(StudyError, match=match):
        study_from_dict(_study(scheduler=scheduler))


def test_the_scheduler_needs_prefix_caching_and_a_launched_server():
    with pytest.raises(StudyError, match="needs prefix caching"):
        study_from_dict(_study(engine_args={"enable_prefix_caching": False}, scheduler={"min_reuse_ratio": 0.8}))


def test_a_point_with_the_budget_launches_the_plugin(tmp_path):
    from vllm_study.define.grid import PointPlan
    from vllm_study.measure.point import PointStart
    s = study_from_dict(_study(scheduler={"min_reuse_ratio": ["off", 0.8], "max_defer_ms": 250}))
    off, on = expand(s, "cpu")[:2]
    flags_on = PointStart(PointPlan(study=s, point=on, engine="cpu"), tmp_path / "a").launcher.measurement_flags()
    flags_off = PointStart(PointPlan(study=s, point=off, engine="cpu"), tmp_path / "b").launcher.measurement_flags()
    i = flags_on.index("--scheduler-cls")
    assert flags_on[i + 1] == "vllm_study.scheduler_plugin.PrefixBudgetScheduler"
    cfg = json.loads(flags_on[flags_on.index("--additional-config") + 1])
    # no path: it would key the compile cache
    assert cfg == {"prefix_budget": {"min_reuse_ratio": 0.8, "max_defer_ms": 250}}
    # without the budget: the step-records scheduler (vLLM's own scheduling, each step recorded)
    assert flags_off[flags_off.index("--scheduler-cls") + 1] == "vllm_study.scheduler_plugin.StepRecordsScheduler"
    s = study_from_dict(_study(scheduler={"min_reuse_ratio": ["off", 0.8]}, server={"step_records": False}))
    off, on = expand(s, "cpu")[:2]
    assert "--scheduler-cls" not in PointStart(PointPlan(study=s, point=off, engine="cpu"),
                                               tmp_path / "c").launcher.measurement_flags()
    assert "--scheduler-cls" in PointStart(PointPlan(study=s, point=on, engine="cpu"),
                                           tmp_path / "d").launcher.measurement_flags()


def test_step_records_are_on_for_launched_servers_and_say_why_not(tmp_path):
    from vllm_study.measure.launcher import step_records_env
    on = study_from_dict(_study())
    env, warnings = {}, []
    raw = step_records_env(on, tmp_path, env, warnings)
    assert raw == tmp_path / "steps.raw" and env == {"VLLM_STUDY_STEPS": str(raw)} and warnings == []
    own = study_from_dict(_study(server={"extra_cli_args": ["--scheduler-cls", "my.Sched"]}))
    env, warnings = {}, []
    assert step_records_env(own, tmp_path, env, warnings) is None and env == {}
    assert len(warnings) == 1 and "--scheduler-cls" in warnings[0] and "step_records: false" in warnings[0]
    said_off = study_from_dict(_study(server={"extra_cli_args": ["--scheduler-cls", "my.Sched"],
                                              "step_records": False}))
    env, warnings = {}, []
    assert step_records_env(said_off, tmp_path, env, warnings) is None and (env, warnings) == ({}, [])


def test_the_study_can_leave_vllms_flop_estimates_out():
    """--enable-mfu-metrics costs the engine a per-step estimate: a study that gives
    --no-enable-mfu-metrics keeps it off (the kit's flag, added after, would win)."""
    from vllm_study.launch.machine import vllm_accepts
    from vllm_study.measure.launcher import counting_flags
    on = counting_flags("gpu", (2048, 512), [])
    assert json.loads(on[on.index("--custom-histogram-buckets") + 1]) == {"request_tokens": [512, 2048]}
    assert ("--enable-mfu-metrics" in on) == vllm_accepts("--enable-mfu-metrics")
    assert "--enable-mfu-metrics" not in counting_flags("gpu", (2048,), ["--no-enable-mfu-metrics"])
    assert "--enable-mfu-metrics" not in counting_flags("gpu", (2048,), ["--no_enable_mfu_metrics"])
    assert "--enable-mfu-metrics" not in counting_flags("cpu", (2048,), [])
    assert counting_flags("gpu", (), ["--no-enable-mfu-metrics"]) == []


def test_chunk_not_a_multiple_of_the_block_says_where_it_splits_the_prompts():
    s = study_from_dict(_study(grid={"max_num_batched_tokens": [200]}, workload={"system_prompt_tokens": 1000}))
    (p,) = expand(s, "cpu")
    (w,) = [w for w in p.warnings if "block size" in w]
    assert "chunks that end at 200, 400, 600, 800" in w
    assert "4 of those 4 ends fall inside a block (at offsets 72, 16, 88, 32)" in w


def test_the_wall_time_estimate_counts_a_start_ahead_as_a_quarter_or_half_of_a_start():
    """Twelve 7B starts of two points on one H200: started ahead, every start after the
    first leaves a quarter of its start-up on the critical path where its configuration
    compiled before, half where it is new (the second point's first start); without it,
    all of it."""
    from vllm_study.define.timing import (AHEAD_SHARE, AHEAD_SHARE_NEW, GPU_START_S, GPU_START_S_PER_GB,
                                          estimate_minutes)
    base = {"name": "t", "model": {"card": "qwen2.5-7b"}, "grid": {"max_num_batched_tokens": [64, 128]},
            "replicates": 6, "rounds": 2}
    ahead = estimate_minutes(study_from_dict({**base, "server": {"start_ahead": True}}), "gpu", 2, "NVIDIA H200")
    off = estimate_minutes(study_from_dict({**base, "server": {"start_ahead": False}}), "gpu", 2, "NVIDIA H200")
    start = GPU_START_S + GPU_START_S_PER_GB * 2 * 7.6  # 7.6e9 parameters in bf16
    assert (off - ahead) * 60 == pytest.approx(((1 - AHEAD_SHARE_NEW) + 10 * (1 - AHEAD_SHARE)) * start, rel=0.02)


def test_the_wall_time_estimate_counts_priming_from_a_modelled_kv_size():
    """One H200, Qwen2.5-7B at 0.92: vLLM kept 2,063,088 tokens of KV and priming took 58 s
    a round; the rough model's KV is within 5% and its priming of that order. A point
    without caching is not primed, and the estimate grows by priming on every round."""
    from vllm_study.define.grid import expand
    from vllm_study.define.timing import estimate_minutes, kv_tokens, priming_s
    s = study_from_dict({"name": "t", "model": {"card": "qwen2.5-7b"}, "engine_args": {"max_model_len": 32768},
                         "grid": {"enable_prefix_caching": [True, False]},
                         "workload": {"kind": "trace", "trace": {"file": "mooncake_conversation", "windows": 2,
                                                                 "requests": 40, "prime": "history"}}})
    on, off = sorted(expand(s, "gpu"), key=lambda p: p.engine_args.enable_prefix_caching is False)
    assert kv_tokens(s, on.engine_args, "gpu", "NVIDIA H200") == pytest.approx(2_063_088, rel=0.05)
    assert 40 < priming_s(s, on.engine_args, "gpu", "NVIDIA H200") < 120
    assert priming_s(s, off.engine_args, "gpu", "NVIDIA H200") == 0.0
    # NVML's reading wins over the table; a smaller utilization holds less
    assert kv_tokens(s, on.engine_args.model_copy(update={"gpu_memory_utilization": 0.5}), "gpu", "NVIDIA H200") \
        < kv_tokens(s, on.engine_args, "gpu", "NVIDIA H200", gpu_bytes=80 * 2**30) \
        < kv_tokens(s, on.engine_args, "gpu", "NVIDIA H200")
    p = priming_s(s, on.engine_args, "gpu", "NVIDIA H200")
    added = estimate_minutes(s, "gpu", 2, "NVIDIA H200", priming=p / 2) - estimate_minutes(s, "gpu", 2, "NVIDIA H200")
    assert added * 60 == pytest.approx(2 * s.steps_per_start * p / 2, rel=1e-6)


def test_the_cpu_engines_priming_estimate_uses_its_kv_size_its_rate_and_the_history_there_is(capsys, tmp_path):
    """On a 2-core EPYC the tiny Qwen2 primed a 128 MiB cache (131k tokens) of the Mooncake
    conversation trace in 24.7-34.6 s a round, which one request's prefill rate modelled at 53 s;
    a window whose history holds fewer tokens than the cache is primed with that history.
    The dry run names the CPU's KV size, not a GPU's."""
    from vllm_study import cli
    from vllm_study.define.grid import expand
    from vllm_study.define.timing import priming_s
    from vllm_study.workload import windows
    base = {"name": "t", "model": {"card": "tiny-qwen2"}, "grid": {"max_num_batched_tokens": [1024]},
            "engine_args": {"max_model_len": 8192, "kv_cache_memory_bytes": 134217728},
            "workload": {"kind": "trace", "concurrency": 4,
                         "trace": {"file": "mooncake_conversation", "start_s": 60, "requests": 20, "prime": "history"}}}
    s = study_from_dict(base)
    p = expand(s, "cpu")[0]
    history = windows.history_tokens(s.workload.trace, s.workload.seed)
    assert 15 < priming_s(s, p.engine_args, "cpu", None, history_tokens=history) < 40
    # early in the trace the history holds ~112k tokens: a 512 MiB cache (524k) is primed with those
    early = study_from_dict({**base, "engine_args": {**base["engine_args"], "kv_cache_memory_bytes": 536870912},
                             "workload": {**base["workload"], "trace": {**base["workload"]["trace"], "start_s": 2}}})
    h = windows.history_tokens(early.workload.trace, early.workload.seed)
    assert h[0] < 524288
    q = expand(early, "cpu")[0]
    assert priming_s(early, q.engine_args, "cpu", None, history_tokens=h) == pytest.approx(
        priming_s(early, q.engine_args, "cpu", None) * h[0] / 524288)
    path = tmp_path / "primed.yaml"
    path.write_text(yaml.safe_dump(base))
    assert cli.main(["sweep", "--dry-run", str(path), "--engine", "cpu"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if "of which priming" in x)
    assert "kv_cache_memory_bytes" in line and "H100" not in line and "about 26 s" in line


def test_start_ahead_is_on_by_default_for_the_gpu_engine_only_and_a_study_can_say_otherwise():
    grid = {"name": "t", "grid": {"max_num_batched_tokens": [64]}}
    default = study_from_dict(grid).server
    assert default.start_ahead is None and default.ahead_on("gpu") and not default.ahead_on("cpu")
    assert not study_from_dict({**grid, "server": {"start_ahead": False}}).server.ahead_on("gpu")
    assert study_from_dict({**grid, "server": {"start_ahead": True}}).server.ahead_on("cpu")
    # the wall-time estimate follows: a GPU study's default is started ahead
    from vllm_study.define.timing import estimate_minutes
    gpu = {**grid, "model": {"card": "qwen2.5-7b"}, "replicates": 3}
    assert estimate_minutes(study_from_dict(gpu), "gpu", 1, "NVIDIA H200") < \
        estimate_minutes(study_from_dict({**gpu, "server": {"start_ahead": False}}), "gpu", 1, "NVIDIA H200")


def test_start_ahead_with_vllm_info_lines_hidden_by_default_is_not_refused():
    """Asked for, hidden INFO lines are refused (below); by default the start says why it
    was not started ahead instead (Launcher._start_ahead_wanted)."""
    s = study_from_dict({"name": "t", "grid": {"max_num_batched_tokens": [64]},
                         "server": {"env": {"VLLM_LOGGING_LEVEL": "WARNING"}}})
    assert s.server.start_ahead is None


def test_start_ahead_with_vllm_info_lines_hidden_is_refused_before_anything_starts():
    with pytest.raises(StudyError,
                       match="start_ahead holds a server at its engine's INFO line.*VLLM_LOGGING_LEVEL=WARNING"):
        study_from_dict({"name": "t", "grid": {"max_num_batched_tokens": [64]},
                         "server": {"start_ahead": True, "env": {"VLLM_LOGGING_LEVEL": "WARNING"}}})


@pytest.mark.parametrize("over, where, allowed", [
    # a list item: the keys of its model (it said "allowed here: " and nothing)
    ({"grid": None, "targets": [{"name": "a", "base_url": "http://127.0.0.1:8000", "model": "m", "api_key": "k"}]},
     "targets.0.api_key", "allowed here: api_key_env, base_url, model, name, proxy"),
    # a mapping's value, one member of a union: that member's keys
    ({"grid": None, "search": {"space": {"max_num_seqs": {"int": [8, 64], "stepp": 8}}, "trials": 4}},
     "search.space.max_num_seqs.IntRange.stepp", "allowed here: int, log, step"),
    ({"grid": None, "search": {"space": {"gpu_memory_utilization": {"float": [0.5, 0.9], "stepp": 0.1}},
                               "trials": 4}},
     "search.space.gpu_memory_utilization.FloatRange.stepp", "allowed here: float, step"),
])
def test_an_unknown_key_inside_a_list_or_mapping_lists_the_keys_allowed_there(over, where, allowed):
    with pytest.raises(StudyError) as ei:
        study_from_dict(_study(**over))
    assert "1 problem(s)" in str(ei.value)   # one mistake, one line (not one per union member)
    line = next(ln for ln in str(ei.value).splitlines() if where in ln)
    assert line.strip().startswith(f"{where}: unknown key")
    assert line.endswith(allowed)


def test_a_grid_may_list_its_points_instead_of_crossing_axes(tmp_path):
    """vLLM's defaults against a searched best with and without caching: three points, not
    the eight of their product; the axes are the union, in the order first given."""
    from vllm_study.define.params import Study
    pts = [{"max_num_batched_tokens": 8192, "max_num_seqs": 1024, "enable_prefix_caching": True},
           {"max_num_batched_tokens": 4096, "max_num_seqs": 64, "enable_prefix_caching": False},
           {"max_num_batched_tokens": 4096, "max_num_seqs": 64, "enable_prefix_caching": True}]
    s = Study(name="x", grid=pts, baseline="mbt=8192__mns=1024__pc=on")
    points = expand(s, engine="gpu")
    assert [p.id for p in points] == ["mbt=8192__mns=1024__pc=on", "mbt=4096__mns=64__pc=off",
                                      "mbt=4096__mns=64__pc=on"]
    assert grid_spec.axes(s.grid) == {"max_num_batched_tokens": [8192, 4096], "max_num_seqs": [1024, 64],
                                      "enable_prefix_caching": [True, False]}
    with pytest.raises(ValueError, match="grid point 2 .* give every point every axis"):
        Study(name="x", grid=[pts[0], {"max_num_batched_tokens": 4096}])
    with pytest.raises(ValueError, match="grid points 1 and 2 are the same configuration"):
        Study(name="x", grid=[pts[0], dict(pts[0])])
    with pytest.raises(ValueError, match="max_num_seqs is both a grid axis and fixed in engine_args"):
        Study(name="x", grid=pts, engine_args={"max_num_seqs": 8})


def test_a_listed_grid_shares_a_start_only_where_one_point_holds_every_largest_limit():
    from vllm_study.define.grid import live_groups
    from vllm_study.define.params import Study
    crossed = Study(name="x", grid=[{"max_num_batched_tokens": 512, "max_num_seqs": 8},
                                    {"max_num_batched_tokens": 256, "max_num_seqs": 16}])
    groups, _ = live_groups(crossed, "cpu", expand(crossed, engine="cpu"))
    assert [len(g) for g in groups] == [1, 1]   # neither point can launch for both
    nested = Study(name="x", grid=[{"max_num_batched_tokens": 512, "max_num_seqs": 16},
                                   {"max_num_batched_tokens": 256, "max_num_seqs": 8}])
    (group,) = live_groups(nested, "cpu", expand(nested, engine="cpu"))[0]
    assert [p.id for p in group] == ["mbt=512__mns=16", "mbt=256__mns=8"]


def test_server_command_resolves_relative_paths_and_python_and_refuses_a_bad_value(tmp_path, monkeypatch):
    import sys
    base = {"name": "s", "grid": {"max_num_batched_tokens": [256]}}
    assert study_from_dict(base).server.program() is None  # vLLM's own entrypoint
    (tmp_path / "tools").mkdir()
    (tmp_path / "tools" / "engine.py").write_text("")
    monkeypatch.chdir(tmp_path)
    s = study_from_dict({**base, "server": {"command": ["python", "tools/engine.py", "--x"]}})
    assert s.server.command == ["python", str(tmp_path / "tools" / "engine.py"), "--x"]
    assert s.server.program() == (sys.executable, str(tmp_path / "tools" / "engine.py"), "--x")
    for bad, says in [([], "no empty word"), (["python", ""], "no empty word"), (["--model", "m"], "first word"),
                      (["python", "tools/missing.py"], f"resolved against the working directory, {tmp_path}"),
                      ("python engine.py", "valid list")]:
        with pytest.raises(StudyError, match="server.command") as e:
            study_from_dict({**base, "server": {"command": bad}})
        assert says in str(e.value), (bad, str(e.value))
