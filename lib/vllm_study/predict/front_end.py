"""The front end: the time a request spends outside the engine's steps, fitted from a
start's rounds (the client's figures beside the engine's step records), for the
simulated client (predict/traffic.py) to add where the real one meets it.

    fe = fit(samples, scope)             # samples: one RoundSample a measured round
    fe.check(scope_of_the_config)        # raises Extrapolation where it would guess
    handoff = Handoff(fe)                # one API server in virtual time
    arrival = handoff.arrival(sent)      # when the engine sees a request sent at `sent`

The form: one API server hands requests to the engine one at a time, each taking
`spacing_s` of it (tokenizing the prompt, building the engine's request), so a request
reaches the engine at max(its send, the previous hand-over) + spacing_s; and each
token reaches the client `latency_s` after the step that sampled it. Two numbers,
because the records identify two: on one H100 the API server handed a closed loop's
opening burst of 32 requests to the engine 4.7-9.0 ms apart (the steps admit them one
or a few at a time, where a lock-step simulation admits all 32 at once), and the
client's TTFT P50 lay 54-136 ms above the engine's own (results/predict-vs-measured/
20261207-h100-footprint). Whether latency_s is spent on the way in or on the way out
the records cannot tell (they time steps, not the server's parts), and it does not
matter to what the kit reads: a request's latencies and a closed loop's turnaround
each cross it once. It is put on the way out. No term in prompt length or load: one
measured configuration fixes one value of each; the scope says which prompts and API
it holds for.

The fit reads only what every run with step records keeps: a round's steps, its
requests' prompt (and output) lengths in the order they were sent, and the client's
TTFT P50. Requests are admitted first come, first served and their prompts computed in
that order (vLLM's scheduler runs the running requests' chunks before it takes a
waiting one), so the cumulative prompt tokens a round's steps computed or found cached
(prefill_tokens + cached_tokens) place each request: the step that first scheduled it
(it reached the engine between the previous step's schedule() and that one's; the
middle is taken) and the step that finished its prompt (its first token came out with
that step's output). A round whose counts do not add up to its prompts (lost rows,
priming, preemption recomputing a prompt) is left out, with why, and so is one in which
a request waited in the engine (its first step is then no arrival time). In a closed loop the
same placing gives each request's finish, hence when the client sent each next one
(fit: closed_loop_latency); latency_s is fitted there so that the hand-over queue the
simulator runs is not counted twice (the client's TTFT less the engine's holds the
real queue's wait already).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from pydantic import BaseModel

# a prompt may be up to this many times the longest fitted one before check refuses it
# (tokenizing grows with the prompt; past the margin the constant would be a guess)
PROMPT_MARGIN = 2.0


class Extrapolation(ValueError):
    """The front end was not fitted where it is asked to predict (step_model.Extrapolation
    is this class: either refusal reads the same)."""


class FrontEndScope(BaseModel):
    """What the time outside the engine depends on besides the host: the API the client
    calls, the model's tokenizer, vLLM's server and the prompts' lengths."""
    api: str                            # "chat" or "completions"
    model: str
    vllm_version: str
    prompt_tokens: tuple[int, int]      # the fitted rounds' shortest and longest prompt


class FrontEnd(BaseModel):
    scope: FrontEndScope
    spacing_s: float                    # one request's hand-over: the API server's serial part
    latency_s: float                    # the rest outside the engine, each token's way out
    spacing_rounds: list[float] = []    # each round's estimates (seconds): the spread of the medians
    latency_rounds: list[float] = []
    gap_rounds: list[float] = []        # each round's client TTFT P50 less the engine's (a check)
    rounds: int
    skipped: dict[str, int] = {}        # why a round was left out -> rounds

    def check(self, scope: FrontEndScope) -> None:
        why = []
        for key in ("api", "model", "vllm_version"):
            if getattr(scope, key) != getattr(self.scope, key):
                why.append(f"{key} {getattr(scope, key)!r} (fitted on {getattr(self.scope, key)!r})")
        top, fitted = scope.prompt_tokens[1], self.scope.prompt_tokens[1]
        if top > PROMPT_MARGIN * fitted:
            why.append(f"prompts up to {top} tokens (fitted on {self.scope.prompt_tokens[0]}..{fitted}; up to "
                       f"{PROMPT_MARGIN:g} x {fitted} is predicted)")
        if why:
            raise Extrapolation("the front-end model would extrapolate: " + "; ".join(why) + ". Measure a start "
                                "there (its rounds refit it), or predict within what was measured.")


@dataclass
class RoundSample:
    """What one measured round says of its front end."""
    rows: np.ndarray                    # its step records (scheduler_plugin.steps.DTYPE), in schedule order
    prompt_tokens: list[int]            # its requests' prompt lengths, in the order they were sent
    client_ttft_p50_s: float
    burst: int | None = None            # a closed loop's concurrency (sent at once when the round began)
    output_tokens: list[int] | None = None  # its requests' output lengths, in the same order


def engine_times(rows: np.ndarray, prompt_tokens: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """(first step, prompt's last step, arrival estimate) of each request, in send order:
    the step indices placed by cumulative prompt tokens (module docstring) and the middle
    of the interval the request reached the engine in. None where the steps' prompt
    tokens do not add up to the requests'."""
    p = np.asarray(prompt_tokens, dtype=np.int64)
    done = np.cumsum(rows["prefill_tokens"].astype(np.int64) + rows["cached_tokens"])
    if not len(p) or not len(rows) or done[-1] != p.sum():
        return None
    ends = np.cumsum(p)
    first = np.searchsorted(done, ends - p, side="right")   # the first step whose tokens pass its start
    last = np.searchsorted(done, ends, side="left")          # the step its last prompt token is in
    t = rows["t_scheduled"]
    prev = np.concatenate([t[:1], t[:-1]])
    return first, last, (prev[first] + t[first]) / 2


def handoff_arrivals(sent: np.ndarray, spacing_s: float) -> np.ndarray:
    """Handoff.arrival over requests sent at `sent` (in send order)."""
    h = Handoff(spacing_s=spacing_s)
    return np.array([h.arrival(float(t)) for t in sent])


def closed_loop_latency(rows: np.ndarray, e: tuple, output_tokens: list[int], burst: int,
                        spacing_s: float) -> float | None:
    """latency_s of one closed-loop round: the value for which the front end, fed the
    round's own finishes, hands its requests to the engine when the steps say they came.
    Its requests finish where the steps put them (a running request gets a token each
    step: its prompt's last step plus output_tokens - 1 steps); the client sends request
    j >= burst when it sees the (j - burst + 1)-th finish, latency_s after the engine,
    and the first `burst` at once, one hand-over before the first arrival. The median
    over those requests of (modelled arrival - arrival estimate) rises with latency_s:
    its root (scipy's brentq) is the round's latency; 0 where it is late already at 0 (as
    where the opening burst's queue alone sets the later arrivals: a round needs requests
    well past its first `burst` to place the latency).
    None where the round's steps cannot hold its finishes (it is then left out)."""
    from scipy.optimize import brentq
    first, last, arrive = e
    fin = last + np.asarray(output_tokens) - 1
    if len(fin) <= burst or fin.max() >= len(rows):
        return None
    finish = np.sort(rows["t_done"][fin])
    later = np.arange(burst, len(fin))
    t0 = arrive[0] - spacing_s

    def late(lat: float) -> float:
        sent = np.concatenate([np.full(burst, t0), finish[later - burst] + lat])
        return float(np.median(handoff_arrivals(sent, spacing_s)[later] - arrive[later]))
    if late(0.0) >= 0:
        return 0.0
    hi = 1.0
    while late(hi) < 0:
        hi *= 2
        if hi > 1e3:
            return None
    return brentq(late, 0.0, hi, xtol=1e-5)


def fit(samples: list[RoundSample], scope: FrontEndScope) -> FrontEnd:
    """The front end of these rounds. spacing_s: the median over closed-loop rounds of the
    opening burst's hand-over time a request (its last request's arrival estimate less
    its first's, over the others; 0 without such a round). latency_s: the median over
    rounds of closed_loop_latency, or where a round is no closed loop (or its output
    lengths are not known) of its client TTFT P50 less the engine's (from the arrival
    estimate to its prompt's last step's output) less one hand-over. Medians over rounds:
    rounds are the unit (a round's requests share its load), and one odd round should
    not move a constant. gap_rounds keeps each round's client TTFT P50 less the engine's,
    the front end's whole share of TTFT, as a check on the two."""
    skipped: dict[str, int] = {}
    placed = []
    for s in samples:
        e = engine_times(s.rows, s.prompt_tokens)
        why = None
        if e is None:
            why = "its steps' prompt tokens do not add up to its requests' (lost rows, priming or preemption)"
        elif s.rows["waiting"].any():
            why = ("requests waited in the engine (waiting > 0): the step that first scheduled one is not when "
                   "it arrived")
        if why:
            skipped[why] = skipped.get(why, 0) + 1
        else:
            placed.append((s, e))
    if not placed:
        raise ValueError("no round whose steps place its requests: nothing to fit a front end from"
                         + (f" ({'; '.join(f'{n} rounds: {w}' for w, n in skipped.items())})" if skipped else ""))
    spacing = [float(e[2][s.burst - 1] - e[2][0]) / (s.burst - 1) for s, e in placed
               if s.burst and s.burst >= 2 and len(e[2]) >= s.burst]
    space = float(np.median(spacing)) if spacing else 0.0
    gaps, lats = [], []
    for s, (first, last, arrive) in placed:
        gaps.append(s.client_ttft_p50_s - float(np.median(s.rows["t_done"][last] - arrive)))
        lat = None
        if s.burst and s.output_tokens is not None:
            lat = closed_loop_latency(s.rows, (first, last, arrive), s.output_tokens, s.burst, space)
        lats.append(max(0.0, gaps[-1] - space) if lat is None else lat)
    return FrontEnd(scope=scope, spacing_s=space, latency_s=float(np.median(lats)), spacing_rounds=spacing,
                    latency_rounds=lats, gap_rounds=gaps, rounds=len(placed), skipped=skipped)


class Handoff:
    """One API server in virtual time: requests handed to the engine in the order sent,
    one every spacing_s at most (none: at once)."""

    def __init__(self, front_end: FrontEnd | None = None, *, spacing_s: float = 0.0):
        self.spacing_s = front_end.spacing_s if front_end else spacing_s
        self.latency_s = front_end.latency_s if front_end else 0.0
        self._free = -np.inf

    def arrival(self, sent: float) -> float:
        """When a request sent at `sent` reaches the engine (call in the order sent)."""
        if not self.spacing_s:
            return sent
        self._free = max(sent, self._free) + self.spacing_s
        return self._free


# -- a run folder's rounds ----------------------------------------------------------------
def samples_of_run(run_dir) -> tuple[list[RoundSample], FrontEndScope | None]:
    """Every ok round with step records in a kit run folder (rounds.jsonl, requests.jsonl.gz,
    steps/r<k>.npz), its requests in the order sent, and the run's front-end scope."""
    from ..scheduler_plugin import steps
    from ..records.results import RunFolder, read_requests, read_rounds

    run = RunFolder(run_dir)
    manifest = run.manifest()
    out, lengths, scope = [], [], None
    for pid in run.point_ids():
        folder = run.point(pid)
        plan = folder.plan()
        w = plan.study.workload
        for start in folder.starts():
            d = folder.start_dir(start.start)
            if start.served_by or not any((d / steps.ROUNDS_DIR).glob("r*.npz")):
                continue
            by_round = read_requests(d)  # read only where step records make it of use
            if by_round is None:
                continue
            for rec in read_rounds(d / "rounds.jsonl"):
                reqs = sorted(by_round.get(rec.round, []), key=lambda r: r["send_time"])
                path = steps.round_path(d, rec.round)
                ttft = rec.metrics.get("ttft_p50_ms")
                if (rec.status != "ok" or not path.exists() or ttft is None or not reqs
                        or any(r.get("error") or not r.get("prompt_tokens") for r in reqs)):
                    continue
                burst = None
                if w.kind != "trace" and w.load.kind == "closed":
                    over = plan.study.capacity.over if plan.study.capacity and rec.load is not None else None
                    burst = int(rec.load) if over == "concurrency" else w.concurrency
                prompts = [int(r["prompt_tokens"]) for r in reqs]
                lengths += prompts
                outs = [int(r.get("output_tokens") or 0) for r in reqs]
                out.append(RoundSample(steps.load_round(path), prompts, ttft / 1e3, burst,
                                       outs if all(outs) else None))
            m = plan.study.model
            scope = FrontEndScope(api=w.api, model=m.path or m.card or m.served_name,
                                  vllm_version=manifest.versions.vllm or "unknown", prompt_tokens=(0, 0))
    if scope is not None and lengths:
        scope.prompt_tokens = (min(lengths), max(lengths))
    return out, scope
