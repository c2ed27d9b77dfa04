"""Saving a figure: a PNG of at most 256 colours.

Every committed run keeps its figures, and every call to a GPU machine carries the tracked
tree. matplotlib writes RGBA PNGs: a 13-panel heatmap grid came to ~0.5 MB. The figures are
flat colours, text and colormaps of 256 steps, so a 256-colour palette (no dithering) draws
them the same at about a third of the size. Pillow comes with matplotlib.
"""
from __future__ import annotations

import io
from pathlib import Path

from PIL import Image


def save_figure(fig, out: Path | str, dpi: int) -> None:
    """`fig` to `out`: a palette PNG where `out` ends in .png, else as matplotlib writes it."""
    out = Path(out)
    if out.suffix.lower() != ".png":
        fig.savefig(out, dpi=dpi)
        return
    buf = io.BytesIO()
    fig.savefig(buf, dpi=dpi, format="png")
    buf.seek(0)
    with Image.open(buf) as im:
        im.convert("RGB").quantize(256, method=Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE) \
            .save(out, optimize=True)
