"""define/tokenizer.load: the class AutoTokenizer chose for a folder, cached and called
directly next time, gives the same tokenizer without AutoTokenizer's import; anything the
choice reads changing, or remote code, goes through AutoTokenizer again."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from vllm_study.define import tokenizer

MESSAGES = [{"role": "system", "content": "You answer briefly."}, {"role": "user", "content": "héllo wörld <|im_end|>"}]


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """An empty cache of classes (the model folders stay where they are)."""
    monkeypatch.setattr(tokenizer, "cache_file", lambda: tmp_path / tokenizer.CLASSES)
    return tmp_path / tokenizer.CLASSES


def _same(a, b) -> None:
    assert type(a) is type(b)
    assert a.get_vocab() == b.get_vocab() and a.all_special_ids == b.all_special_ids
    assert a.encode(MESSAGES[1]["content"]) == b.encode(MESSAGES[1]["content"])
    assert a.apply_chat_template(MESSAGES, tokenize=False) == b.apply_chat_template(MESSAGES, tokenize=False)
    assert a.init_kwargs == b.init_kwargs


def test_the_class_autotokenizer_chose_is_cached_and_loads_the_same_tokenizer_without_its_import(qwen_dir, cache):
    reference = AutoTokenizer.from_pretrained(str(qwen_dir))
    first = tokenizer.load(str(qwen_dir))   # through AutoTokenizer: it writes the class
    _same(first, reference)
    (ref,) = json.loads(cache.read_text()).values()
    assert ref == f"{type(reference).__module__}:{type(reference).__name__}"
    again = tokenizer.load(str(qwen_dir))   # through the class
    _same(again, reference)
    # in a fresh process the cached load imports neither AutoTokenizer's module nor torch
    code = ("import sys, json; from pathlib import Path; from vllm_study.define import tokenizer; "
            f"tokenizer.cache_file = lambda: Path({str(cache)!r}); "
            f"t = tokenizer.load({str(qwen_dir)!r}); "
            "print(json.dumps([type(t).__name__, 'torch' in sys.modules, "
            "'transformers.models.auto.tokenization_auto' in sys.modules]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == [type(reference).__name__, False, False]


def test_a_changed_config_or_remote_code_goes_through_autotokenizer(qwen_dir, cache, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(qwen_dir, copy)
    key = tokenizer._key(str(copy))
    assert key and key == tokenizer._key(str(copy))
    cfg = copy / "tokenizer_config.json"
    data = json.loads(cfg.read_text())
    cfg.write_text(json.dumps({**data, "model_max_length": 4096}))
    assert tokenizer._key(str(copy)) not in (None, key)   # what the choice reads changed: a new key
    cfg.write_text(json.dumps({**data, "auto_map": {"AutoTokenizer": ["tok.MyTokenizer", None]}}))
    assert tokenizer._key(str(copy)) is None                # the model's own code may choose: never cached
    assert tokenizer._key("Qwen/Qwen2.5-7B-Instruct") is None  # a hub id: not a folder here
    # a cache entry naming a class is all a later load needs; a stale one cannot be used for
    # another folder state, since the key changes with it
    tokenizer._write("k", "m:C")
    assert json.loads(cache.read_text()) == {"k": "m:C"}
