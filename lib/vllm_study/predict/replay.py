"""A measured start replayed in simulation: the same point (its point.json), KV pool (its
start.json's cache_config, as vLLM reported it), requests, arrivals, load and priming,
each round predicted beside what the round measured; and a configuration's capacity
predicted by the study's own bracket over simulated rounds.

    rows = replay_start(start_dir, step_time)            # one dict a measured round
    record = predict_capacity(plan, step_time, cache_config=...)
"""
from __future__ import annotations

from pathlib import Path

from ..capacity.bracket import CapacityRecord
from ..records.results import PointFolder, StartRecord, read_rounds
from .simulator import StepTime
from .start import SimulatedStart, StudyInputs

# The figures a replay sets side by side (stats.round_metrics' names): what the SLO is
# judged on and what users read; tpot from the requests, throughput from the round's clock.
COMPARED = ("ttft_p50_ms", "ttft_p90_ms", "ttft_sched_p90_ms", "itl_p99_ms", "tpot_p50_ms", "output_throughput",
            "request_throughput", "prefix_cache_hit_rate")


def replay_start(start_dir: str | Path, step_time: StepTime, *, rounds: list[int] | None = None,
                 inputs: StudyInputs | None = None, async_scheduling: bool | None = None) -> list[dict]:
    """Each measured round of the start in `start_dir` (points/<id>/s<k>; `rounds`: their
    0-based numbers, default every ok round) simulated with its load and window: one dict
    a round with `measured_<figure>` and `predicted_<figure>` for each COMPARED figure,
    the round, its window and load, and the simulation's wall and virtual seconds.
    async_scheduling: the engine's (default: off on the CPU engine, on on a GPU one)."""
    start_dir = Path(start_dir)
    plan = PointFolder(start_dir.parent).plan()
    record = StartRecord.load_if(start_dir / "start.json")
    if record is None:
        raise FileNotFoundError(f"{start_dir} has no start.json: give a start's folder (points/<id>/s<k>)")
    if record.served_by:
        raise ValueError(f"{start_dir} was served by {record.served_by} (live knobs): its KV pool and launch "
                         "are that start's; replay the rounds there")
    if async_scheduling is None:
        async_scheduling = plan.engine == "gpu"
    measured = [r for r in read_rounds(start_dir / "rounds.jsonl") if r.status == "ok"]
    if rounds is not None:
        measured = [r for r in measured if r.round in set(rounds)]
    if not measured:
        raise ValueError(f"{start_dir}: no ok round to replay" + (f" among {rounds}" if rounds else ""))
    sim = SimulatedStart(plan, step_time, record=record, inputs=inputs, async_scheduling=async_scheduling)
    out = []
    for rec in measured:
        r = sim.run_round(rec.round, rec.load)
        row = {"point": plan.point.id, "start": record.start, "round": rec.round, "window": r.window + 1,
               "load": rec.load, "sim_wall_s": r.wall_s, "sim_virtual_s": r.virtual_s,
               "steps": len(r.steps)}
        for k in COMPARED:
            row[f"measured_{k}"] = rec.metrics.get(k)
            row[f"predicted_{k}"] = r.values.get(k)
        row["predicted_model_prefix_hit_rate"] = r.values.get("model_prefix_hit_rate")
        out.append(row)
    return out


def predict_capacity(plan, step_time: StepTime, *, cache_config: dict | None = None,
                     num_blocks: int | None = None, inputs: StudyInputs | None = None,
                     async_scheduling: bool = False, precision: float | None = None,
                     max_steps: int | None = None, stream: int = 0) -> tuple[CapacityRecord, SimulatedStart]:
    """The study's capacity bracket (capacity.Bracket + meets_slo) over simulated rounds of
    `plan`'s point with the KV pool of `cache_config` (a start's) or `num_blocks`; the
    record and the simulated start (its rounds: the steps the bracket took). precision,
    max_steps: a finer bracket than the study's. stream: the draws' stream (SimulatedStart)."""
    if plan.study.capacity is None:
        raise ValueError(f"study {plan.study.name} has no capacity section: nothing to predict a capacity over")
    sim = SimulatedStart(plan, step_time, cache_config=cache_config, num_blocks=num_blocks, inputs=inputs,
                         async_scheduling=async_scheduling, stream=stream)
    return sim.capacity(precision, max_steps), sim
