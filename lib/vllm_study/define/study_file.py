"""Reading a study file: its layers (`base:`), merged, and a validation error turned into
one line per problem, naming the key, what was wrong and the fix."""
from __future__ import annotations

from pathlib import Path
from typing import get_args

import yaml
from pydantic import BaseModel, ValidationError

from .params import Study
from .schema import StudyError, did_you_mean


def _deep_merge(base: dict, over: dict, top: bool = True) -> dict:
    """Later keys win, mappings merge key by key; except that a later `grid` (or
    `search.space`) replaces the earlier one whole (a study that names a grid means that
    grid, not a union). A layer that makes the workload a trace does not inherit its
    base's output_tokens: a trace brings its own (and Workload refuses the key on one)."""
    out = dict(base)
    for k, v in over.items():
        if top and k == "workload" and isinstance(v, dict) and v.get("kind") == "trace" \
                and isinstance(out.get(k), dict) and out[k].get("kind") != "trace":
            out[k] = {kk: vv for kk, vv in out[k].items() if kk != "output_tokens"}
        whole = (top and k == "grid") or k == "space"  # a grid or a search space is meant whole
        merge = isinstance(v, dict) and isinstance(out.get(k), dict) and not whole
        out[k] = _deep_merge(out[k], v, top=False) if merge else v
    return out


MINIMAL_STUDY = "  name: my-study\n  grid:\n    max_num_batched_tokens: [512, 2048]\n"


def _read_layers(path: Path, seen: tuple = ()) -> dict:
    """A file may name a base file with `extends:`, resolved against the including
    file's folder; the including file's keys override the base's."""
    path = Path(path)
    if path in seen:
        raise StudyError(f"{path}: `extends` loops back to itself")
    if not path.exists():
        if seen:
            raise StudyError(f"params file not found: {path}, named by `extends:` in {seen[-1]} "
                             f"(`extends` is resolved against that file's folder, {seen[-1].parent})")
        raise StudyError(f"params file not found: {path}")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise StudyError(f"{path}: not valid YAML: {e}") from e
    if data is None:  # empty or only comments: "name: required key is missing" would not say so
        raise StudyError(f"{path}: the file is empty (or holds only comments). A study needs at least a "
                         f"name and a grid:\n{MINIMAL_STUDY}see params/default.yaml for a complete one")
    if not isinstance(data, dict):
        raise StudyError(f"{path}: expected a mapping of keys at the top, got {type(data).__name__}")
    base = data.pop("extends", None)
    if base is None:
        return data
    return _deep_merge(_read_layers(path.parent / base, seen + (path,)), data)


def explain_errors(err: ValidationError, source: str) -> str:
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "(top level)"
        if e["type"] == "extra_forbidden":
            parent = _model_at(e["loc"][:-1])
            options = sorted(parent.model_fields) if parent else []
            allowed = f"; allowed here: {', '.join(options)}" if options else ""
            lines.append(f"  {loc}: unknown key{did_you_mean(str(e['loc'][-1]), options)}{allowed}")
        elif e["type"] == "missing":
            lines.append(f"  {loc}: required key is missing")
        elif not e["loc"]:  # a check across keys: its message says it all
            lines.append(f"  {e['msg'].removeprefix('Value error, ')}")
        else:
            lines.append(f"  {loc}: {e['msg'].removeprefix('Value error, ')} (got {e.get('input')!r})")
    return f"{source}: {len(lines)} problem(s) in the study definition:\n" + "\n".join(lines)


def _model_at(loc) -> type[BaseModel] | None:
    """The model whose keys are allowed at `loc` (an error's location less its last key).
    A list index or a mapping's key (targets.0, search.space.max_num_seqs) stays in the
    model of the list or mapping it indexes; a union member's name (pydantic puts it in
    the location: search.space.x.FloatRange) picks that member."""
    model: type[BaseModel] = Study
    held: list[type[BaseModel]] = []   # the models the last field's annotation holds
    for part in loc:
        field = model.model_fields.get(part) if isinstance(part, str) else None
        if field is not None:
            held = _models_in(field.annotation)
            if not held:
                return None
            model = held[0]
        else:
            model = next((m for m in held if m.__name__ == part), model)
    return model


def _models_in(annotation) -> list[type[BaseModel]]:
    """The models a field holds: itself, or inside `X | None`, `list[X]`, `dict[str, X]`."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in get_args(annotation) for m in _models_in(arg)]


def load_study(*paths: str | Path) -> Study:
    """Read and validate; later files override earlier ones key by key."""
    if not paths:
        raise StudyError("no params file given")
    data: dict = {}
    for p in paths:
        data = _deep_merge(data, _read_layers(Path(p)))
    return study_from_dict(data, source=" + ".join(str(p) for p in paths))


def study_from_dict(data: dict, source: str = "params") -> Study:
    try:
        return Study.model_validate(data)
    except ValidationError as e:
        raise StudyError(explain_errors(e, source)) from None
