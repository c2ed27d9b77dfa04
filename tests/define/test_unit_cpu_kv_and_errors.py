"""A CPU study without a KV size (defect 7): the kit's default, the same in doctor,
--dry-run and the sweep, recorded in the study; a failed server's reason keeps vLLM's
whole error line; an empty study file says it is empty (defect 13b)."""
from __future__ import annotations

import textwrap

import pytest
import yaml

from vllm_study import cli, doctor, sweep
from vllm_study.define.grid import CPU_KV_CAP, CPU_KV_STEP, cpu_kv_default, expand
from vllm_study.define.schema import StudyError
from vllm_study.define.study_file import load_study, study_from_dict
from vllm_study.records.results import GitState
from vllm_study.launch.server import QUOTE_CAP, failure_reason

GiB = 2**30


def _study(**over) -> dict:
    base = {"name": "t", "grid": {"max_num_batched_tokens": [256, 512]},
            "workload": {"system_prompt_tokens": 100, "question_tokens": 8, "output_tokens": 8}}
    base.update(over)
    return base


@pytest.fixture
def thirteen_gib_free(monkeypatch):
    """The machine of the report: 13.01 GiB free; no VLLM_CPU_KVCACHE_SPACE around."""
    import psutil

    class Mem:
        available = int(13.01 * GiB)
    monkeypatch.setattr(psutil, "virtual_memory", lambda: Mem)
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)


# ---------------------------------------------------------------- the KV default

def test_cpu_study_without_kv_size_gets_a_default_in_every_point(thirteen_gib_free):
    s = study_from_dict(_study())
    points = expand(s, "cpu")
    want = 3328 * 2**20  # a quarter of 13.01 GiB, down to 256 MiB steps: 3.25 GiB
    for p in points:
        assert p.engine_args.kv_cache_memory_bytes == want
        assert ["--kv-cache-memory-bytes", str(want)] == p.engine_args.cli()[2:4]
        (note,) = [w for w in p.warnings if "KV cache size is not set" in w]
        assert "engine_args.kv_cache_memory_bytes: 3489660928" in note and "0.92" in note
    # recorded in the study itself: study.yaml, the manifest's params and --resume keep it
    assert s.model_dump(mode="json")["engine_args"]["kv_cache_memory_bytes"] == want
    again = expand(study_from_dict(s.model_dump(mode="json")), "cpu")  # as --resume reads study.yaml
    assert [p.engine_args for p in again] == [p.engine_args for p in points]
    assert not any("KV cache size" in w for p in again for w in p.warnings)


def test_kv_default_is_a_quarter_of_free_ram_capped_and_stepped():
    s = study_from_dict(_study())
    assert cpu_kv_default(s, "cpu", available=64 * GiB)[0] == CPU_KV_CAP == 4 * GiB
    assert cpu_kv_default(s, "cpu", available=int(13.01 * GiB))[0] == 3328 * 2**20
    assert cpu_kv_default(s, "cpu", available=GiB // 2)[0] == CPU_KV_STEP  # never below one step


@pytest.mark.parametrize("over", [
    {"engine_args": {"kv_cache_memory_bytes": 2**28}},
    {"grid": {"kv_cache_memory_bytes": [2**24, 2**27]}},
    {"engine_args": {"gpu_memory_utilization": 0.3}},   # the study chose vLLM's fraction itself
    {"server": {"env": {"VLLM_CPU_KVCACHE_SPACE": "2"}}},
    {"server": {"extra_cli_args": ["--kv-cache-memory-bytes=268435456"]}},
    {"server": {"extra_cli_args": ["--gpu_memory_utilization", "0.4"]}},
])
def test_a_study_that_sizes_the_cpu_memory_keeps_its_own(over, thirteen_gib_free):
    s = study_from_dict(_study(**over))
    assert cpu_kv_default(s, "cpu") is None
    before = s.engine_args.model_copy()
    points = expand(s, "cpu")
    assert s.engine_args == before
    assert not any("KV cache size" in w for p in points for w in p.warnings)


def test_the_environment_variable_counts_and_the_gpu_engine_is_left_alone(thirteen_gib_free, monkeypatch):
    s = study_from_dict(_study())
    assert cpu_kv_default(s, "gpu") is None
    (p, _) = expand(s, "gpu")
    assert p.engine_args.kv_cache_memory_bytes is None
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")  # the sweep's servers inherit it
    assert cpu_kv_default(s, "cpu") is None


def test_doctor_dry_run_and_sweep_say_the_same(thirteen_gib_free, monkeypatch, tmp_path, capsys):
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump(_study(server={"engine": "cpu"})))
    # doctor: a warning with the key and the value (not a clean bill)
    (kv,) = doctor.cpu_kv_findings(load_study(path))
    assert kv.status == doctor.WARN and kv.check == "KV cache"
    assert kv.fix.startswith("set engine_args.kv_cache_memory_bytes: 3489660928")
    monkeypatch.setattr(doctor, "study_findings", lambda study: [])  # the model is doctor's other check
    assert cli.main(["doctor", str(path)]) == 0
    assert "[warn] KV cache: " + kv.detail in capsys.readouterr().out
    # --dry-run: the same words, the size in the vllm args
    assert cli.main(["sweep", "--dry-run", str(path)]) == 0
    out = capsys.readouterr().out
    assert f"  warning: {kv.detail}" in out and "--kv-cache-memory-bytes 3489660928" in out
    # the sweep's run folder: its study.yaml and manifest carry the size, its warnings the note
    study = load_study(path)
    points = expand(study, "cpu")
    monkeypatch.setattr(sweep, "git_state", lambda repo: GitState(sha="0" * 40, dirty=False))
    run = sweep.create_run(tmp_path / "results", study, "cpu", points)
    assert yaml.safe_load(run.study_path.read_text())["engine_args"]["kv_cache_memory_bytes"] == 3489660928
    m = run.manifest()
    assert m.params["engine_args"]["kv_cache_memory_bytes"] == 3489660928
    assert kv.detail in m.warnings[points[0].id]
    assert run.point(points[0].id).plan().point.engine_args.kv_cache_memory_bytes == 3489660928


# ---------------------------------------------------------------- failure reasons
# vLLM 0.32's CPU build, started without a KV size where 0.92 of the RAM is not free
# (vllm/v1/worker/cpu_worker.py): the message of the report, in the engine core's
# process as with --distributed-executor-backend uni, then the front end's traceback.
CPU_RESERVE = (
    "ValueError: Available memory on node 0 (13.01/15.59 GiB) on startup is less than desired CPU memory "
    "utilization (0.92, 14.34 GiB). On the CPU backend, the `--gpu-memory-utilization` flag controls the "
    "fraction of CPU memory reserved (despite its name). To resolve: decrease `--gpu-memory-utilization` "
    "(e.g. `--gpu-memory-utilization 0.5`) or reduce CPU memory used by other processes.")
FRONT_END_TAIL = textwrap.dedent("""\
    Traceback (most recent call last):
      File "<frozen runpy>", line 198, in _run_module_as_main
      File "/venv/lib/python3.11/site-packages/vllm/v1/engine/utils.py", line 1431, in wait_for_engine_startup
        raise RuntimeError(
    RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}
    """)


def _engine_core_trace(root: str, proc: str = "EngineCore pid=9402", where: str = "core.py:1510") -> str:
    pre = f"({proc}) ERROR 12-01 18:29:44 [{where}] "
    return "".join(pre + ln + "\n" for ln in (
        "EngineCore failed to start.", "Traceback (most recent call last):",
        '  File "/venv/lib/python3.11/site-packages/vllm/v1/worker/cpu_worker.py", line 83, in __init__',
        "    raise ValueError(", root))


def test_the_cpu_reservation_error_is_quoted_whole_with_its_fix():
    log = ("(APIServer pid=8971) INFO 12-01 18:29:04 [model.py:2152] Using max model len 4096\n"
           + _engine_core_trace(CPU_RESERVE) + FRONT_END_TAIL)
    got = failure_reason(log, returncode=1)
    assert "\n" not in got
    head, _, line = got.partition(" | ")
    assert head.startswith("not enough free RAM for the CPU engine's gpu_memory_utilization share: "
                           "set kv_cache_memory_bytes (exit code 1)")
    assert line == "(EngineCore pid=9402) ERROR 12-01 18:29:44 [core.py:1510] " + CPU_RESERVE


def test_an_unknown_root_cause_is_kept_whole_behind_the_lines_that_reraise_it():
    # the shape of a real vLLM CPU log (worker process, engine core, front end), with a
    # long root cause no pattern knows
    root = "ValueError: " + "the worker could not be set up because " * 12 + "end."
    log = (_engine_core_trace(root, "VllmWorker-0 pid=9503", "multiproc_executor.py:953")
           + _engine_core_trace("Exception: WorkerProc initialization failed due to an exception in a background "
                                "process. See stack trace for root cause.") + FRONT_END_TAIL)
    got = failure_reason(log, returncode=1)
    assert got.startswith("server exit code 1 | (VllmWorker-0 pid=9503) ERROR 12-01 18:29:44 "
                          "[multiproc_executor.py:953] " + root + " / ")
    assert "WorkerProc initialization failed" in got
    assert got.endswith("RuntimeError: Engine core initialization failed. See root cause above. "
                        "Failed core proc(s): {}")
    assert "File " not in got and "raise ValueError(" not in got  # frames are not errors


def test_many_error_lines_are_dropped_whole_at_the_cap():
    lines = [f"RuntimeError: attempt {i} " + "y" * 300 for i in range(20)]
    got = failure_reason("\n".join(lines), returncode=1)
    quoted = got.partition(" | ")[2].split(" / ")
    assert len(" / ".join(quoted)) <= QUOTE_CAP
    assert quoted == lines[-len(quoted):]  # the newest, each whole
    huge = failure_reason("KeyError: " + "z" * 5000)
    assert huge.partition(" | ")[2] == "KeyError: " + "z" * (QUOTE_CAP - 10) + " ..."  # its head kept


# ---------------------------------------------------------------- an empty study file

@pytest.mark.parametrize("text", ["", "\n\n", "# a study, to be written\n# name: later\n", "---\n"])
def test_an_empty_study_file_says_so_and_shows_a_minimal_study(tmp_path, text):
    path = tmp_path / "study.yaml"
    path.write_text(text)
    with pytest.raises(StudyError) as e:
        load_study(path)
    msg = str(e.value)
    assert f"{path}: the file is empty" in msg and "required key is missing" not in msg
    assert "params/default.yaml" in msg
    minimal = yaml.safe_load(textwrap.dedent(msg.split(":\n", 1)[1].rsplit("\n", 1)[0]))
    assert minimal == {"name": "my-study", "grid": {"max_num_batched_tokens": [512, 2048]}}
    assert expand(study_from_dict(minimal), "gpu")  # the minimal study is a valid one


def test_an_empty_base_file_named_by_extends_is_refused_too(tmp_path):
    (tmp_path / "base.yaml").write_text("# nothing\n")
    (tmp_path / "study.yaml").write_text("extends: base.yaml\nname: x\ngrid: {max_num_batched_tokens: [512]}\n")
    with pytest.raises(StudyError, match=r"base\.yaml: the file is empty"):
        load_study(tmp_path / "study.yaml")
