"""nbval re-executes one committed report of each kind (tests/nbval_reports.txt), not all
of them: reports of one kind run the same cells over other numbers. A kind is what
changes the cells a report runs: the workload's kind, the engine, a capacity search, a
search over configs, a confirmation, a trace's priming, and a Prefix Reuse Budget axis."""
from __future__ import annotations

import subprocess

import yaml
from paths import REPO

LIST = REPO / "tests" / "nbval_reports.txt"


def kind(study: dict) -> tuple:
    w = study.get("workload") or {}
    trace = w.get("trace") if isinstance(w.get("trace"), dict) else {}
    ratios = (study.get("scheduler") or {}).get("min_reuse_ratio")
    budget_axis = isinstance(ratios, list) and any(v != "off" for v in ratios)
    return (w.get("kind"), (study.get("server") or {}).get("engine", "auto"), bool(study.get("capacity")),
            bool(study.get("search")), bool(study.get("confirm")), trace.get("prime"), budget_axis)


def listed() -> list[str]:
    return [ln.strip() for ln in LIST.read_text().splitlines() if ln.strip() and not ln.startswith("#")]


def committed_reports() -> list[str]:
    out = subprocess.run(["git", "ls-files", "results/*/report.ipynb"], cwd=REPO, capture_output=True, text=True,
                         check=True).stdout
    return out.split()


def kind_of(report: str) -> tuple:
    return kind(yaml.safe_load((REPO / report).parent.joinpath("study.yaml").read_text()))


def test_nbval_runs_one_committed_report_of_every_kind():
    reports = committed_reports()
    assert len(reports) >= 10  # the walk found the committed runs
    chosen = listed()
    assert set(chosen) <= set(reports), f"not committed: {sorted(set(chosen) - set(reports))}"
    kinds = {kind_of(r) for r in chosen}
    assert len(kinds) == len(chosen), "two listed reports are of one kind: keep one"
    missing = {kind_of(r): r for r in reports if kind_of(r) not in kinds}
    assert not missing, f"no report of these kinds in {LIST.name}; add one each: {sorted(missing.values())}"


def test_kinds_tell_apart_what_changes_a_reports_cells():
    base = {"workload": {"kind": "trace", "trace": {"prime": "none"}}, "server": {"engine": "gpu"}}
    primed = {**base, "workload": {"kind": "trace", "trace": {"prime": "history"}}}
    assert kind(base) != kind(primed) != kind({**primed, "capacity": {"lo": 1}})
    assert kind({**base, "scheduler": {"min_reuse_ratio": ["off", 0.8]}}) != kind(
        {**base, "scheduler": {"min_reuse_ratio": ["off"]}}) == kind(base)
