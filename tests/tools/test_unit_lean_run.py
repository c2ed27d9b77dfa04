"""tools/lean_run.py on a made-up run folder: what a report, a test or a FINDINGS.md
reads stays (values, tables, pixels), the rest goes."""
from __future__ import annotations

import gzip
import importlib.util
import io
import json
import subprocess
import sys
from pathlib import Path

import nbformat
import numpy as np
import pytest
from PIL import Image

from synthetic_run import make_run

from vllm_study.scheduler_plugin import steps
from paths import REPO



def _lean_module():
    pytest.importorskip("oxipng", reason="pyoxipng (environment.yml) is not installed")
    spec = importlib.util.spec_from_file_location("lean_run", REPO / "tools" / "lean_run.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _png(alpha: int) -> bytes:
    rng = np.random.default_rng(0)
    px = np.zeros((60, 80, 4), dtype=np.uint8)
    px[..., :3] = rng.integers(0, 4, (60, 80, 3)) * 60  # 64 colours: room to compress
    px[..., 3] = alpha
    buf = io.BytesIO()
    Image.fromarray(px, "RGBA").save(buf, "PNG", compress_level=0)
    return buf.getvalue()


def _pixels(data: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(data)).convert("RGBA"))


def _dress(run: Path) -> None:
    """What a real sweep adds to a run folder: the executed report with a figure and a
    checked table, each start's notebook, requests and server log, and figures/."""
    import base64
    nb = nbformat.v4.new_notebook()
    table = nbformat.v4.new_code_cell("t", metadata={"tags": ["nbval-check-output"], "papermill": {"duration": 1.0}})
    table.outputs = [nbformat.v4.new_output("execute_result", {"text/plain": "a  b", "text/html": "<table/>"},
                                            execution_count=1)]
    fig = nbformat.v4.new_code_cell("f", metadata={"tags": [], "execution": {"iopub.status.busy": "x"}})
    fig.outputs = [nbformat.v4.new_output("display_data", {"image/png": base64.b64encode(_png(255)).decode(),
                                                            "text/plain": "<Figure>"}),
                   nbformat.v4.new_output("display_data", {"image/svg+xml": "<svg/>"})]
    nb.cells = [table, fig]
    nbformat.write(nb, run / "report.ipynb")
    (run / "figures").mkdir()
    (run / "figures" / "opaque.png").write_bytes(_png(255))
    (run / "figures" / "clear.png").write_bytes(_png(128))
    for start in _starts(run):
        (start / "point.ipynb").write_text("{}")
        with gzip.open(start / "requests.jsonl.gz", "wt") as f:
            f.write('{"ttft": 0.1}\n')
        with gzip.open(start / "server.log.gz", "wt") as f:
            f.write("INFO started\n")
        (start / "steps.raw").write_bytes(b"\0" * 64)  # a start that stopped before its finish
        steps.save_round(start, 0, np.zeros(3, dtype=steps.DTYPE))


def _starts(run: Path) -> list[Path]:
    return [d for d in (run / "points").glob("*/s*") if d.is_dir()]


def _jsons(run: Path) -> dict:
    return {str(p.relative_to(run)): json.loads(p.read_text()) for p in sorted(run.rglob("*.json"))}


def test_lean_run_keeps_what_is_read_and_drops_the_rest(tmp_path):
    lean_run = _lean_module()
    run = make_run(tmp_path, {"mbt=256__kv=16MiB": {"ttft_p90_ms": 100.0}}).path
    _dress(run)
    values, pngs = _jsons(run), {p.name: (p.read_bytes()) for p in (run / "figures").iterdir()}

    before, after = lean_run.lean(run)
    assert after < before
    nb = nbformat.read(run / "report.ipynb", as_version=4)
    table, fig = nb.cells
    assert table.outputs[0].data == {"text/plain": "a  b", "text/html": "<table/>"}  # what nbval compares
    assert table.metadata == {"tags": ["nbval-check-output"]}
    assert [o.data for o in fig.outputs] == [{"text/plain": "<Figure>"}]  # the svg-only output is gone
    starts = _starts(run)
    assert starts and all(not (s / "point.ipynb").exists() and not (s / "requests.jsonl.gz").exists()
                          and (s / "server.log.gz").exists() for s in starts)
    assert all(not (s / "steps.raw").exists() and len(steps.load_round(steps.round_path(s, 0))) == 3
               for s in starts)  # the rounds' engine steps stay
    assert _jsons(run) == values and "\n  " not in (starts[0] / "start.json").read_text()
    for name, old in pngs.items():
        new = (run / "figures" / name).read_bytes()
        assert np.array_equal(_pixels(new), _pixels(old)) and len(new) < len(old)

    again = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    lean_run.main(["--drop-logs", str(run)])
    assert not any(s.joinpath("server.log.gz").exists() for s in starts)
    now = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    assert set(now) == {p for p in again if p.name != "server.log.gz"}
    for p, b in now.items():  # the rest was lean already (a PNG may lose a few more bytes, never a pixel)
        assert b == again[p] if p.suffix != ".png" else \
            len(b) <= len(again[p]) and np.array_equal(_pixels(b), _pixels(again[p]))


def test_lean_run_keeps_the_requests_of_a_capacity_or_search_run(tmp_path):
    lean_run = _lean_module()
    run = make_run(tmp_path, {"mbt=256__kv=16MiB": {"ttft_p90_ms": 100.0}}).path
    _dress(run)
    manifest = json.loads((run / "manifest.json").read_text())
    manifest["params"]["capacity"] = {"metric": "ttft_p90_ms"}
    (run / "manifest.json").write_text(json.dumps(manifest))
    rows = [{"ttft_s": 0.1234567, "itl_s": [0.0052371, 0.2102904, 0.0000081]}, {"ttft_s": 0.2, "itl_s": []}]
    with gzip.open(_starts(run)[0] / "requests.jsonl.gz", "wt") as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows))
    lean_run.lean(run)
    starts = _starts(run)
    assert starts and all((s / "requests.jsonl.gz").exists() for s in starts)
    with gzip.open(starts[0] / "requests.jsonl.gz", "rt") as f:
        kept = [json.loads(line) for line in f]
    # 4 significant digits: no gap of microseconds becomes 0 (the capacity fit takes logs)
    assert kept == [{"ttft_s": 0.1234567, "itl_s": [0.005237, 0.2103, 0.0000081]}, {"ttft_s": 0.2, "itl_s": []}]
    again = (starts[0] / "requests.jsonl.gz").read_bytes()
    lean_run.lean(run)
    assert (starts[0] / "requests.jsonl.gz").read_bytes() == again   # a second pass writes the same bytes


def test_lean_run_keeps_the_requests_of_a_trace_windows_run(tmp_path):
    lean_run = _lean_module()
    run = make_run(tmp_path, {"mbt=256__kv=16MiB": {"ttft_p90_ms": 100.0}}).path
    _dress(run)
    manifest = json.loads((run / "manifest.json").read_text())
    manifest["params"]["workload"] = {"kind": "trace", "trace": {"file": "mooncake_conversation", "windows": 3}}
    (run / "manifest.json").write_text(json.dumps(manifest))
    lean_run.lean(run)
    starts = _starts(run)
    assert starts and all((s / "requests.jsonl.gz").exists() for s in starts)


def test_lean_run_refuses_a_folder_that_is_not_a_run(tmp_path):
    lean_run = _lean_module()
    with pytest.raises(SystemExit, match="not a run folder.*results/<run>"):
        lean_run.lean(tmp_path)
    done = subprocess.run([sys.executable, str(REPO / "tools" / "lean_run.py")], capture_output=True, text=True)
    assert done.returncode != 0 and "--drop-logs" in done.stderr
