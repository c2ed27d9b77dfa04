"""The model's tokenizer, the one transformers' AutoTokenizer picks, loaded without
AutoTokenizer where the kit has loaded that folder before.

Why not AutoTokenizer every time: importing it costs about 3.5 s of CPU (transformers >= 5
pulls in torch through its auto classes), and every start's kernel, every sweep's
preflight and every report paid it. AutoTokenizer reads the folder, chooses a class and
returns `cls.from_pretrained(folder, _from_auto=True)`; for a local folder the class it
chose is cached here, keyed by what the choice reads (the folder's file names,
tokenizer_config.json, config.json) and transformers' version, and a later load calls that
class directly: about 1 s. A hub id, a tokenizer with remote code (`auto_map`) or a class
outside transformers always goes through AutoTokenizer."""
from __future__ import annotations

import hashlib
import json
import os
from importlib import import_module, metadata
from pathlib import Path

from . import models

CLASSES = "tokenizer-classes.json"  # in the kit's cache folder: {key: "module:ClassName"}


def load(model: str):
    """The tokenizer of `model` (a folder or a hub id), as AutoTokenizer loads it."""
    key = _key(model)
    cached = _read().get(key) if key else None
    if cached:
        module, name = cached.split(":")
        return getattr(import_module(module), name).from_pretrained(model, _from_auto=True)
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model)
    cls = type(tok)
    if key and cls.__module__.startswith("transformers."):
        _write(key, f"{cls.__module__}:{cls.__name__}")
    return tok


def cache_file() -> Path:
    return models.cache_dir().parent / CLASSES


def _key(model: str) -> str | None:
    """What AutoTokenizer's choice of class reads, hashed; None where it is not all in a
    local folder (a hub id) or the choice may run the model's own code."""
    folder = Path(model).expanduser()
    if not folder.is_dir():
        return None
    h = hashlib.sha256(metadata.version("transformers").encode())
    h.update(str(folder.resolve()).encode())
    h.update("\0".join(sorted(p.name for p in folder.iterdir())).encode())
    for name in ("tokenizer_config.json", "config.json"):
        f = folder / name
        text = f.read_bytes() if f.is_file() else b""
        if name == "tokenizer_config.json" and b'"auto_map"' in text:
            return None
        h.update(name.encode() + b"\0" + text)
    return h.hexdigest()


def _read() -> dict:
    try:
        return json.loads(cache_file().read_text())
    except (OSError, ValueError):
        return {}


def _write(key: str, ref: str) -> None:
    """Add one entry; a file written whole and renamed, so a parallel start reads the old
    file or the new one, never half of one (two writing at once may lose one entry: the
    next load writes it again)."""
    f = cache_file()
    try:
        f.parent.mkdir(parents=True, exist_ok=True)
        tmp = f.with_name(f"{f.name}.{os.getpid()}")
        tmp.write_text(json.dumps({**_read(), key: ref}, indent=1))
        os.replace(tmp, f)
    except OSError:
        pass  # a cache that cannot be written costs the next load AutoTokenizer's import, nothing more
