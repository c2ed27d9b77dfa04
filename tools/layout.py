"""The package's layout, read from its source: the layers (vllm_study.LAYERS), the package
and size of each module, the package imports between layers, and the largest module and
class, with a warning for those over the size targets (a signal, not a test).
tests/repo/test_unit_import_graph.py holds the package to the same reading of its layers. With
--knob, every form one grid knob takes from a study file to vLLM's command line, its
`serve --config` key and its heatmap axis, each computed by the kit's own code on that
study, one row a form.

    python tools/layout.py
    python tools/layout.py --knob max_num_batched_tokens [--study params/default.yaml]
"""
from __future__ import annotations

import ast
import sys
from pathlib import Path

LIB = Path(__file__).resolve().parents[1] / "lib"
PACKAGE = LIB / "vllm_study"
sys.path.insert(0, str(LIB))

from vllm_study import LAYERS  # noqa: E402

MAX_LAYERS, MAX_MODULE_LINES, MAX_CLASS_LINES = 8, 600, 200


def module_name(path: Path) -> str:
    parts = ("vllm_study", *path.relative_to(PACKAGE).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def package_of(module: str) -> str:
    """The stage package a module belongs to: "" for the root's own modules."""
    parts = module.split(".")
    root_module = len(parts) == 2 and not (PACKAGE / parts[1]).is_dir()
    return "" if len(parts) == 1 or root_module else parts[1]


def layer_of(package: str) -> int:
    for i, layer in enumerate(LAYERS):
        if package in layer:
            return i
    raise KeyError(f"package {package!r} is in no layer of vllm_study.LAYERS; add it there")


def from_module(package: str, node: ast.ImportFrom) -> str:
    """The module a `from ... import` statement in `package` names, relative levels resolved."""
    if not node.level:
        return node.module or ""
    base = package
    for _ in range(node.level - 1):
        base = base.rsplit(".", 1)[0]
    return f"{base}.{node.module}" if node.module else base


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The package modules `name` imports, anywhere in its source (function-local too)."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = from_module(package, node)
            # `from . import x` names a module; `from .m import f` names m
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        found.update(t for t in targets if t in known and t != name)
    return found


def private_imports() -> list[str]:
    """Each name with a leading underscore that a module imports from another of the package:
    a name used across modules is part of an interface and says so by having no underscore."""
    known = modules()
    private = lambda n: n.startswith("_") and not n.startswith("__")  # noqa: E731
    bad = []
    for name, path in known.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        tree = ast.parse(path.read_text())
        aliases = {}  # a local name bound to another module of the package -> that module
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                aliases |= {a.asname: a.name for a in node.names if a.asname and a.name in known}
            if not isinstance(node, ast.ImportFrom):
                continue
            base = from_module(package, node)
            for a in node.names:
                if f"{base}.{a.name}" in known and f"{base}.{a.name}" != name:  # `from . import m as x`
                    aliases[a.asname or a.name] = f"{base}.{a.name}"
                elif base in known and base != name and private(a.name):
                    bad.append(f"{name}:{node.lineno} imports {a.name} from {base}")
        bad += [f"{name}:{node.lineno} reads {aliases[node.value.id]}.{node.attr}" for node in ast.walk(tree)
                if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and node.value.id in aliases and private(node.attr)]
    return bad


def import_edges() -> list[tuple[str, str]]:
    known = modules()
    return sorted((name, t) for name, path in known.items() for t in imports(name, path, known))


def upward_imports() -> list[str]:
    """Each import of a package not below the importer's own (the root `vllm_study`, which
    holds only the version and LAYERS, may be imported from anywhere)."""
    bad = []
    for a, b in import_edges():
        pa, pb = package_of(a), package_of(b)
        if b != "vllm_study" and pa != pb and layer_of(pb) >= layer_of(pa):
            bad.append(f"{a} ({pa or 'root'}, layer {layer_of(pa) + 1}) imports {b} "
                       f"({pb or 'root'}, layer {layer_of(pb) + 1})")
    return bad


def module_lines() -> dict[str, int]:
    return {name: len(path.read_text().splitlines()) for name, path in modules().items()}


def class_lines() -> dict[str, int]:
    """Every class, top-level or nested, by its module and name: its lines, decorators included."""
    out = {}
    for name, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                start = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                out[f"{name}.{node.name}"] = node.end_lineno - start + 1
    return out


def knob_forms(knob: str, study_file: Path, engine: str = "cpu") -> list[tuple[str, str]]:
    """(where, the value as it stands there) for one grid knob of `study_file`'s first point,
    one row a form, none merged. Each is the kit's own code on that study: the study loaded
    and expanded as a sweep does, the files a run writes, the argv and serve config from the
    deployment's codec (launch/flags.py), the heatmap's label and tick from vocab/axes.py."""
    import json
    from vllm_study.define import grid_spec
    from vllm_study.define.grid import expand
    from vllm_study.define.study_file import load_study
    from vllm_study.launch.deployment import VllmServe
    from vllm_study.launch.flags import Flags, flag_name
    from vllm_study.launch.server import vllm_program
    from vllm_study.measure.launcher import counting_flags
    from vllm_study.vocab import axes
    study = load_study(study_file)
    grid = grid_spec.axes(study.grid)
    if knob not in grid:
        raise SystemExit(f"{knob!r} is not an axis of {study_file}'s grid; its axes: {', '.join(grid)}")
    point = expand(study, engine)[0]
    yaml_line = next(ln.strip() for ln in study_file.read_text().splitlines() if ln.strip().startswith(f"{knob}:"))
    value = getattr(point.engine_args, knob)
    served = VllmServe(study.model.path or study.model.card, study.model.served_name, study.model.dummy,
                       engine=point.engine_args.flags(),
                       extra=Flags.parse(study.server.extra_cli_args),
                       measuring=Flags.parse(counting_flags(engine, (value,), study.server.extra_cli_args)),
                       program=study.server.program() or vllm_program())
    argv = Flags.parse(served.command(0))
    name = flag_name(knob)
    axis = axes.get(knob)
    stored = json.dumps({knob: point.engine_args.model_dump(exclude_none=True)[knob]})[1:-1]
    return [("study file (YAML)", yaml_line),
            ("Study.grid axis (define/grid_spec.axes)", f"{knob}: {grid[knob]!r}"),
            ("Point.values (define/grid.expand)", f"{knob}: {point.values[knob]!r}"),
            ("point id (vocab/axes short name and fmt)", point.id),
            ("EngineArgs field", f"{knob}={value!r}"),
            ("Effective (the value vLLM will use)", f"{knob}={getattr(point.effective, knob)!r}"),
            ("point.json, summary.json engine_args (JSON)", stored),
            ("flag name (launch/flags.flag_name)", name),
            ("vLLM argv (VllmServe.command)", " ".join(next(f for f in argv if f.name == name).tokens)),
            ("histogram bound in the argv (measurement flags)",
             " ".join(next((f.tokens for f in served.measuring if f.name == "custom-histogram-buckets"),
                           ("(this vLLM takes no --custom-histogram-buckets)",)))),
            ("serve --config key (export: VllmServe.serve_config)", f"{name}: {served.serve_config()[name]}"),
            ("heatmap axis label (vocab/axes)", axis.label),
            ("heatmap tick (vocab/axes fmt)", axis.fmt(value))]


def over_targets() -> list[str]:
    """The modules and classes longer than the targets: a signal to look for an interface
    to split at, never a reason to move code that has none."""
    over = [f"{m} ({n} lines)" for m, n in module_lines().items() if n > MAX_MODULE_LINES]
    return over + [f"{c} ({n} lines)" for c, n in class_lines().items() if n > MAX_CLASS_LINES]


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if "--knob" in args:
        knob = args[args.index("--knob") + 1]
        study = Path(args[args.index("--study") + 1]) if "--study" in args else LIB.parent / "params" / "default.yaml"
        forms = knob_forms(knob, study)
        print(f"{knob}: {len(forms)} forms from {study.name} to the argv, the serve config and the heatmap")
        for where, form in forms:
            print(f"  {where:52} {form}")
        return
    lines = module_lines()
    print(f"{len(LAYERS)} layers, lowest first (a module imports its own package and lower layers only):")
    for i, layer in enumerate(LAYERS, 1):
        for package in layer:
            members = [m for m in lines if package_of(m) == package and m != "vllm_study"]
            size = sum(lines[m] for m in members)
            print(f"  {i}  {package or '(root)':14} {len(members):2} modules {size:6} lines")
    print("\nmodules:")
    for m in sorted(lines, key=lambda m: (layer_of(package_of(m)), m)):
        print(f"  {package_of(m) or '(root)':14} {m:48} {lines[m]:5}")
    big_module = max(lines, key=lines.get)
    classes = class_lines()
    big_class = max(classes, key=classes.get)
    print(f"\nlargest module: {big_module} ({lines[big_module]} lines; target <= {MAX_MODULE_LINES})")
    print(f"largest class:  {big_class} ({classes[big_class]} lines; target <= {MAX_CLASS_LINES})")
    over = over_targets()
    if over:  # a signal, not a gate: split where an interface is, or leave it
        print(f"warning: over a size target ({MAX_MODULE_LINES} lines a module, {MAX_CLASS_LINES} a class): "
              + ", ".join(over))
    up = upward_imports()
    print("upward imports:", "\n  ".join(["", *up]) if up else "none")
    hidden = private_imports()
    print("private names used across modules:", "\n  ".join(["", *hidden]) if hidden else "none")


if __name__ == "__main__":
    main()
