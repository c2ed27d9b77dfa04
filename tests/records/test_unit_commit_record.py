"""A run made from a copy of the kit without .git still records the commit it came from:
the copy carries tools/stamp_commit.py's file (or VLLM_STUDY_GIT_SHA names it); with
neither, the sweep says so before it starts and the manifest keeps the note."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_study import sweep
from vllm_study.define.grid import expand
from vllm_study.define.study_file import study_from_dict
from vllm_study.records.results import COMMIT_FILE, NO_COMMIT, git_state
from paths import REPO



@pytest.fixture
def no_env(monkeypatch):
    monkeypatch.delenv("VLLM_STUDY_GIT_SHA", raising=False)
    monkeypatch.delenv("VLLM_STUDY_GIT_DIRTY", raising=False)


def _checkout(tmp_path: Path) -> tuple[Path, str]:
    """A small git repository with the stamp tool in it, as the kit's checkout has it."""
    repo = tmp_path / "repo"
    (repo / "tools").mkdir(parents=True)
    shutil.copy(REPO / "tools" / "stamp_commit.py", repo / "tools")
    shutil.copy(REPO / ".gitignore", repo)
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(repo)]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-qm", "c"], check=True)
    return repo, subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()


def test_a_copy_without_git_records_the_commit_its_stamp_names(tmp_path, no_env):
    repo, sha = _checkout(tmp_path)
    subprocess.run([sys.executable, str(repo / "tools" / "stamp_commit.py")], check=True,
                   env={"PYTHONPATH": str(REPO / "lib"), "PATH": "/usr/bin:/bin"})
    assert (repo / COMMIT_FILE).read_text() == f"{sha} clean\n"
    # git ignores the stamp: it travels with a copy of the tree, never into a commit
    status = subprocess.run(["git", "-C", str(repo), "status", "--porcelain"], capture_output=True, text=True)
    assert status.stdout == ""
    assert git_state(repo).sha == sha and git_state(repo).source == "git"   # in the checkout git answers
    copy = tmp_path / "copy"
    shutil.copytree(repo, copy, ignore=shutil.ignore_patterns(".git"))
    g = git_state(copy)
    assert (g.sha, g.dirty, g.source) == (sha, False, "stamp file")


def test_the_environment_names_the_commit_over_the_stamp(tmp_path, monkeypatch):
    (tmp_path / COMMIT_FILE).write_text("a" * 40 + " dirty\n")
    assert (git_state(tmp_path).sha, git_state(tmp_path).dirty) == ("a" * 40, True)
    monkeypatch.setenv("VLLM_STUDY_GIT_SHA", "b" * 40)
    assert git_state(tmp_path).sha == "b" * 40 and git_state(tmp_path).source == "VLLM_STUDY_GIT_SHA"


def test_a_run_from_a_copy_that_names_no_commit_says_so_and_keeps_the_note(tmp_path, monkeypatch, capsys, no_env):
    monkeypatch.setattr(sweep, "REPO", tmp_path)     # a copy without .git or stamp
    study = study_from_dict({"name": "s", "model": {"card": "tiny-qwen2"},
                             "grid": {"max_num_batched_tokens": [256]},
                             "engine_args": {"kv_cache_memory_bytes": 268435456}})
    run = sweep.create_run(tmp_path / "results", study, "cpu", expand(study, "cpu"))
    assert run.path.name.endswith("-nogit") and run.manifest().git.source == "none"
    assert NO_COMMIT in run.manifest().notes
    err = capsys.readouterr().err
    assert "tools/stamp_commit.py" in err and "VLLM_STUDY_GIT_SHA" in err
    (tmp_path / COMMIT_FILE).write_text("c" * 40 + " clean\n")
    run = sweep.create_run(tmp_path / "results2", study, "cpu", expand(study, "cpu"))
    assert run.path.name.endswith("-" + "c" * 7) and not run.manifest().notes
