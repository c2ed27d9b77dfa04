"""A test marked fake_engine starts servers too (the fake engine's, through the kit's own
launch): it is end to end, so `-m "not e2e"` leaves it out as it does vLLM's.

The tiny-qwen2 model folder (its tokenizer and chat template) and its word pieces are
made once per test process and shared by the modules that read them: a build takes ~3 s
and word_pieces decodes the whole vocabulary. Each module loads its own tokenizer from
the folder, so no module sees settings another set on it."""
from __future__ import annotations

import os
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def model_cache(tmp_path_factory) -> Path:
    """A kit model cache (the layout of VLLM_STUDY_CACHE) holding tiny-qwen2: the one the
    sweeps use where VLLM_STUDY_CACHE is set, else a fresh one for this test process."""
    from vllm_study.define.models import build_model_dir
    cache = os.environ.get("VLLM_STUDY_CACHE")
    root = Path(cache) if cache else tmp_path_factory.mktemp("cache")
    build_model_dir("tiny-qwen2", root / "models" / "tiny-qwen2")
    return root


@pytest.fixture(scope="session")
def qwen_dir(model_cache) -> Path:
    """tiny-qwen2's folder, as vLLM and the kit load it."""
    return model_cache / "models" / "tiny-qwen2"


@pytest.fixture(scope="session")
def qwen_pieces(qwen_dir) -> tuple[str, ...]:
    """word_pieces of tiny-qwen2's tokenizer (a tuple: no module can change it)."""
    from transformers import AutoTokenizer

    from vllm_study.workload.workload import word_pieces
    return tuple(word_pieces(AutoTokenizer.from_pretrained(str(qwen_dir))))


def pytest_collection_modifyitems(items):
    for item in items:
        if item.get_closest_marker("fake_engine") and not item.get_closest_marker("e2e"):
            item.add_marker(pytest.mark.e2e)
