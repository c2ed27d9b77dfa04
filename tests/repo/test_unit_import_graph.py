"""The package's shape, read from its source (tools/layout.py reads it the same way):

- its modules import one another without a cycle, lazy imports inside functions included
  (a cycle there still ties two modules together: neither can change alone);
- each module imports only its own package and packages of a lower layer
  (vllm_study.LAYERS), at most 8 layers;
- the slot lock's module imports nothing of the package, so every executor may use it;
- server.extra_cli_args is read by one parser;
- no module imports or reads a name another module keeps private (a leading underscore).
Size is a signal, not a rule: tools/layout.py prints the modules and classes over its
targets (600 and 200 lines) as a warning; a module is split where an interface is."""

from __future__ import annotations

import sys

import networkx as nx
import pytest
from paths import REPO

sys.path.insert(0, str(REPO / "tools"))
import layout  # noqa: E402
from vllm_study import LAYERS  # noqa: E402

def import_graph() -> nx.DiGraph:
    """Module -> the package modules it imports, anywhere in its source."""
    g = nx.DiGraph()
    g.add_nodes_from(layout.modules())
    g.add_edges_from(layout.import_edges())
    return g


def test_the_import_graph_has_no_cycle():
    g = import_graph()
    assert g.number_of_edges() > 50  # the walk found the package's imports
    assert ("vllm_study.report.report", "vllm_study.vocab.metrics") in g.edges
    assert ("vllm_study.measure.rounds", "vllm_study.capacity.bracket") in g.edges  # `from ..capacity import bracket`
    assert list(nx.simple_cycles(g)) == []


def test_the_slot_lock_imports_nothing_of_the_package():
    assert list(import_graph().successors("vllm_study.launch.slots")) == []


def test_every_module_is_in_a_package_of_one_layer():
    packages = [p for layer in LAYERS for p in layer]
    assert len(packages) == len(set(packages)), "a package is named in two layers"
    for module in layout.modules():
        layout.layer_of(layout.package_of(module))  # raises, naming the package, when it has none
    assert layout.package_of("vllm_study.measure.point") == "measure"
    assert layout.package_of("vllm_study.sweep") == ""


def test_modules_import_only_their_own_package_and_lower_layers():
    assert layout.upward_imports() == []


def test_an_upward_import_is_caught(monkeypatch):
    edges = layout.import_edges()
    monkeypatch.setattr(layout, "import_edges", lambda: [*edges, ("vllm_study.vocab.axes", "vllm_study.report.plots"),
                                                         ("vllm_study.search.config_search", "vllm_study.executors")])
    assert layout.upward_imports() == [
        "vllm_study.vocab.axes (vocab, layer 1) imports vllm_study.report.plots (report, layer 7)",
        "vllm_study.search.config_search (search, layer 6) imports vllm_study.executors (executors, layer 6)"]


def test_at_most_8_layers():
    assert len(LAYERS) <= layout.MAX_LAYERS
    # measured too: the longest chain of package imports
    g = nx.DiGraph((layout.package_of(a), layout.package_of(b)) for a, b in layout.import_edges()
                   if b != "vllm_study" and layout.package_of(a) != layout.package_of(b))
    assert nx.is_directed_acyclic_graph(g)
    assert 5 <= nx.dag_longest_path_length(g) + 1 <= layout.MAX_LAYERS


def test_sizes_over_a_target_are_read_and_printed_as_a_warning_not_a_failure(capsys, monkeypatch):
    assert layout.class_lines()["vllm_study.measure.point.PointStart"] > 20  # the reading finds classes
    monkeypatch.setattr(layout, "MAX_CLASS_LINES", 20)
    assert "vllm_study.measure.point.PointStart" in " ".join(layout.over_targets())
    layout.main([])
    assert "warning: over a size target" in capsys.readouterr().out


def test_extra_cli_args_are_read_by_one_parser():
    """No module walks server.extra_cli_args itself: a lookup goes through
    the codec, launch.flags.Flags (the list may still be passed on whole, as the server's argv)."""
    import ast
    walks = []
    for name, path in layout.modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            loops = [g.iter for g in getattr(node, "generators", [])]
            loops += [node.iter] if isinstance(node, ast.For) else []
            walks += [f"{name}:{it.lineno}" for it in loops
                      if isinstance(it, ast.Attribute) and it.attr == "extra_cli_args"]
    assert walks == []
    from vllm_study.launch.flags import Flags
    assert Flags.parse(["--a", "1", "--b_c=2", "--d", "--e", "x"]).config() == {"a": "1", "b-c": "2", "d": True,
                                                                                  "e": "x"}


def test_no_module_normalises_a_flag_name_but_the_codec():
    """`--a_b` and `--a-b` are one flag: only launch/flags.py turns one form into the other."""
    import re
    forms = re.compile(r"""replace\(["']_["'], ["']-["']\)|replace\(["']-["'], ["']_["']\)|["']--["'] \+""")
    found = [f"{name}:{i}" for name, path in layout.modules().items() if name != "vllm_study.launch.flags"
             for i, line in enumerate(path.read_text().splitlines(), 1) if forms.search(line)]
    assert found == []


def test_the_chunk_size_forms_from_study_file_to_argv_are_read_by_the_kits_code(tmp_path, capsys):
    """tools/layout.py --knob: one value, 2048, from a study file to the vLLM argv, the
    serve --config key and the heatmap axis, one row a form, each what the kit's code
    makes of that study; a knob the grid lacks is named."""
    from vllm_study.define.grid import expand
    from vllm_study.define.study_file import load_study
    from vllm_study.launch.deployment import VllmServe
    from vllm_study.launch.flags import Flags
    study = tmp_path / "s.yaml"
    study.write_text("name: s\ngrid:\n  max_num_batched_tokens: [2048, 512]\n")
    rows = layout.knob_forms("max_num_batched_tokens", study)
    forms = dict(rows)
    assert len(forms) == len(rows) == 13  # no row printed twice under one name
    point = expand(load_study(study), "cpu")[0]
    served = VllmServe("m", "tiny", True, engine=point.engine_args.flags())
    argv = served.command(0)
    assert forms == {
        "study file (YAML)": "max_num_batched_tokens: [2048, 512]",
        "Study.grid axis (define/grid_spec.axes)": "max_num_batched_tokens: [2048, 512]",
        "Point.values (define/grid.expand)": f"max_num_batched_tokens: {point.values['max_num_batched_tokens']}",
        "point id (vocab/axes short name and fmt)": point.id,
        "EngineArgs field": f"max_num_batched_tokens={point.engine_args.max_num_batched_tokens}",
        "Effective (the value vLLM will use)": f"max_num_batched_tokens={point.effective.max_num_batched_tokens}",
        "point.json, summary.json engine_args (JSON)": '"max_num_batched_tokens": 2048',
        "flag name (launch/flags.flag_name)": "max-num-batched-tokens",
        "vLLM argv (VllmServe.command)": " ".join(argv[argv.index("--max-num-batched-tokens"):][:2]),
        "histogram bound in the argv (measurement flags)": '--custom-histogram-buckets {"request_tokens": [2048]}',
        "serve --config key (export: VllmServe.serve_config)":
            f"max-num-batched-tokens: {served.serve_config()['max-num-batched-tokens']}",
        "heatmap axis label (vocab/axes)": "max_num_batched_tokens (chunk size)",
        "heatmap tick (vocab/axes fmt)": "2048"}
    assert point.id == "mbt=2048" and Flags.parse(argv).get("max_num_batched_tokens") == "2048"
    layout.main(["--knob", "max_num_batched_tokens", "--study", str(study)])
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].startswith("max_num_batched_tokens: 13 forms") and len(printed) == 14
    assert all(form in line for (_, form), line in zip(rows, printed[1:]))
    with pytest.raises(SystemExit, match="'max_num_seqs' is not an axis"):
        layout.knob_forms("max_num_seqs", study)


def test_the_architecture_pages_stage_map_names_every_module_of_each_package():
    """docs/architecture.md's stage map: a row per package of LAYERS, in its layer, naming
    each of its modules (a package of only an __init__ says so)."""
    import re
    page = (REPO / "docs" / "architecture.md").read_text()
    rows = {}
    for line in page.splitlines():
        m = re.match(r"\| (\d) \| `?([a-z_]+|\(root\))`? \|.*\| (.*) \|$", line)
        if m:
            rows[m.group(2).replace("(root)", "")] = (int(m.group(1)), set(re.findall(r"`([a-z_]+)`", m.group(3))))
    assert {p for layer in LAYERS for p in layer} == set(rows)
    missing = []
    for module in layout.modules():
        package, short = layout.package_of(module), module.rsplit(".", 1)[-1]
        assert rows[package][0] == layout.layer_of(package) + 1, package
        if module not in ("vllm_study", f"vllm_study.{package}") and short not in rows[package][1]:
            missing.append(module)
    assert missing == []


def test_no_module_imports_or_reads_another_modules_private_name():
    assert layout.private_imports() == []


def test_a_private_name_used_across_modules_is_caught(tmp_path, monkeypatch):
    pkg = tmp_path / "vllm_study" / "report"
    pkg.mkdir(parents=True)
    (pkg / "run.py").write_text("def _lookup():\n    pass\n")
    (pkg / "a.py").write_text("from .run import _lookup, __all__\n")
    (pkg / "b.py").write_text("from . import run as r\nfrom vllm_study.report import run\nr._lookup()\nrun.__name__\n")
    (pkg / "c.py").write_text("import vllm_study.report.run as rr\nrr._lookup()\n")
    known = {f"vllm_study.report.{m}": pkg / f"{m}.py" for m in ("run", "a", "b", "c")}
    monkeypatch.setattr(layout, "modules", lambda: known)
    assert layout.private_imports() == ["vllm_study.report.a:1 imports _lookup from vllm_study.report.run",
                                        "vllm_study.report.b:3 reads vllm_study.report.run._lookup",
                                        "vllm_study.report.c:2 reads vllm_study.report.run._lookup"]
