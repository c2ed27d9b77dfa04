"""The shipped notebooks: parameters papermill can read (a comment it cannot parse makes
the parameter invisible, and the sweep would refuse to run), what the sweep passes is
declared, and no stored outputs (executed copies live under results/ only)."""
from __future__ import annotations

import importlib.util
import json

import papermill as pm
import pytest

from vllm_study.define.grid import Unit
from vllm_study.sweep import REPORT_PARAMS
from vllm_study.measure.unit import POINT_PARAMS, notebook, point_params
from paths import REPO

GENERATOR = REPO / "tools" / "write_notebooks.py"


@pytest.mark.parametrize("name, needed", [("point.ipynb", POINT_PARAMS), ("report.ipynb", REPORT_PARAMS),
                                          ("explore.ipynb", {"run_dir", "other_run", "metric"})])
def test_parameters_are_declared_and_readable(name, needed):
    declared = set(pm.inspect_notebook(str(notebook(name))))
    assert needed <= declared, needed - declared
    cell = next(c for c in json.loads(notebook(name).read_text())["cells"]
                if "parameters" in c.get("metadata", {}).get("tags", []))
    # every assignment line of the parameters cell is one papermill sees
    assigned = {line.split(":")[0].split("=")[0].strip() for line in "".join(cell["source"]).splitlines()
                if line.strip() and not line.startswith("#")}
    assert assigned == declared


def test_what_the_sweep_passes_the_point_notebook_is_what_it_checks(tmp_path):
    given = point_params(tmp_path / "point.json", tmp_path / "s1", Unit(point="p", start=1, block=1), [0],
                         tmp_path / ".slot.lock", tmp_path)
    assert set(given) == POINT_PARAMS


@pytest.mark.parametrize("name", ["point.ipynb", "report.ipynb", "explore.ipynb"])
def test_no_stored_outputs(name):
    cells = json.loads(notebook(name).read_text())["cells"]
    assert all(not c.get("outputs") for c in cells if c["cell_type"] == "code")


def test_the_committed_notebooks_are_what_their_generator_writes(tmp_path):
    """tools/write_notebooks.py is the notebooks' source: an edit made to a notebook alone
    would be lost at the next re-write (run the tool after changing its cell lists)."""
    spec = importlib.util.spec_from_file_location("write_notebooks", GENERATOR)
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    for name, cells in gen.NOTEBOOKS.items():
        gen.write(cells, name, tmp_path)
        assert (tmp_path / name).read_text() == notebook(name).read_text(), \
            f"notebooks/{name} differs from what tools/write_notebooks.py writes: run it and commit the result"
