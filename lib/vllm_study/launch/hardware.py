"""How close to the hardware a round ran: model FLOPs utilization (MFU) and memory
bandwidth use, against the GPU's datasheet peaks.

The work comes from vLLM's own accounting where the server exports it
(--enable-mfu-metrics: estimated FLOPs and bytes per GPU, vllm/v1/metrics/perf.py);
otherwise it is estimated from the model's config: 2 x parameters x scheduled tokens
for FLOPs, and the weights read once per engine step for bytes. That estimate leaves
attention and KV-cache reads out, so it is a lower bound, and the round record says
which source was used.
"""
from __future__ import annotations

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


def peaks(gpu_name: str) -> tuple[float, float] | None:
    """(FLOP/s, bytes/s) for an NVML device name such as 'NVIDIA H200', or None."""
    name = gpu_name.removeprefix("NVIDIA ").strip()
    for key in sorted(PEAKS, key=len, reverse=True):  # the most specific name first
        if name.startswith(key):
            return PEAKS[key]
    return None


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
