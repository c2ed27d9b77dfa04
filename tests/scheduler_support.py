"""What the tests that drive vLLM's real scheduler in-process share (no model, no
server): a model folder holding only a 2-layer Qwen2 config.json, which is all
ModelConfig reads with skip_tokenizer_init, and the block hasher prefix caching needs."""
from __future__ import annotations

import json
from pathlib import Path

TINY_QWEN2 = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "vocab_size": 151936, "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6, "rope_theta": 1e6, "tie_word_embeddings": True,
    "hidden_act": "silu", "torch_dtype": "float32"}


def config_only_model(folder: Path, block_size: int):
    """(the folder, now holding TINY_QWEN2 as config.json; vLLM's request block hasher
    over `block_size`-token blocks, sha256 as the engine's default)."""
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    (Path(folder) / "config.json").write_text(json.dumps(TINY_QWEN2))
    init_none_hash(sha256)
    return str(folder), get_request_block_hasher(block_size, sha256)
