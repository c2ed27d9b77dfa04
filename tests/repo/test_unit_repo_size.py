"""The tracked tree stays small: every call to a GPU machine carries all of it (64 MiB at
most), and the committed runs are most of it. tools/lean_run.py makes a run lean before
it is committed (docs/results.md)."""
from __future__ import annotations

import subprocess

import pytest
from paths import REPO

# 24.5 MiB with the trace-window runs, whose requests benchmarks/primed_vs_cold.py reads, and
# the steady-state capacity run, whose requests the capacity statistic's bootstrap resamples
# (each of its confirmation starts ~0.65 MB after lean_run, up to 5 more); 31 MiB with the
# H100 predict-then-confirm run, whose step records the step model refits from and whose
# requests its capacities rest on (3.8 MB after lean_run); 35.4 MiB with the H100 run of three
# chunk sizes, whose step records hold the attention pairs the step model's term is fitted
# from (2.8 MB). A call carries the tree and one part of the GPU bundle (~137 MiB): at 36 MiB
# of tree, parts of 27.5 MiB still fit the 64 MiB, so the bundle goes in 5 calls
# (make-bundle.sh sizes the parts to the tree)
LIMIT_MIB = 36


def test_the_tracked_tree_weighs_under_36_mib():
    try:
        listed = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: nothing is tracked")
    sizes = {p: (REPO / p).stat().st_size for p in listed.decode().split("\0") if p and (REPO / p).is_file()}
    total = sum(sizes.values()) / 2**20
    largest = sorted(sizes, key=sizes.get, reverse=True)[:5]
    assert total < LIMIT_MIB, (f"the tracked tree is {total:.1f} MiB (limit {LIMIT_MIB}); largest: {largest}. "
                               "Run tools/lean_run.py on new run folders (docs/results.md)")
