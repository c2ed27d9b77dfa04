"""Cut the trace windows the kit ships (vllm_study.define.traces.SHIPPED) from the full public
traces, copy the full traces beside them (as published, gzipped), and write their README
and licence files.

    python tools/cut_trace_windows.py [SOURCE_FOLDER]   # default: ../shared/traces

Each window is the original's first N requests, byte for byte (a CSV's header and any
byte-order mark kept), gzipped deterministically (no name, mtime 0), so re-running
writes identical files. The full traces are copied byte for byte under their original
names (`ShippedTrace.original`), for windows taken across the whole trace (windows.py).
"""
from __future__ import annotations

import argparse
import gzip
import io
import shutil
import sys
from pathlib import Path

from vllm_study.define.params import TraceSpec
from vllm_study.define.traces import DATA, SHIPPED, read_trace

ROOT = Path(__file__).resolve().parents[1]
HEADER_LINES = {"mooncake": 0, "jsonl": 0, "azure": 1, "burstgpt": 1}


def first_lines(src: Path, n: int) -> bytes:
    """The first n lines of a gzipped file, as stored (line endings included)."""
    out = []
    with gzip.open(src, "rb") as f:
        for line in f:
            if len(out) == n:
                break
            out.append(line)
    if len(out) < n:
        sys.exit(f"{src}: has {len(out)} lines, the window needs {n}; is it the full trace?")
    return b"".join(out)


def write_gzip(dest: Path, data: bytes) -> None:
    """gzip with no file name and mtime 0: the same bytes give the same file."""
    buf = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=buf, compresslevel=9, mtime=0) as z:
        z.write(data)
    dest.write_bytes(buf.getvalue())


def readme() -> str:
    rows = []
    for name, s in SHIPPED.items():
        t = read_trace(TraceSpec(file=name))
        assert len(t.requests) == s.requests and abs(t.duration_s - s.span_s) < 1e-6, (name, t.duration_s)
        size = s.path.stat().st_size
        rows.append(f"| `{s.file}` | `{name}` | {s.source} | {s.licence} (`{s.licence_file}`) "
                    f"| {s.requests} | {t.duration_s:.1f} s ({t.rate:.2f} req/s) | {size / 1024:.0f} KiB |")
    attributions = "\n".join(f"- `{name}`: {s.attribution}" for name, s in SHIPPED.items())
    full = []
    for name, s in SHIPPED.items():
        t = read_trace(TraceSpec(file=str(DATA / s.original), format=s.format))
        full.append(f"| `{s.original}` | `{name}` | {s.source} | {s.licence} (`{s.licence_file}`) "
                    f"| {len(t.requests):,} | {t.duration_s:,.1f} s ({t.rate:.2f} req/s) "
                    f"| {(DATA / s.original).stat().st_size / 1024:.0f} KiB |")
    return f"""# Shipped trace windows

The first requests of public LLM serving traces, byte for byte (gzipped), for
`workload.kind: trace` (`trace.file: <name>`). Written by `tools/cut_trace_windows.py`
from the full traces; do not edit by hand.

| file | name | source (repository @ commit, path) | licence | requests | span | size |
|---|---|---|---|---|---|---|
{chr(10).join(rows)}

## Whole traces

The full published traces, byte for byte as their sources publish them (gzipped), for
windows taken across the whole trace (`vllm_study.workload.windows`) and the prefix-cache model
(`vllm_study.workload.prefix_cache_model`); the windows above are their first rows.

| file | windows above | source (repository @ commit, path) | licence | requests | span | size |
|---|---|---|---|---|---|---|
{chr(10).join(full)}

Mooncake timestamps are milliseconds and its `hash_ids` stand for 512-token prefix
blocks; Azure rows carry lengths only (no prefix information).

## Attribution

{attributions}

The whole traces: the same sources and licences, every request, unchanged.
"""


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("source", nargs="?", type=Path, default=ROOT.parent / "shared" / "traces",
                    help="folder of the full traces (default: ../shared/traces from the repository root)")
    args = ap.parse_args(argv)
    DATA.mkdir(parents=True, exist_ok=True)
    for s in SHIPPED.values():
        data = first_lines(args.source / s.original, HEADER_LINES[s.format] + s.requests)
        write_gzip(s.path, data)
        print(f"{s.path}: {s.requests} requests, {s.path.stat().st_size} bytes")
        shutil.copyfile(args.source / s.original, DATA / s.original)
    for lic in sorted({s.licence_file for s in SHIPPED.values()}):
        shutil.copyfile(args.source / lic, DATA / lic)
    (DATA / "README.md").write_text(readme())


if __name__ == "__main__":
    main()
