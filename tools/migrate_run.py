"""Convert a run folder of the kit's first results layout (0.1: points/<id>/ with
summary.json, rounds.jsonl, requests.jsonl.gz, server.log) to the typed layout of
results.py, in place, and rename it after the commit its manifest records.

Every round is re-derived from its requests.jsonl.gz: the duration is first send to
last finish (the first layout's round clock also covered building and tokenizing the
requests, which under-reported throughput by 13-20%), and the client figures are
recomputed with the kit's current statistics. Server and NVML figures are kept from
the round's record. A `reruns/<id>/` folder (a second server start of a point) becomes
that point's start 2.

    python tools/migrate_run.py results/<run>
"""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

from vllm_study.measure import stats
from vllm_study.define.grid import PointPlan, Unit, expand
from vllm_study.launch.machine import CpuInfo, GpuInfo, Machine, Versions
from vllm_study.vocab.metrics import REGISTRY
from vllm_study.define.study_file import load_study
from vllm_study.measure.point import summarize
from vllm_study.records.results import (LOG, NOTEBOOK, REQUESTS, ROUNDS, START, GitState, Launch, Manifest, Resume,
                                        RoundRecord, RunFolder, StartRecord, compress_log, read_requests,
                                        write_atomic)

SERVER_KEYS = [k for k, m in REGISTRY.items() if m.source in ("server", "nvml")]


def _gpus(old) -> list[GpuInfo]:
    return [GpuInfo(index=i, **g) for i, g in enumerate(old)] if isinstance(old, list) else []


def _machine(old: dict) -> Machine:
    cpu = old.get("cpu") or {}
    return Machine(host=old.get("host") or "not recorded",
                   cpu=CpuInfo(model="not recorded", machine=cpu.get("machine", "not recorded"),
                               cores=cpu.get("cores"), capability=None, avx512=None, avx512_bf16=None, amx=None),
                   gpus=_gpus(old.get("gpu")), no_gpu_reason=old["gpu"] if isinstance(old.get("gpu"), str) else None)


def _git(old: dict, notes: list[str], what: str) -> GitState:
    if old.get("note"):
        notes.append(f"{what}: {old['note']}")
    return GitState(sha=old.get("sha"), dirty=old.get("dirty"),
                    source="recorded after the run" if old.get("note") else "git")


def convert_start(old_dir: Path, new_dir: Path, study, start: int, block: int | None) -> None:
    """One old point folder -> points/<id>/s<start>/ (files moved, records rewritten)."""
    old = json.loads((old_dir / "summary.json").read_text())
    new_dir.mkdir(parents=True, exist_ok=True)
    for name in (NOTEBOOK, REQUESTS, LOG):
        if (old_dir / name).exists():
            shutil.move(str(old_dir / name), new_dir / name)
    compress_log(new_dir)
    by_round = read_requests(new_dir) or {}
    old_rounds = [json.loads(line) for line in (old_dir / ROUNDS).read_text().splitlines() if line.strip()]
    expected = (old.get("workload") or {}).get("expected_prefix_hit_rate")
    records = []
    for row in old_rounds:
        res = by_round.get(row["round"], [])
        ends = [r["send_time"] + r["e2e_s"] for r in res if r.get("e2e_s") is not None]
        duration = max(ends) - min(r["send_time"] for r in res) if ends else None
        values = stats.round_metrics(res, duration, study.slo)
        values |= {k: row.get(k) for k in SERVER_KEYS if k in row}
        values["expected_prefix_hit_rate"] = expected
        records.append(RoundRecord(point=old["point"], start=start, round=row["round"], block=block,
                                   status=row.get("status", "ok"), utc="not recorded", errors=row.get("errors", {}),
                                   metrics=values, groups=stats.group_records(res)))
    write_atomic(new_dir / ROUNDS, "".join(r.model_dump_json() + "\n" for r in records))
    eff = old.get("effective") or {}
    gpus = old.get("gpu")
    StartRecord(point=old["point"], start=start, block=block, status=old["status"], reason=old.get("reason"),
                started_utc="not recorded", host=old.get("host") or "not recorded", gpus=_gpus(gpus),
                no_gpu_reason=gpus if isinstance(gpus, str) else None,
                launch=Launch(command=old.get("command"), startup_s=old.get("startup_s"),
                              server_pgid=old.get("server_pgid"), cache_config=eff.get("cache_config") or {},
                              vllm_non_default_args=eff.get("vllm_non_default_args")),
                warmup_errors=old.get("warmup_errors"), rounds_planned=old.get("rounds_planned", study.rounds),
                rounds_ok=sum(r.status == "ok" for r in records), expected_prefix_hit_rate=expected,
                warnings=old.get("warnings") or []).save(new_dir / START)


def migrate(run_path: Path) -> Path:
    run_path = Path(run_path)
    old = json.loads((run_path / "manifest.json").read_text())
    study = load_study(run_path / "study.yaml")
    engine = old["engine"]
    points = {p.id: p for p in expand(study, engine)}
    notes = ["converted from the kit's first results layout by tools/migrate_run.py: round durations and "
             "throughputs re-derived from requests.jsonl.gz (first send to last finish); start and round "
             "times were not recorded in that layout"]
    git = _git(old["git"], notes, "git")
    order = [Unit(point=pid, start=1, block=1) for pid in old["points"]]
    reruns = run_path / "reruns"
    for pid in old["points"]:
        pdir = run_path / "points" / pid
        staging = run_path / "points" / f".{pid}.old"
        pdir.rename(staging)
        convert_start(staging, pdir / "s1", study, 1, 1)
        shutil.rmtree(staging)
        if (reruns / pid).exists():
            convert_start(reruns / pid, pdir / "s2", study, 2, 2)
            order.append(Unit(point=pid, start=2, block=2))
            notes.append(f"{pid} start 2 was an unplanned re-run of the point on another machine (first layout: "
                         "reruns/); it is kept as a second server start")
    if reruns.exists():
        shutil.rmtree(reruns)
    resumes = []
    for i, r in enumerate(old.get("resumes", [])):
        if r.get("note"):
            notes.append(f"resume {i + 1}: {r['note']}")
        resumes.append(Resume(utc=r["utc"], git=_git(r["git"], notes, f"resume {i + 1} git"),
                              versions=Versions(**r["versions"]), machine=_machine(r),
                              units_left=[f"{p}#s1" for p in r.get("points_left", [])]))
    plan_study = study.model_copy(update={"replicates": 1})
    manifest = Manifest(study=old["study"], created_utc=old["created_utc"], git=git,
                        versions=Versions(**old["versions"]), engine=engine, machine=_machine(old),
                        points=old["points"], order=order, warnings=old.get("warnings", {}),
                        params=plan_study.model_dump(mode="json"), resumes=resumes, notes=notes)
    manifest.save(run_path / "manifest.json")
    folder = RunFolder(run_path)
    for pid in old["points"]:
        pf = folder.point(pid)
        pf.save_plan(PointPlan(study=plan_study, point=points[pid], engine=engine))
        summarize(pf, pf.plan())
    folder.write_summary_csv()
    name = run_path.name
    if name.endswith("-nogit") and git.sha:
        target = run_path.with_name(name[:-len("nogit")] + git.sha[:7])
        run_path.rename(target)
        run_path = target
    return run_path


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        print(migrate(Path(arg)))
