"""The client's side of a simulated round: the kit's requests sent into a VirtualEngine
as measure/client.py sends them to a server (a closed loop keeping `concurrency` in
flight, an open loop at arrival times), and each request's record in the shape of
client.RequestResult.to_dict(), so stats.round_metrics, the capacity judge, margins and
fits read a simulated round as they read a measured one.

Times are the engine's virtual seconds. With a front end (front_end.FrontEnd, the step
model's: fitted from the same runs) a request reaches the engine through one API server
that hands requests over one at a time (front_end.Handoff), and each token reaches the
client front_end.latency_s after the step that sampled it; a closed loop sends its next
request when the client sees the last one finish. Without one, a request reaches the
engine as it is sent and a token's time is the end of the step that sampled it.
"""
from __future__ import annotations

from collections.abc import Sequence

from ..measure.client import RequestResult
from ..workload.workload import Request
from .front_end import FrontEnd, Handoff
from .simulator import VirtualEngine


class Prompts:
    """Exact prompt token ids of a workload's requests, as vLLM's server makes them
    (workload.WorkloadBase._ids: the chat template rendered, or a completion's special
    tokens): the block hashes prefix caching compares are those of what the kit sends."""

    def __init__(self, workload):
        self.workload = workload
        self._ids: dict[tuple, list[int]] = {}

    def ids(self, r: Request) -> list[int]:
        key = (r.index, r.prompt, None if r.messages is None else repr(r.messages))
        ids = self._ids.get(key)
        if ids is None:
            ids = self._ids[key] = self.workload._ids(r.messages, r.prompt)
            if len(ids) != r.prompt_tokens:
                raise ValueError(f"request {r.index}: {len(ids)} prompt tokens rendered where the workload "
                                 f"counted {r.prompt_tokens}")
        return ids


def closed_loop(engine: VirtualEngine, prompts: Prompts, requests: Sequence[Request],
                concurrency: int, front_end: FrontEnd | None = None) -> list[dict]:
    """client.run_closed_loop in virtual time: `concurrency` in flight from the engine's
    current time, the next sent when the client sees one finish; records in request order."""
    if concurrency < 1:
        raise ValueError(f"concurrency must be at least 1, not {concurrency}")
    todo = list(requests)[::-1]
    sent: dict[str, Request] = {}
    server = Handoff(front_end)

    def send(_key=None, t=None):
        if todo:
            r = todo.pop()
            t = engine.now if t is None else t + server.latency_s   # the finish reached the client
            sent[engine.submit(r.index, prompts.ids(r), r.max_tokens, at=server.arrival(t), sent=t)] = r
    for _ in range(min(concurrency, len(todo))):
        send()
    engine.run(send)
    return _records(engine, sent, requests, latency_s=server.latency_s)


def open_loop(engine: VirtualEngine, prompts: Prompts, requests: Sequence[Request],
              arrivals_s: Sequence[float], max_concurrency: int | None = None,
              front_end: FrontEnd | None = None) -> list[dict]:
    """client.run_open_loop in virtual time: request i sent at arrivals_s[i] seconds
    after the engine's current time (later where max_concurrency holds it back)."""
    if len(arrivals_s) != len(requests):
        raise ValueError(f"{len(requests)} requests but {len(arrivals_s)} arrival times")
    t0 = engine.now
    sent: dict[str, Request] = {}
    due: dict[str, float] = {}
    server = Handoff(front_end)
    if not max_concurrency:
        for a, i in sorted(zip(arrivals_s, range(len(requests)))):   # the API server takes them as sent
            r = requests[i]
            rid = engine.submit(r.index, prompts.ids(r), r.max_tokens, at=server.arrival(t0 + a), sent=t0 + a)
            sent[rid], due[rid] = r, t0 + a
        engine.run()
    else:  # a cap: later requests wait for a slot, as the client's semaphore makes them
        pending = sorted(zip(arrivals_s, range(len(requests))), reverse=True)
        in_flight = [0]

        def fill(now: float):
            while pending and in_flight[0] < max_concurrency:
                a, i = pending.pop()
                r = requests[i]
                t = max(now, t0 + a)
                rid = engine.submit(r.index, prompts.ids(r), r.max_tokens, at=server.arrival(t), sent=t)
                sent[rid], due[rid] = r, t0 + a
                in_flight[0] += 1

        def done(_key, now):
            in_flight[0] -= 1
            fill(now + server.latency_s)   # the client frees the slot when it sees the finish
        fill(t0)
        engine.run(done)
    return _records(engine, sent, requests, due, server.latency_s)


def _records(engine: VirtualEngine, sent: dict[str, Request], requests: Sequence[Request],
             due: dict[str, float] | None = None, latency_s: float = 0.0) -> list[dict]:
    """RequestResult dicts, in the order of `requests`; token times as the client sees
    them (latency_s after the engine's)."""
    out = []
    for rid, r in sent.items():
        t = engine.tracked[rid]
        times = t.token_times
        end = None if t.end_time is None else t.end_time + latency_s
        res = RequestResult(index=r.index, send_time=t.send_time, end_time=end, prompt_tokens=t.prompt_tokens,
                            output_tokens=len(times), tags=dict(r.tags),
                            due_time=due[rid] if due is not None else None)
        if not times or t.end_time is None:
            res.error, res.error_detail = "no_tokens", "the simulated engine never finished it"
        else:
            res.ttft_s = times[0] + latency_s - t.send_time
            res.e2e_s = end - t.send_time
            res.itl_s = [b - a for a, b in zip(times, times[1:])]
        out.append(res.to_dict())
    order = {r.index: k for k, r in enumerate(requests)}
    return sorted(out, key=lambda d: order[d["index"]])
