"""A test marked fake_engine starts servers too (the fake engine's, through the kit's own
launch): it is end to end, so `-m "not e2e"` leaves it out as it does vLLM's."""
from __future__ import annotations

import pytest


def pytest_collection_modifyitems(items):
    for item in items:
        if item.get_closest_marker("fake_engine") and not item.get_closest_marker("e2e"):
            item.add_marker(pytest.mark.e2e)
