"""A study's grid as points, and the order a run measures them in.

A point is one server configuration: the fixed engine args merged with one value per
grid axis (or one endpoint target), checked against vLLM's own rules before anything
starts, with what vLLM will use where the study leaves a value open. Its id names its
folder (`points/mbt=512__gmu=0.90/`). The sweep writes each point as point.json and
the point notebook reads that, so nothing re-expands the grid.

The run order: `replicates` blocks, each holding every point once, shuffled with a
seed per block, so drift over time or a change of machine spreads over all points
instead of lining up with a grid axis. With live knobs (server.live_knobs), points that
differ only in the scheduler limits vLLM reads at every step form a group, and one start
serves the whole group (`live_groups`): the blocks then shuffle groups.
"""
from __future__ import annotations

import os
import random
from typing import Any

from pydantic import BaseModel, ValidationError

from ..vocab import axes
from ..vocab.axes import SCHEDULER_AXIS
from ..launch.machine import cpu_dtype
from ..scheduler_plugin.knobs import KNOBS as LIVE_AXES
from . import grid_spec
from .schema import EngineArgs, StudyError
from ..launch.flags import Flags
from .params import Study, Target, live_knobs_unsupported
from .study_file import explain_errors
from .models import max_positions
from .traces import TraceError, read_history, read_trace, read_whole


class Effective(BaseModel):
    """What vLLM will use where the study leaves a value open (None: vLLM decides from
    something the kit cannot see here, e.g. a real model's config)."""
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None
    dtype: str | None = None
    dtype_reason: str | None = None


class PrefixBudget(BaseModel):
    """The Prefix Reuse Budget scheduler's settings at one point (None there: vLLM's own)."""
    min_reuse_ratio: float
    max_defer_ms: float


class Point(BaseModel):
    id: str
    values: dict[str, Any]         # the grid coordinates (or {"target": name})
    engine_args: EngineArgs        # fixed args merged with the coordinates
    prefix_budget: PrefixBudget | None = None   # the scheduler plugin, where a point uses it
    target: Target | None = None   # an endpoint to measure instead of a server to launch
    effective: Effective | None = None
    warnings: list[str] = []


class PointPlan(BaseModel):
    """Everything one point's notebook needs (points/<id>/point.json)."""
    study: Study
    point: Point
    engine: str
    starts: int | None = None  # server starts planned for this point (None: the study's replicates; a
    #                            search plans 1 a trial, more for the configurations it confirms)
    # a shared start's live limits at launch, where above the point's own (a search's
    # batch, config_search.TrialSource); the point's rounds still run under its own
    launch: dict[str, int] | None = None

    @property
    def planned_starts(self) -> int:
        return self.starts or self.study.replicates


class Unit(BaseModel):
    """One server start of one point: what the sweep runs and the notebook measures. With
    live knobs, one start of a group: `point` is the one it is launched as (the group's
    largest limits; its s<start>/ holds the launch and the server log) and `serves` every
    point of the group, `point` first, each measured into its own s<start>/."""
    point: str
    start: int    # 1-based replicate number
    block: int    # 1-based block of the randomized order
    serves: list[str] = []

    @property
    def points(self) -> list[str]:
        return self.serves or [self.point]

    @property
    def label(self) -> str:
        """How the progress bar names it: 'mbt=512 #2', '(+3 live)' where it serves more."""
        return f"{self.point} #{self.start}" + (f" (+{len(self.serves) - 1} live)" if self.serves else "")


def _check_point(study: Study, args: EngineArgs, engine: str,
                 max_model_len: int | None) -> tuple[Effective, list[str], list[str]]:
    """vLLM's own rules and costly choices, for one point; max_model_len None means
    unknown here. Returns (effective, warnings, errors)."""
    warnings, errors = [], []
    mbt, mns = args.max_num_batched_tokens, args.max_num_seqs
    block = args.block_size or axes.get("block_size").default[engine]
    if mbt is not None:
        if mbt % 128:
            warnings.append(f"max_num_batched_tokens={mbt} is not a multiple of 128: GEMM tiles pad it")
        if args.enable_chunked_prefill is False and max_model_len and mbt < max_model_len:
            errors.append(f"max_num_batched_tokens={mbt} is below max_model_len={max_model_len} "
                          "with chunked prefill off: vLLM would reject longer prompts. Raise "
                          "max_num_batched_tokens, lower engine_args.max_model_len, or turn "
                          "chunked prefill on")
        if mns is not None and mns > mbt:
            errors.append(f"max_num_seqs={mns} is above max_num_batched_tokens={mbt}; vLLM "
                          "rejects this at startup. Lower max_num_seqs or raise the chunk size")
    if mns is None:
        ranks = (args.tensor_parallel_size or 1) if engine == "cpu" else 1
        default = axes.get("max_num_seqs").default[engine] * ranks
        # vLLM caps an unset max_num_seqs at the chunk size: small chunks also cap concurrency.
        mns = min(default, mbt) if mbt else default
        if mbt is not None and mbt < default:
            warnings.append(f"max_num_seqs is not set, so vLLM caps it at max_num_batched_tokens "
                            f"({mbt} instead of {default}): this point also limits concurrency")
    if study.workload.kind == "trace":
        errors += _trace_fit(study, max_model_len, warnings)
    elif max_model_len and (need := int(study.workload.longest_request()) + 32) > max_model_len:
        # (+ 32: the chat template, generously)
        errors.append(f"the longest request needs about {need} tokens (prompt + template + output) "
                      f"but max_model_len is {max_model_len}; shorten the workload or raise "
                      "engine_args.max_model_len")
    effective = Effective(block_size=block, max_num_seqs=mns, max_model_len=max_model_len, dtype=args.dtype,
                          max_num_batched_tokens=mbt or axes.get("max_num_batched_tokens").default[engine])
    return effective, warnings, errors


def _history_statement(spec) -> str:
    """How much history trace.prime: history has to send: the server's KV size, which
    decides how much of it is sent, is known only once it starts (then a history that runs
    off the trace's start is said again, in the start's record)."""
    before = read_history(spec)
    if not before:
        return (f"workload.trace.prime: history: the window starts at the trace's first request (start_s "
                f"{spec.start_s:g}), so it has no history and its rounds start cold; move trace.start_s later")
    return (f"workload.trace.prime: history: {len(before)} requests, {sum(r.input_tokens for r in before):,} prompt "
            f"tokens precede the window; each round first sends as many of the latest as the server's KV cache holds")


def _trace_fit(study: Study, max_model_len: int | None, warnings: list[str]) -> list[str]:
    """A trace's requests longer than the server allows are dropped and counted; a window
    none of whose requests fits is an error."""
    if study.workload.trace.windows:  # each window is checked, and its history stated, where the windows are
        return []                     # cut (workload/windows.py study_statements: the dry run and the sweep)
    trace = read_trace(study.workload.trace)
    if study.workload.trace.prime == "history":
        warnings.append(_history_statement(study.workload.trace))
    for why, n in trace.skipped.items():  # BurstGPT's failed rows: in the window's span, not replayed
        warnings.append(f"{n} trace rows within the window are {why} and are left out (counted in each "
                        "start's record)")
    if not max_model_len:
        return []
    try:
        kept, dropped = trace.fit(max_model_len)
    except TraceError as e:  # none fits
        return [str(e)]
    if dropped:
        warnings.append(f"{dropped} of {len(trace.requests)} trace requests are longer than max_model_len="
                        f"{max_model_len} and are left out (counted in each start's record)")
    return []


def _alignment(study: Study, args: EngineArgs, effective: Effective) -> list[str]:
    """Where a chunk that is not a multiple of the block size splits the study's own
    prompts inside a block (vLLM hashes and reuses full blocks only)."""
    mbt, block = args.max_num_batched_tokens, effective.block_size
    if not mbt or mbt % block == 0:
        return []
    w = study.workload
    if w.kind == "trace":  # its prompts' blocks are the trace's, whatever the chunk
        return []
    length = w.input_tokens if w.kind == "random" else w.system_prompt_tokens
    length = length if isinstance(length, int) else int(length.longest())
    cuts = list(range(mbt, length, mbt))
    if not cuts:
        return []
    inside = [c % block for c in cuts if c % block]
    shown = ", ".join(map(str, inside[:6])) + (", ..." if len(inside) > 6 else "")
    return [f"max_num_batched_tokens={mbt} is not a multiple of the block size ({block}): a "
            f"{length}-token prompt is prefilled in chunks that end at {', '.join(map(str, cuts[:4]))}"
            f"{', ...' if len(cuts) > 4 else ''}; {len(inside)} of those {len(cuts)} ends fall inside a block (at "
            f"offsets {shown}). vLLM caches a block once a later chunk completes it; on the CPU engine a "
            "200-token chunk gave the hit rate a never-evicting cache would (tests/e2e/test_e2e_failures.py)"]


def _with_cpu_dtype(args: EngineArgs, engine: str) -> tuple[EngineArgs, str | None]:
    """On the CPU engine an unset dtype becomes the CPU's native one (bf16 only where
    the CPU has it); a study that sets dtype keeps it."""
    if engine != "cpu" or args.dtype is not None:
        return args, None
    choice = cpu_dtype()
    return args.model_copy(update={"dtype": choice.dtype}), choice.reason


# Without a KV size vLLM's CPU build reserves gpu_memory_utilization (0.92) of the node's
# RAM and refuses to start where less is free (vllm/v1/worker/cpu_worker.py). The kit's
# default where a CPU study sets none: a quarter of the RAM free now, at most vLLM's old
# CPU default (VLLM_CPU_KVCACHE_SPACE=4 GiB; each start zero-fills it, ~2 s a GiB on two
# busy cores), in 256 MiB steps so it rarely moves.
CPU_KV_CAP, CPU_KV_STEP = 4 * 2**30, 256 * 2**20
CPU_KV_FLAGS = {"kv-cache-memory-bytes", "gpu-memory-utilization"}


def cpu_kv_default(study: Study, engine: str, available: int | None = None,
                   ignore_space: bool = False) -> tuple[int, str] | None:
    """(bytes, note) where a CPU study leaves its memory unsized; None where it sizes it
    (kv_cache_memory_bytes or gpu_memory_utilization in engine_args, the grid or
    extra_cli_args, or VLLM_CPU_KVCACHE_SPACE in server.env or this environment)."""
    if engine != "cpu" or study.targets:
        return None
    searched = study.search.space if study.search and not ignore_space else {}
    if any(k in grid_spec.axes(study.grid) or k in searched or getattr(study.engine_args, k) is not None
           for k in ("kv_cache_memory_bytes", "gpu_memory_utilization")):
        return None
    if Flags.parse(study.server.extra_cli_args).names() & CPU_KV_FLAGS:
        return None
    if {**os.environ, **study.server.env}.get("VLLM_CPU_KVCACHE_SPACE"):
        return None
    if available is None:
        import psutil
        available = psutil.virtual_memory().available
    size = max(CPU_KV_STEP, min(CPU_KV_CAP, available // 4) // CPU_KV_STEP * CPU_KV_STEP)
    kv = axes.get("kv_cache_memory_bytes")
    return size, (f"the KV cache size is not set: vLLM's CPU build would then reserve 0.92 of the RAM and "
                  f"fail where less is free, so the kit sets engine_args.kv_cache_memory_bytes: {size} "
                  f"({kv.fmt(size)}: a quarter of the {available / 2**30:.1f} GiB free, at most "
                  f"{kv.fmt(CPU_KV_CAP)}), recorded in the run's "
                  "study.yaml; set it yourself (or sweep it in the grid) to choose")


def point_id(values: dict) -> str:
    return "__".join(f"{axes.get(a).short}={axes.get(a).fmt(v)}" for a, v in values.items())


DEFAULTS_POINT = "vllm-defaults"  # a search's baseline: the fixed engine_args only, vLLM's defaults for the rest


class PointMaker:
    """Points of one study on one engine: one configuration (grid values or a search's
    trial) merged with the fixed engine args, checked against vLLM's rules. Built once a
    study (the model's positions and the CPU KV default are looked up here)."""

    def __init__(self, study: Study, engine: str):
        self.study, self.engine = study, engine
        self.supported = max_positions(study.model)
        self.kv = cpu_kv_default(study, engine)
        if self.kv:  # into the study itself: study.yaml, the manifest's params and --resume keep this size
            study.engine_args = study.engine_args.model_copy(update={"kv_cache_memory_bytes": self.kv[0]})

    def make(self, values: dict, pid: str | None = None) -> tuple[Point | None, list[str]]:
        """The point at `values` (and the scheduler's ratio where it is an axis), or None
        and why the kit refuses it (each problem one indented line)."""
        study, engine = self.study, self.engine
        ratios = study.scheduler.ratios
        ratio = values.get(SCHEDULER_AXIS, ratios[0])
        budget = None if ratio == "off" else PrefixBudget(min_reuse_ratio=ratio,
                                                            max_defer_ms=study.scheduler.max_defer_ms)
        engine_values = {a: v for a, v in values.items() if a != SCHEDULER_AXIS}
        try:
            args = EngineArgs.model_validate({**study.engine_args.model_dump(exclude_none=True), **engine_values})
        except ValidationError as e:
            return None, [explain_errors(e, f"point {values}")]
        mml = args.max_model_len or self.supported
        if self.supported and mml > self.supported:
            return None, [f"  max_model_len={mml} is above what the model supports ({self.supported} "
                          "positions in its config.json); lower engine_args.max_model_len"]
        pid = pid or point_id(values)
        args, dtype_reason = _with_cpu_dtype(args, engine)
        effective, warns, errs = _check_point(study, args, engine, mml)
        effective.dtype_reason = dtype_reason
        if errs:
            return None, [f"  point {pid}: {e}" for e in errs]
        return Point(id=pid, values=values, engine_args=args, prefix_budget=budget, effective=effective,
                     warnings=([self.kv[1]] if self.kv else []) + warns + _alignment(study, args, effective)), []


def expand(study: Study, engine: str) -> list[Point]:
    """Every combination of the grid's values, in the order the axes are written
    (the last axis varies fastest); for a search, the one point it always has: vLLM's
    defaults (its trials' points are made as it proposes them). Raises StudyError
    listing every invalid point."""
    if study.targets:
        return [Point(id=f"target={t.name}", values={"target": t.name}, engine_args=EngineArgs(),
                      target=t) for t in study.targets]
    if study.workload.kind == "trace":  # a trace that does not parse is refused before anything starts
        try:
            spec = study.workload.trace
            trace = read_whole(spec) if spec.windows else read_trace(spec)  # (windows: cut and checked in sweep)
        except (TraceError, OSError) as e:
            raise StudyError(f"workload.trace: {e}") from None
        if study.workload.trace.prime == "history" and trace.block_tokens is None:
            raise StudyError(f"workload.trace.prime: history needs a trace with prefix ids (what the cache holds), "
                             f"and {trace.source} has none (Azure and BurstGPT rows carry lengths only; a jsonl "
                             "file needs `prefix` and trace.block_tokens); set workload.trace.prime: none")
    maker = PointMaker(study, engine)
    if study.search:
        # vLLM's CPU build cannot start without a KV size where the RAM is short (see
        # cpu_kv_default): where the search sizes memory, its defaults point gets the kit's size
        kv = cpu_kv_default(study, engine, ignore_space=True) if not maker.kv else None
        point, problems = maker.make({"kv_cache_memory_bytes": kv[0]} if kv else {}, DEFAULTS_POINT)
        if point and kv:
            point.warnings.insert(0, kv[1].replace("engine_args.kv_cache_memory_bytes", "kv_cache_memory_bytes")
                                  .replace("recorded in the run's study.yaml", "for vLLM's defaults point (its "
                                           "point.json records it)"))
        if problems:
            raise StudyError("the kit refuses vLLM's defaults with the study's engine_args:\n" + "\n".join(problems))
        return [point]
    # the scheduler's min_reuse_ratio is an axis of its own when it lists several values
    ratios = study.scheduler.ratios
    combos = [{**c, SCHEDULER_AXIS: r} for c in grid_spec.combos(study.grid) for r in ratios] if len(ratios) > 1 \
        else grid_spec.combos(study.grid)
    points, problems = [], []
    for values in combos:
        pid = point_id(values)
        twin = next((p for p in points if p.id == pid), None)
        if twin:  # two points in one folder: the second would be skipped as finished
            problems.append(f"  points {twin.values} and {values} both get the point id {pid}; "
                            "make the values differ at the precision ids show")
            continue
        point, why = maker.make(values, pid)
        problems += why
        if point:
            points.append(point)
    if study.baseline and study.baseline not in {p.id for p in points}:
        problems.append(f"  baseline {study.baseline!r} is not a point of the grid; its points are: "
                        + ", ".join(p.id for p in points))
    if problems:
        raise StudyError("the kit refuses these points of the grid (by vLLM's rules or its own):\n"
                         + "\n".join(problems))
    return points


def point_limits(point: Point) -> dict[str, int | None]:
    """The live limits a point's rounds run under (None: the launch value, which the
    point shares with its group's launch)."""
    e = point.effective
    return {"max_num_batched_tokens": e.max_num_batched_tokens, "max_num_seqs": e.max_num_seqs,
            "long_prefill_token_threshold": point.engine_args.long_prefill_token_threshold}


def live_axes(args: EngineArgs) -> set[str]:
    """The knobs the kit's scheduler plugin changes on a server running with `args`."""
    # without chunked prefill vLLM cannot lower the chunk below a prompt: a restart axis there
    return set(LIVE_AXES) - ({"max_num_batched_tokens"} if args.enable_chunked_prefill is False else set())


def _largest(points: list[Point]) -> Point | None:
    """The point at every live limit's largest value in `points` (lpt 0, no cap, is the
    largest), or None where no point is."""
    def key(p: Point, axis: str) -> float:
        v = point_limits(p)[axis]
        return float("inf") if axis == "long_prefill_token_threshold" and not v else (v or 0)
    return next((p for p in points if all(key(p, a) == max(key(q, a) for q in points) for a in LIVE_AXES)), None)


def launch_limits(points: list[Point]) -> dict[str, int]:
    """The live limits a start serving `points` is launched at where they differ: each
    one's largest (long_prefill_token_threshold 0, no cap, is the largest). Empty where
    the points agree (the start is launched as any of them)."""
    out = {}
    for axis in LIVE_AXES:
        vals = {point_limits(p)[axis] for p in points}
        if len(vals) > 1:
            uncapped = axis == "long_prefill_token_threshold" and any(not v for v in vals)
            out[axis] = 0 if uncapped else max(v for v in vals if v is not None)
    return out


def live_groups(study: Study, engine: str, points: list[Point]) -> tuple[list[list[Point]], str | None]:
    """The points as the starts will serve them: groups of points that differ only in
    live limits, each led by its point at the group's largest limits (the start is
    launched as that point), else one point a start. With the reason live knobs are off
    where the study leaves server.live_knobs to the default (None where on, or asked off)."""
    singles = [[p] for p in points]
    if not study.server.live_on(engine):
        return singles, None
    why = live_knobs_unsupported(study)
    if why:  # live_knobs: true is refused there when the study is read
        return singles, f"server.live_knobs is on by default on the {engine} engine, but {why}: one start a point"
    groups: dict[tuple, list[Point]] = {}
    for p in points:
        fixed = tuple((a, repr(v)) for a, v in p.values.items() if a not in live_axes(p.engine_args))
        groups.setdefault(fixed, []).append(p)
    out = []
    for members in groups.values():
        lead = _largest(members)
        if lead is None:  # a listed grid may have no point at all the largest limits: a start each
            out += [[p] for p in members]
            continue
        out.append([lead, *(p for p in members if p is not lead)])
    return out, None


def search_sharing(study: Study, engine: str) -> tuple[list[str], str | None]:
    """A search's knobs that change live, and why its starts serve one trial each (None:
    a start serves up to search.live_batch trials, config_search.TrialSource)."""
    live = [k for k in study.search.space if k in live_axes(study.engine_args)]
    why = (study.server.live_off_why(engine)
           or ("search.live_batch: 1" if study.search.live_batch == 1
               else live_knobs_unsupported(study) or ("" if live else "no knob of the space changes live")))
    return live, why or None


def search_live_label(study: Study, engine: str) -> str:
    """How many trials a search's start serves, and which knobs need a start of their own."""
    live, why = search_sharing(study, engine)
    if why:
        return f"live knobs: none shared ({why}); one server start a trial"
    restart = [k for k in study.search.space if k not in live]
    return (f"live knobs: a start serves up to {study.search.live_batch} trials, which differ only in "
            f"{', '.join(live)} (launched at their largest, lowered between rounds); "
            + (f"{', '.join(restart)} take a start of their own" if restart else "every knob of the space changes live")
            + "; the confirmation starts are one configuration each (docs/live-knobs.md)")


def run_order(points: list[Point], replicates: int, seed: int,
              groups: list[list[Point]] | None = None) -> list[Unit]:
    """`replicates` blocks; each block holds every point (or group) once, in an order
    shuffled by its own seeded generator (so adding a block never reorders the earlier ones)."""
    groups = groups or [[p] for p in points]
    units = []
    for block in range(1, replicates + 1):
        order = list(range(len(groups)))
        random.Random(f"{seed}/{block}").shuffle(order)
        units += [Unit(point=groups[i][0].id, start=block, block=block,
                       serves=[p.id for p in groups[i]] if len(groups[i]) > 1 else []) for i in order]
    return units


def round_order(point_ids: list[str], rounds: int, seed: int, block: int) -> list[tuple[int, str]]:
    """A shared start's rounds: `rounds` passes over its points, each pass in its own
    seeded order, so the points' rounds interleave and drift over the start spreads over
    all of them. (round index within the point, point id) in the order run."""
    out = []
    for r in range(rounds):
        order = list(point_ids)
        random.Random(f"{seed}/{block}/round {r}").shuffle(order)
        out += [(r, pid) for pid in order]
    return out


def search_order(point_ids: list[str], seed: int, block: int) -> list[str]:
    """A shared start's capacity searches: one after another, in an order seeded per block
    (live_start.py says why they do not interleave)."""
    order = list(point_ids)
    random.Random(f"{seed}/{block}/capacity searches").shuffle(order)
    return order
