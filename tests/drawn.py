"""Whether a saved figure has data drawn on it, whatever its file size.

Figures are saved as palette PNGs (vocab/figure_file.py), whose size depends on the data as
much as on what was drawn: a byte threshold failed a sparse but complete figure. Checked
instead: a PNG of a figure's size with marks in colour. Frames, ticks and text are grey, so an
empty axes has no coloured pixel; the sparsest committed figure (one marker and its legend
entry) has 142.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image


def assert_drawn(path: Path, *, min_side: int = 200, min_coloured_px: int = 50) -> None:
    with Image.open(path) as im:
        assert im.format == "PNG", f"{path.name}: {im.format}, not a PNG"
        w, h = im.size
        px = np.asarray(im.convert("RGB")).astype(int)
    assert min(w, h) >= min_side, f"{path.name}: {w}x{h} px"
    coloured = int(((px.max(axis=2) - px.min(axis=2)) > 40).sum())  # grey has R = G = B
    assert coloured >= min_coloured_px, f"{path.name}: {coloured} coloured pixels, nothing plotted"
