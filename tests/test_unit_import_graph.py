"""The package's shape, read from its source (tools/layout.py reads it the same way):

- its modules import one another without a cycle, lazy imports inside functions included
  (a cycle there still ties two modules together: neither can change alone);
- each module imports only its own package and packages of a lower layer
  (vllm_study.LAYERS), at most 8 layers;
- the slot lock's module imports nothing of the package, so every executor may use it;
- no module over 600 lines, no class over 200;
- server.extra_cli_args is read by one parser."""
from __future__ import annotations

import sys
from pathlib import Path

import networkx as nx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
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


def test_no_module_over_600_lines_and_no_class_over_200():
    modules = {m: n for m, n in layout.module_lines().items() if n > layout.MAX_MODULE_LINES}
    classes = {c: n for c, n in layout.class_lines().items() if n > layout.MAX_CLASS_LINES}
    assert (modules, classes) == ({}, {})
    assert layout.class_lines()["vllm_study.measure.point.PointStart"] > 20  # the reading finds classes


def test_extra_cli_args_are_read_by_one_parser():
    """No module walks server.extra_cli_args itself: a lookup goes through
    schema.parse_flags (the list may still be passed on whole, as the server's argv)."""
    import ast
    walks = []
    for name, path in layout.modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            loops = [g.iter for g in getattr(node, "generators", [])]
            loops += [node.iter] if isinstance(node, ast.For) else []
            walks += [f"{name}:{it.lineno}" for it in loops
                      if isinstance(it, ast.Attribute) and it.attr == "extra_cli_args"]
    assert walks == []
    from vllm_study.define.schema import parse_flags
    assert parse_flags(["--a", "1", "--b_c=2", "--d", "--e", "x"]) == {"a": "1", "b_c": "2", "d": True, "e": "x"}


def test_the_chunk_size_forms_from_study_file_to_argv_are_read_by_the_kits_code(tmp_path):
    """tools/layout.py --knob: one value, 2048, from a study file to the vLLM argv, the
    serve --config key and the heatmap axis; a knob the grid lacks is named."""
    study = tmp_path / "s.yaml"
    study.write_text("name: s\ngrid:\n  max_num_batched_tokens: [2048, 512]\n")
    forms = dict(layout.knob_forms("max_num_batched_tokens", study))
    assert forms["study file (YAML)"] == "max_num_batched_tokens: [2048, 512]"
    assert forms["Study.grid, Point.values, EngineArgs (one int)"] == "2048"
    assert forms["point id"] == "mbt=2048"
    assert forms["vLLM argv"] == "--max-num-batched-tokens 2048"
    assert forms["serve --config key (export)"] == "max-num-batched-tokens: 2048"
    assert forms["heatmap axis"] == "max_num_batched_tokens (chunk size)"
    with pytest.raises(SystemExit, match="'max_num_seqs' is not an axis"):
        layout.knob_forms("max_num_seqs", study)
