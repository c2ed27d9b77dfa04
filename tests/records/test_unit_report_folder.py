"""`report` on a committed run leaves the checkout clean: it renders into a copy unless
asked to overwrite (a real git repository in a temp folder)."""
from __future__ import annotations

import subprocess

from vllm_study.records.results import RunFolder
from vllm_study.sweep import report_folder


def _git(cwd, *args):
    subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True)


def test_a_run_whose_report_git_tracks_is_rendered_into_a_copy(tmp_path, capsys):
    run = tmp_path / "repo" / "results" / "20260101T000000Z-x-0000000"
    run.mkdir(parents=True)
    (run / "report.ipynb").write_text("{}")
    (run / "summary.csv").write_text("point\n")
    _git(tmp_path / "repo", "init", "-q")
    _git(tmp_path / "repo", "add", ".")
    _git(tmp_path / "repo", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "a run")
    where = report_folder(RunFolder(run))
    assert where.path != run and where.path.name == run.name
    assert (where.path / "summary.csv").read_text() == "point\n" and not where.path.is_relative_to(tmp_path)
    err = capsys.readouterr().err
    assert "is committed" in err and "report --overwrite" in err
    assert report_folder(RunFolder(run), overwrite=True).path == run


def test_a_run_git_does_not_track_is_rendered_where_it_lies(tmp_path):
    run = tmp_path / "20260101T000000Z-x-0000000"
    run.mkdir()
    (run / "report.ipynb").write_text("{}")
    assert report_folder(RunFolder(run)).path == run
