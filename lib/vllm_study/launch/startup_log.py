"""Where a vLLM server's start-up went, by the lines its own log prints.

vLLM reports its model loading and its engine init (memory profile, torch.compile,
CUDA graph capture, KV cache allocation, warm-up) in seconds; what is left of
spawn-to-healthy is its processes starting and importing before the engine
initializes. vLLM has no metric for these, so the log lines are read (their wording
differs between releases: both forms are matched).
"""
from __future__ import annotations

import datetime as dt
import re

from .server import without_colours

# each figure's patterns, the first that matches wins. Model loading: "... GiB and 3.1
# seconds" in 0.26, "... GiB memory and 3.1 seconds" in 0.32; the CPU build logs only
# "Initializing model took" (dummy weights are made as the model is built).
FIGURES = {
    "weights_s": (r"Model loading took [\d.]+ GiB(?: memory)? and ([\d.]+) seconds",
                  r"Initializing model took ([\d.]+) seconds"),
    "compile_s": (r"torch.compile took ([\d.]+) s in total",),
    "graphs_s": (r"Graph capturing finished in ([\d.]+) secs",),
    "engine_init_s": (r"init engine \(profile, create kv cache, warmup model\) took ([\d.]+) s",),
}
_LOG_TIME = re.compile(r"INFO (\d\d-\d\d \d\d:\d\d:\d\d)")


def figures(log_text: str) -> dict[str, float | None]:
    """vLLM's own start-up figures from one server's log (None where a line is absent),
    and `gpu_startup_s`: model loading plus engine init, the part of a start-up that
    needs the device (None unless both were logged)."""
    text = without_colours(log_text)
    out = {k: next((float(m.group(1)) for pat in pats if (m := re.search(pat, text))), None)
           for k, pats in FIGURES.items()}
    w, e = out["weights_s"], out["engine_init_s"]
    out["gpu_startup_s"] = w + e if w is not None and e is not None else None
    return out


def engine_to_serving_s(log_text: str) -> float | None:
    """Seconds from the engine's first line ("Initializing a V1 LLM engine") to the API
    server's "Starting vLLM ... server on" line, at the log's one-second resolution."""
    stamps = {}
    for line in without_colours(log_text).splitlines():
        t = _LOG_TIME.search(line)
        if t and "Initializing a V1 LLM engine" in line:
            stamps.setdefault("engine", t.group(1))
        elif t and "Starting vLLM" in line and "server on" in line:
            stamps["serving"] = t.group(1)
    if not {"engine", "serving"} <= stamps.keys():
        return None
    fmt = "%m-%d %H:%M:%S"
    return (dt.datetime.strptime(stamps["serving"], fmt) - dt.datetime.strptime(stamps["engine"], fmt)).total_seconds()
