"""Make a finished run folder lean before it is committed: keep what a report, a test or
a FINDINGS.md reads, and each figure once. Every GPU machine call carries the whole
tracked tree, so the committed runs must stay small.

    python tools/lean_run.py [--drop-logs] results/<run> [results/<run> ...]

In place; a second pass changes nothing but, at most, a few bytes of a PNG:
- report.ipynb: image outputs are dropped (each figure is in figures/; `vllm_study report`
  re-executes the notebook, so report.html gets them back). Tables stay, so nbval over
  the committed report compares what it compared before. Papermill's per-cell timings
  go too (cell tags and the page's metadata stay).
- points/*/s*/point.ipynb: removed. It is notebooks/point.ipynb at the run's commit
  with the start's folder as parameters; its figures are in start.json, rounds.jsonl
  and summary.json.
- points/*/s*/requests.jsonl.gz: removed, unless the study has `capacity` or `search`
  (their statistics are re-derived from the requests) or `trace.windows`; where kept,
  each request's inter-token gaps are kept to 4 significant digits (ITL_DIGITS: 0.05% at
  most, and no gap becomes 0, which the capacity fit's log margins could not take; a
  fifth of the bytes of the H200 steady-state run's requests). Not 3 digits: their 0.5%
  moved that run's fitted capacity 1% (3.33 to 3.37 req/s) where ITL P99's margin runs
  flat along its bound; 4 digits moved an interval's end by 0.01 req/s.
- points/*/s*/steps.raw: removed (a start that stopped before its finish leaves it); the
  rounds' engine steps stay, in steps/r<round>.npz (the step-time model's data).
- point.json, summary.json, start.json: written without indentation (same values).
- every *.png: re-encoded losslessly (RGBA without transparency as RGB, then oxipng);
  a re-encoding that changes a pixel or is not smaller is not kept.
- with --drop-logs, points/*/s*/server.log(.gz) too: pass it unless the run's FINDINGS.md
  reads the server logs.
Prints the bytes before and after.
"""
from __future__ import annotations

import gzip
import importlib.util
import io
import json
import sys
from pathlib import Path

import nbformat
import numpy as np
from PIL import Image

COMPACT = ("point.json", "summary.json", "start.json")
ITL_DIGITS = 4   # significant: relative, so a gap of microseconds stays above 0
REQUESTS, NOTEBOOK, LOGS = "requests.jsonl.gz", "point.ipynb", ("server.log", "server.log.gz")
STEPS_RAW = "steps.raw"


def strip_images(nb) -> None:
    """Drop image/* from every output; an output left with no data goes."""
    for cell in nb.cells:
        outs = []
        for o in cell.get("outputs", []):
            data = o.get("data")
            if data is not None:
                for k in [k for k in data if k.startswith("image/")]:
                    del data[k]
                if not data:
                    continue
            outs.append(o)
        if cell.cell_type == "code":
            cell.outputs = outs


def strip_report(nb) -> None:
    strip_images(nb)
    for cell in nb.cells:
        for key in ("papermill", "execution"):
            cell.metadata.pop(key, None)


def compact_json(path: Path) -> None:
    text = json.dumps(json.loads(path.read_text()), separators=(",", ":"), ensure_ascii=False) + "\n"
    if text != path.read_text():
        path.write_text(text)


def _rewrite(path: Path, change) -> None:
    nb = nbformat.read(path, as_version=4)
    change(nb)
    text = nbformat.writes(nb)
    if not text.endswith("\n"):
        text += "\n"
    if text != path.read_text():
        path.write_text(text)


def keeps_requests(run: Path) -> bool:
    """Capacity and search runs re-derive their statistics from the requests; a study of
    trace windows keeps them for benchmarks/primed_vs_cold.py's request-level intervals."""
    study = json.loads((run / "manifest.json").read_text()).get("params") or {}
    trace = (study.get("workload") or {}).get("trace") or {}
    return bool(study.get("capacity") or study.get("search") or trace.get("windows"))


def round_itl(path: Path) -> None:
    """Rewrite a requests file with its itl_s gaps rounded to ITL_DIGITS significant
    digits (gzip without a timestamp, so a second pass writes the same bytes)."""
    with gzip.open(path, "rt") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    for r in rows:
        if r.get("itl_s"):
            r["itl_s"] = [float(f"{x:.{ITL_DIGITS}g}") for x in r["itl_s"]]
    buf = io.BytesIO()
    with gzip.GzipFile(fileobj=buf, mode="wb", mtime=0) as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows).encode())
    if buf.getvalue() != path.read_bytes():
        path.write_bytes(buf.getvalue())


def optimise_png(path: Path) -> None:
    """Lossless only: the new file must decode to the same pixels (as RGBA). oxipng
    (level 2: its filter and deflate search) takes about a sixth off what Pillow writes."""
    import oxipng
    raw = path.read_bytes()
    im = Image.open(io.BytesIO(raw))
    im.load()
    before = np.asarray(im.convert("RGBA"))
    if im.mode == "RGBA" and (before[..., 3] == 255).all():
        im = im.convert("RGB")  # no transparency to keep
    buf = io.BytesIO()
    im.save(buf, "PNG", optimize=True)
    new = oxipng.optimize_from_memory(buf.getvalue(), level=2)
    if len(new) < len(raw) and np.array_equal(np.asarray(Image.open(io.BytesIO(new)).convert("RGBA")), before):
        path.write_bytes(new)


def size(run: Path) -> int:
    return sum(p.stat().st_size for p in run.rglob("*") if p.is_file())


def lean(run: Path, drop_logs: bool = False) -> tuple[int, int]:
    run = Path(run)
    if not (run / "manifest.json").is_file():
        raise SystemExit(f"{run}: not a run folder (no manifest.json); pass results/<run>")
    if importlib.util.find_spec("oxipng") is None:
        raise SystemExit("tools/lean_run.py needs pyoxipng (environment.yml): pip install pyoxipng==9.1.1")
    before = size(run)
    if (run / "report.ipynb").is_file():
        _rewrite(run / "report.ipynb", strip_report)
    keep = keeps_requests(run)
    for start in sorted(d for d in run.glob("points/*/s*") if d.is_dir()):
        gone = [NOTEBOOK, STEPS_RAW] + ([] if keep else [REQUESTS]) + (list(LOGS) if drop_logs else [])
        for name in gone:
            (start / name).unlink(missing_ok=True)
        if keep and (start / REQUESTS).is_file():
            round_itl(start / REQUESTS)
    for name in COMPACT:
        for path in sorted(run.glob(f"points/**/{name}")):
            compact_json(path)
    for png in sorted(run.rglob("*.png")):
        optimise_png(png)
    return before, size(run)


def main(argv: list[str]) -> None:
    drop_logs = "--drop-logs" in argv
    runs = [a for a in argv if a != "--drop-logs"]
    if not runs:
        raise SystemExit(__doc__)
    for arg in runs:
        before, after = lean(Path(arg), drop_logs)
        print(f"{arg}: {before / 1e6:.2f} MB -> {after / 1e6:.2f} MB")


if __name__ == "__main__":
    main(sys.argv[1:])
