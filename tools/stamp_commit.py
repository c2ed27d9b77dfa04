"""Name the commit in a copy of the checkout that will travel without .git.

A run records the commit its code came from (manifest.json: git). A copy shipped to a
machine without the repository's history (a GPU machine given the working tree) has no
git to ask: run this in the checkout before the copy leaves, and carry the file it
writes with the copy (git ignores it). The sweep reads it where git answers nothing.

    python tools/stamp_commit.py            # writes .vllm-study-commit: "<sha> clean" or "<sha> dirty"

VLLM_STUDY_GIT_SHA (and VLLM_STUDY_GIT_DIRTY=1) in the copy's environment does the same
and wins over the file.
"""
from __future__ import annotations

import sys
from pathlib import Path

from vllm_study.records.results import COMMIT_FILE, git_output

ROOT = Path(__file__).resolve().parents[1]


def stamp(root: Path = ROOT) -> Path:
    sha = git_output("rev-parse", "HEAD", cwd=root)
    if sha is None:
        raise SystemExit(f"error: {root} is not a git checkout: there is no commit to name; run this where "
                         "the copy is made from")
    dirty = git_output("status", "--porcelain", "--untracked-files=no", cwd=root)
    path = root / COMMIT_FILE
    path.write_text(f"{sha} {'dirty' if dirty else 'clean'}\n")
    return path


if __name__ == "__main__":
    p = stamp()
    print(f"{p}: {p.read_text().strip()}", file=sys.stderr)
