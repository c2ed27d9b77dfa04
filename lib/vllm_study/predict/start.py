"""A server start in virtual time: a point's workload built as its start builds it
(measure/launcher.py), each round as measure/rounds.py runs it (the prefix cache reset,
a trace window's history primed unmeasured, the round's requests sent closed or open
loop) and judged as a capacity step is, on the simulated requests' records.

    sim = SimulatedStart(plan, step_time, cache_config=start.json's launch.cache_config)
    values, results = sim.run_round(0, load=2.0)
    record = sim.capacity()      # Bracket over simulated rounds
"""
from __future__ import annotations

import time
from dataclasses import dataclass, replace

import numpy as np

from ..capacity.bracket import Bracket, CapacityRecord, Step, meets_slo, margins, trace_speed
from ..define import models
from ..define.tokenizer import load as load_tokenizer
from ..define.grid import PointPlan
from ..measure import stats
from ..measure.primer import Primer
from ..records.results import Launch, StartRecord, now_utc
from ..workload import loads, windows as trace_windows
from ..workload.build_workload import make_workload
from ..workload.trace_workload import window_workload
from .engine import spec_for
from .simulator import StepTime, VirtualEngine
from .traffic import Prompts, closed_loop, open_loop


@dataclass
class SimulatedRound:
    """One simulated round: its figures (stats.round_metrics' names), its requests'
    records, its steps, and vLLM's own prefix-cache hit rate over the round."""
    index: int
    window: int
    load: float | None
    values: dict
    results: list[dict]
    steps: np.ndarray
    wall_s: float           # the simulation's own time (CPU seconds on this machine)
    virtual_s: float        # the round's virtual duration, priming included


class StudyInputs:
    """What every simulated start of one study shares, built once: the tokenizer, the
    workloads at a max_model_len (the start's trace window, or its windows) and the
    priming at a KV pool (building them is seconds of tokenizer work; simulating a
    round is about as long)."""

    def __init__(self, study, tokenizer=None):
        self.study = study
        if tokenizer is None:
            tokenizer = load_tokenizer(models.resolve(study.model)[0])
        self.tokenizer = tokenizer
        self._workloads: dict = {}
        self._primers: dict = {}
        self._prompts: dict = {}

    def prompts(self, workload) -> Prompts:
        """The token ids of `workload`'s prompts, tokenized once for every start."""
        if id(workload) not in self._prompts:
            self._prompts[id(workload)] = (workload, Prompts(workload))  # (kept alive: its id stays its own)
        return self._prompts[id(workload)][1]

    def workloads(self, limit: int) -> tuple[list, object, dict | None]:
        """(workloads, WindowSet or None, the start's trace record) at max_model_len `limit`."""
        if limit not in self._workloads:
            w, tok = self.study.workload, self.tokenizer
            if w.kind != "trace":
                self._workloads[limit] = ([make_workload(tok, w)], None, None)
            elif w.trace.windows:
                ws, rec = trace_windows.build(tok, w, limit)
                self._workloads[limit] = (list(ws.workloads), ws, rec)
            else:
                wl, rec = window_workload(tok, w, limit)
                self._workloads[limit] = ([wl], None, rec)
        return self._workloads[limit]

    def primer(self, limit: int, record: StartRecord) -> Primer | None:
        """A trace study's Primer for a start with `record`'s KV pool and trace record."""
        if self.study.workload.kind != "trace":
            return None
        key = (limit, repr(sorted(record.launch.cache_config.items())), repr(record.trace))
        if key not in self._primers:
            wls, ws, _ = self.workloads(limit)
            self._primers[key] = Primer(self.study, wls[0], self.tokenizer, record, ws)
        return self._primers[key]


class SimulatedStart:
    """One start of `plan`'s point in virtual time. KV pool: `cache_config` (start.json's
    launch.cache_config: num_gpu_blocks, block_size, enable_prefix_caching) or
    `num_blocks`. `record`: the measured start's StartRecord where one is replayed (its
    trace record and cache config then drive priming exactly as they did). `inputs`: the
    study's StudyInputs, shared by the starts simulated for one study. `stream`: which
    stream of draws from the step model's spread (0: the study seed's own)."""

    def __init__(self, plan: PointPlan, step_time: StepTime, *, cache_config: dict | None = None,
                 num_blocks: int | None = None, record: StartRecord | None = None,
                 async_scheduling: bool = False, inputs: StudyInputs | None = None, stream: int = 0):
        self.plan, self.study, self.point = plan, plan.study, plan.point
        w = self.study.workload
        if w.kind == "multi_turn":
            raise ValueError("multi_turn rounds resend the server's own answers as the next turn's prompt; "
                             "the simulator samples placeholder tokens, so it cannot replay them")
        if record is not None:
            cache_config = cache_config or record.launch.cache_config
        self.spec = spec_for(self.point, cache_config, num_blocks=num_blocks, study=self.study,
                             async_scheduling=async_scheduling)
        self.inputs = inputs or StudyInputs(self.study)
        self.record = record or StartRecord(
            point=self.point.id, start=0, started_utc=now_utc(), host="simulated", rounds_planned=0,
            launch=Launch(cache_config={"num_gpu_blocks": str(self.spec.num_blocks),
                                        "block_size": str(self.spec.block_size),
                                        "enable_prefix_caching": str(self.spec.enable_prefix_caching)}))
        self.workloads, self.windows, trace_rec = self.inputs.workloads(self.spec.max_model_len)
        if record is None:
            self.record.trace = trace_rec
        self.prompts = [self.inputs.prompts(wl) for wl in self.workloads]
        self.primer = self.inputs.primer(self.spec.max_model_len, self.record)
        # the step model's spread drawn from one stream of the study's seed for every point
        # (common random numbers): a point predicts the same every time, and points whose
        # steps run alike draw alike, so a difference between two predictions is theirs,
        # not the draws'. `stream` k > 0: the k-th other stream, shared by every point alike
        rng = np.random.default_rng(w.seed or 0) if not stream else np.random.default_rng([w.seed or 0, stream])
        self.engine = VirtualEngine(self.spec, step_time, rng)
        # the step model's front end (front_end.FrontEnd): the API server between client and engine
        self.front_end = getattr(step_time, "front_end", None)
        self._front_checked: set[int] = set()
        self.rounds: list[SimulatedRound] = []

    # -- one round ------------------------------------------------------------------------
    def run_round(self, index: int, load: float | None = None) -> SimulatedRound:
        """Round `index` (0-based; with trace.windows it replays window index % K) at a
        capacity step's `load` (None: the study's own load)."""
        t_wall = time.perf_counter()
        eng, w = self.engine, self.study.workload
        k = self.windows.pick(index) if self.windows else 0
        wl, prompts = self.workloads[k], self.prompts[k]
        if self.spec.enable_prefix_caching and not eng.scheduler.reset_prefix_cache():
            raise RuntimeError("vLLM refused to reset the prefix cache between rounds (requests still running)")
        t_prime = eng.now
        primed = {}
        if self.primer is not None and self.primer.slots[k].history is not None:
            reqs = self.primer.slots[k].requests
            self._check_front(k, reqs)
            res = closed_loop(eng, prompts, reqs, w.concurrency, self.front_end) if reqs else []  # (ids by text)
            primed = {"prime_s": eng.now - t_prime, "prime_requests": len(res),
                      "prime_prompt_tokens": self.primer.slots[k].history.prompt_tokens,
                      "prime_errors": sum(1 for r in res if r["error"])}
        q0, h0, n0 = eng.cache_queries, eng.cache_hits, len(eng.steps())
        results = self._send(wl, prompts, load, k)
        duration = _send_to_finish(results)
        values = stats.round_metrics(results, duration, self.study.slo) | primed
        q, h = eng.cache_queries - q0, eng.cache_hits - h0
        values["prefix_cache_hit_rate"] = h / q if q else None  # vLLM's own cache, over the round
        if self.primer is not None:
            values |= self.primer.model_hit_rate(values, load, k)  # the kit's cache model, beside it
        rnd = SimulatedRound(index, k, load, values, results, eng.steps()[n0:], time.perf_counter() - t_wall,
                             eng.now - t_prime)
        self.rounds.append(rnd)
        return rnd

    def _check_front(self, k: int, requests) -> None:
        """The front end's scope against the study's API, model and a workload's prompts
        (front_end.Extrapolation where it was not fitted there), once a workload."""
        if self.front_end is None or k in self._front_checked or not requests:
            return
        from .front_end import FrontEndScope
        m = self.study.model
        lengths = [r.prompt_tokens for r in requests]
        self.front_end.check(FrontEndScope(api=self.study.workload.api, model=m.path or m.card or m.served_name,
                                           vllm_version=self.front_end.scope.vllm_version,  # the step model's check
                                           prompt_tokens=(min(lengths), max(lengths))))
        self._front_checked.add(k)

    def _send(self, wl, prompts: Prompts, load: float | None, k: int = 0) -> list[dict]:
        """What rounds.RoundProtocol._prepare_round sends, into the virtual engine."""
        w, eng, fe = self.study.workload, self.engine, self.front_end
        over = self.study.capacity.over if load is not None else None
        if w.kind == "trace":
            speed = trace_speed(over, load, wl.trace.rate, w.trace.speed)
            requests = wl.requests()
            self._check_front(k, requests)
            return open_loop(eng, prompts, requests, wl.schedule(speed), front_end=fe)
        n, lm = w.requests_per_round, w.load
        requests = wl.requests(n)
        self._check_front(k, requests)
        if lm.kind == "closed":
            return closed_loop(eng, prompts, requests, int(load) if over == "concurrency" else w.concurrency, fe)
        if lm.kind == "poisson":
            times = loads.arrivals(n, load if over == "rate" else lm.rate, lm.burstiness, w.seed)
        else:
            times, step = loads.ladder(n, lm.rates, lm.burstiness, w.seed)
            requests = [replace(r, tags={**r.tags, "step": rate}) for r, rate in zip(requests, step)]
        return open_loop(eng, prompts, requests, times, max_concurrency=lm.max_concurrency, front_end=fe)

    # -- a capacity search ----------------------------------------------------------------
    def capacity(self, precision: float | None = None, max_steps: int | None = None) -> CapacityRecord:
        """The study's capacity bracket (Bracket and meets_slo, as search_capacity runs
        them) over simulated rounds; with trace.windows a step pools its windows' rounds.
        precision, max_steps: a finer bracket than the study's (a simulated step costs a
        second, not a round of the server's time)."""
        c = self.study.capacity
        if c is None:
            raise ValueError("the study has no capacity section: there is no bracket to run")
        bracket = Bracket(c.over, c.lo, c.hi, precision or c.precision, max_steps or c.max_steps,
                                   floor=c.floor, probe=c.probe)

        def measure(load: float) -> Step:
            rounds = [self.run_round(len(self.rounds), load)
                      for _ in range(len(self.workloads) if self.windows else 1)]
            if len(rounds) == 1:
                ok, why = meets_slo(rounds[0].values, c.slo)
                return Step(load, ok, why, rounds[0].index, margins(rounds[0].values, c.slo))
            pooled = [r for x in rounds for r in x.results]
            values = stats.round_metrics(pooled, sum(x.values.get("duration_s") or 0.0 for x in rounds), c.slo)
            ok, why = meets_slo(values, c.slo)
            return Step(load, ok, why, rounds[0].index, margins(values, c.slo))
        result = bracket.run(measure)
        if result.load is not None and c.over == "speed":
            result.requests_per_s = result.load * self._trace_rate()
        elif result.load is not None and c.over == "rate":
            result.requests_per_s = result.load
        return result

    def _trace_rate(self) -> float:
        """The start's trace rate as rounds.py takes it (its trace record's: windows pooled)."""
        rec = self.record.trace or {}
        return rec.get("rate") or self.workloads[0].trace.rate


def _send_to_finish(results: list[dict]) -> float:
    ends = [r["end_time"] for r in results if r.get("end_time") is not None]
    return max(ends) - min(r["send_time"] for r in results) if ends else 0.0
