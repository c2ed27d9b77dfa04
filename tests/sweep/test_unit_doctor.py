"""doctor: each check finds what it is for and says the fix; and the machine facts it
reports (machine.py: GPUs, the CPU and the dtype the CPU engine picks from it)."""
from __future__ import annotations

import shutil
import socket

import pytest

from vllm_study import doctor
from vllm_study.launch import machine
from vllm_study.launch.machine import CpuInfo, GpuInfo
from vllm_study.define.study_file import study_from_dict
from vllm_study.workload.workload import word_pieces as _REAL_WORD_PIECES


def test_proxy_that_captures_loopback_is_flagged_with_the_fix():
    f = doctor.check_proxies({"HTTPS_PROXY": "http://proxy.example:3128"})
    assert f.status == doctor.WARN and "NO_PROXY does not cover" in f.detail
    assert f.detail.startswith("HTTPS_PROXY set")
    # the kit itself is not affected; other tools are, and the finding says which
    assert "the kit never sends its own requests through proxy variables" in f.detail
    assert "vllm bench serve" in f.detail and "curl" in f.detail
    assert f.fix == "export NO_PROXY=127.0.0.1,localhost"


def test_no_proxy_must_cover_both_loopback_names():
    f = doctor.check_proxies({"http_proxy": "http://p:1", "no_proxy": "localhost"})
    assert f.status == doctor.WARN and f.detail.startswith("http_proxy set")


def test_proxy_with_loopback_exempted_is_fine():
    f = doctor.check_proxies({"HTTP_PROXY": "http://p:1", "NO_PROXY": "localhost, 127.0.0.1,.corp"})
    assert f.status == doctor.OK and "NO_PROXY covers loopback" in f.detail


def test_no_proxy_variables():
    assert doctor.check_proxies({}).status == doctor.OK


def test_port_in_use_is_reported():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        f = doctor.check_port(port)
    assert f.status == doctor.WARN and "in use" in f.detail
    assert doctor.check_port(port).status == doctor.OK  # free again once closed


def test_disk_below_need_fails(tmp_path):
    assert doctor.check_disk(tmp_path, need_gib=10**9).status == doctor.FAIL
    assert doctor.check_disk(tmp_path, need_gib=0).status == doctor.OK


def test_gpu_and_vllm_on_this_machine():
    from vllm_study.launch.machine import NvmlProbe, vllm_distribution
    gpu = doctor.check_gpu()
    if NvmlProbe().available:
        assert gpu.status == doctor.OK and "driver" in gpu.detail
    else:  # CI: no GPU, said plainly, with what happens instead
        assert gpu.status == doctor.WARN and "CPU build" in gpu.detail
    v = doctor.check_vllm(gpu=False)
    assert v.status == doctor.OK and v.detail.startswith(f"{vllm_distribution()} ")


def test_finding_prints_the_fix_only_when_something_is_wrong():
    assert "fix:" in str(doctor.Finding(doctor.FAIL, "x", "broken", "do this"))
    assert "fix:" not in str(doctor.Finding(doctor.OK, "x", "fine", "do this"))


class _FakeProbe:
    """NvmlProbe as a machine with two GPUs would answer (describe gives GpuInfo)."""
    available, why = True, ""

    def __init__(self, indices=None):
        self.indices = [0, 1]

    def describe(self):
        return [GpuInfo(index=i, name="NVIDIA H200", memory_total_bytes=141 * 2**30, driver="570.1",
                        uuid=f"GPU-{i}") for i in self.indices]


def test_gpu_finding_on_a_gpu_machine(monkeypatch):
    monkeypatch.setattr(doctor, "NvmlProbe", _FakeProbe)
    f = doctor.check_gpu()
    assert f.status == doctor.OK
    assert f.detail == "NVIDIA H200 (141 GiB), NVIDIA H200 (141 GiB), driver 570.1"


def test_machine_describe_and_engine_without_gpu(monkeypatch):
    class NoGpu:
        available, why = False, "no NVIDIA GPU visible (test)"

        def __init__(self, indices=None):
            pass

        def describe(self):
            return []
    monkeypatch.setattr(machine, "NvmlProbe", NoGpu)
    m = machine.describe()
    assert m.gpus == [] and m.no_gpu_reason == "no NVIDIA GPU visible (test)"
    assert m.cpu == machine.cpu_info() and m.host
    assert machine.resolve_engine("auto") == "cpu"
    assert machine.resolve_engine("gpu") == "gpu"  # asked for: kept
    monkeypatch.setattr(machine, "NvmlProbe", _FakeProbe)
    assert machine.resolve_engine("auto") == "gpu"
    assert [g.uuid for g in machine.describe().gpus] == ["GPU-0", "GPU-1"]


# ---------------------------------------------------------------- the CPU and its dtype

def _cpu(**features) -> CpuInfo:
    base = dict(model="Test CPU", machine="x86_64", cores=2, capability="AVX2", avx512=False,
                avx512_bf16=False, amx=False)
    return CpuInfo(**{**base, **features})


@pytest.mark.parametrize("features", [{}, {"avx512": True, "capability": "AVX512"},
                                      {"avx512_bf16": None, "amx": None, "capability": None}])
def test_cpu_dtype_is_float32_without_native_bf16(features):
    choice = machine.cpu_dtype(_cpu(**features))
    assert choice.dtype == "float32"
    assert "no AVX-512 BF16 or AMX" in choice.reason and "emulated" in choice.reason
    # the reason names what the CPU is: its dispatch level, else its model
    assert (features.get("capability", "AVX2") or "Test CPU") in choice.reason


@pytest.mark.parametrize("features, named", [
    ({"avx512": True, "avx512_bf16": True, "capability": "AVX512"}, "AVX-512 BF16"),
    ({"avx512": True, "amx": True, "capability": "AVX512"}, "AMX"),
    ({"avx512": True, "avx512_bf16": True, "amx": True, "capability": "AVX512"}, "AMX"),
])
def test_cpu_dtype_is_bfloat16_with_avx512_bf16_or_amx(features, named):
    choice = machine.cpu_dtype(_cpu(**features))
    assert choice.dtype == "bfloat16"
    assert choice.reason == f"the CPU has {named}: bf16 is native"


def test_cpu_dtype_defaults_to_this_machine():
    assert machine.cpu_dtype() == machine.cpu_dtype(machine.cpu_info())


def test_cpu_finding_names_features_and_dtype(monkeypatch):
    monkeypatch.setattr(doctor, "cpu_info", lambda: _cpu(model="EPYC", cores=2))
    f = doctor.check_cpu()
    assert f.status == doctor.OK
    assert f.detail.startswith("EPYC, 2 cores, torch dispatch AVX2, none of AVX-512, AVX-512 BF16, AMX;")
    assert "the CPU engine runs float32 where a study leaves dtype unset" in f.detail
    monkeypatch.setattr(doctor, "cpu_info", lambda: _cpu(model="Xeon", cores=8, capability="AVX512",
                                                         avx512=True, amx=True))
    f = doctor.check_cpu()
    assert "torch dispatch AVX512, AVX-512, AMX;" in f.detail
    assert "runs bfloat16" in f.detail and "the CPU has AMX" in f.detail


# ---------------------------------------------------------------- study_findings

@pytest.fixture(scope="module")
def fast_pieces(qwen_pieces):
    """word_pieces decodes the whole vocabulary: once (tests/conftest.py)."""
    import vllm_study.workload.workload as workload
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(workload, "word_pieces", lambda tokenizer: list(qwen_pieces))
        yield


def _study(model: dict | None = None, **workload) -> object:
    return study_from_dict({"name": "t", "model": model or {}, "grid": {"max_num_batched_tokens": [512]},
                            "workload": {"system_prompt_tokens": 100, **workload}})


def test_study_findings_for_a_card(model_cache, fast_pieces, monkeypatch):
    monkeypatch.setenv("VLLM_STUDY_CACHE", str(model_cache))
    model, chat = doctor.study_findings(_study())
    assert model.status == doctor.OK and model.check == "model"
    assert "dummy weights of card tiny-qwen2" in model.detail
    assert "encodes 'Hello world!' as [9707, 1879, 0]" in model.detail
    assert chat.status == doctor.OK and chat.check == "chat template"
    assert chat.detail == "renders the shared_prefix workload via chat"


def test_study_findings_model_path_not_a_folder(tmp_path):
    (f,) = doctor.study_findings(_study({"path": str(tmp_path / "missing")}))
    assert f.status == doctor.FAIL and "is not a folder on this machine" in f.detail
    assert f.fix == "fix model.path in the study"
    (f,) = doctor.study_findings(_study({"path": str(tmp_path)}))  # a folder without config.json
    assert f.status == doctor.FAIL and f.detail == f"model.path {tmp_path} has no config.json"


def test_study_findings_tokenizer_that_cannot_load(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "no-such-arch"}')  # and no tokenizer files
    (f,) = doctor.study_findings(_study({"path": str(tmp_path)}))
    assert f.status == doctor.FAIL and "cannot prepare the model or its tokenizer" in f.detail
    assert f.fix == "check model.card / model.path in the study"


def test_study_findings_folder_whose_tokenizer_is_empty(tmp_path, monkeypatch):
    """transformers builds an empty Qwen2 tokenizer for a qwen2 config.json without
    tokenizer files: a finding that says so, not a crash (IndexError) in the doctor."""
    import vllm_study.workload.workload as workload
    monkeypatch.setattr(workload, "word_pieces", _REAL_WORD_PIECES)  # whatever fast_pieces did
    (tmp_path / "config.json").write_text('{"model_type": "qwen2"}')
    findings = doctor.study_findings(_study({"path": str(tmp_path)}))
    fails = [f for f in findings if f.status == doctor.FAIL]
    assert len(fails) == 1 and fails[0].check == "chat template"
    assert "the tokenizer has only 0 single-token ' word' pieces" in fails[0].detail


def test_study_findings_folder_without_chat_template(model_cache, fast_pieces, tmp_path):
    src = model_cache / "models" / "tiny-qwen2"
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):  # no chat_template.jinja
        shutil.copy(src / name, tmp_path / name)
    model, chat = doctor.study_findings(_study({"path": str(tmp_path)}))
    assert model.status == doctor.OK and f"{tmp_path} (its own weights)" in model.detail
    assert chat.status == doctor.FAIL and "has no chat template" in chat.detail
    assert "workload.api: completions" in chat.detail
    model, comp = doctor.study_findings(_study({"path": str(tmp_path), "dummy_weights": True}, api="completions"))
    assert "(dummy weights)" in model.detail
    assert comp.status == doctor.OK and comp.detail == "renders the shared_prefix workload via completions"
