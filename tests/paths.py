"""The repository's folders, for a test wherever it lies under tests/ (one place that
knows how deep this folder is)."""
from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FAKE_ENGINE = REPO / "tests" / "fake_engine.py"
