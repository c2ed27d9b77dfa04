"""Async streaming load generator for OpenAI-compatible /v1/completions and
/v1/chat/completions: fixed concurrency (closed loop), per-request timings.

Per request it records what the metric definitions (metrics.py) build on: send time, TTFT (first
content token), every gap between content chunks (TBT/ITL), E2E, output tokens from
the usage chunk, and an error kind. Bad endpoints raise EndpointError with a message
that says what to fix, instead of a KeyError deep in a parser.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import json
import time
from dataclasses import asdict, dataclass, field

import aiohttp

from ..launch import net
from . import stats
from ..workload.workload import Request

# aiohttp's default 64 KiB read buffer collapses throughput on long streams (vLLM
# issue 39963); 4 MiB keeps the client far from being the bottleneck.
READ_BUFSIZE = 4 * 1024 * 1024


class EndpointError(RuntimeError):
    """The endpoint answered in a way no measurement can use; the message says why."""


@dataclass
class RequestResult:
    index: int
    send_time: float                   # time.perf_counter() at send
    end_time: float | None = None      # time.perf_counter() when it ended, whatever the outcome
    due_time: float | None = None      # open loop: when the arrival schedule said to send it
    prompt_tokens: int | None = None   # from usage
    output_tokens: int | None = None   # from usage
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = field(default_factory=list)  # gaps between content chunks
    error: str | None = None           # kind: http_401, http_5xx, connection, timeout, ...
    error_detail: str | None = None
    tags: dict = field(default_factory=dict)  # the request's: class, turn, step, ...
    text: str | None = None            # the answer, kept only where a next turn resends it

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def tpot_s(self) -> float | None:
        """(E2E - TTFT) / (output tokens - 1), as vLLM's benchmarks define it."""
        return stats.tpot_s(self.to_dict()) if self.ok else None

    def to_dict(self) -> dict:
        return asdict(self)


def run_sync(coro):
    """asyncio.run() that also works inside Jupyter, whose kernel already runs a loop:
    there the coroutine runs on a fresh loop in a worker thread."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


def _classify_http(status: int, body: str, url: str) -> tuple[str, str]:
    if status == 401:
        return "http_401", f"401 Unauthorized from {url}: the API key is wrong or missing ({net.one_line(body)})"
    if status == 404 and "does not exist" in body:
        return "unknown_model", f"the server does not serve this model: {net.one_line(body)}"
    kind = "http_5xx" if status >= 500 else "http_4xx"
    return kind, net.http_error_reason(status, url, body)


def _payload(req: Request, model: str, api: str) -> tuple[str, dict]:
    body = {"model": model, "max_tokens": req.max_tokens, "stream": True,
            "stream_options": {"include_usage": True},
            # Fixed output length: vLLM's ignore_eos keeps sampling past EOS.
            "ignore_eos": True, "temperature": 0.0}
    if api == "chat":
        return "/v1/chat/completions", {**body, "messages": req.messages}
    return "/v1/completions", {**body, "prompt": req.prompt}


def _content(chunk: dict, api: str) -> str:
    choice = chunk["choices"][0]
    if api == "chat":
        return (choice.get("delta") or {}).get("content") or ""
    return choice.get("text") or ""


async def _one(session: aiohttp.ClientSession, base_url: str, model: str, api: str,
               req: Request, headers: dict, keep_text: bool = False) -> RequestResult:
    res = await _stream(session, base_url, model, api, req, headers, keep_text)
    res.end_time = time.perf_counter()
    return res


async def _stream(session: aiohttp.ClientSession, base_url: str, model: str, api: str,
                  req: Request, headers: dict, keep_text: bool) -> RequestResult:
    path, payload = _payload(req, model, api)
    res = RequestResult(index=req.index, send_time=time.perf_counter(), tags=dict(req.tags))
    last = None
    parts: list[str] = []
    try:
        async with session.post(base_url + path, json=payload, headers=headers) as resp:
            if resp.status != 200:
                res.error, res.error_detail = _classify_http(resp.status, await resp.text(), base_url + path)
                return res
            if not resp.content_type.startswith("text/event-stream"):
                body = (await resp.text())[:200]
                res.error = "bad_response"
                res.error_detail = f"expected a token stream, got {resp.content_type}: {body!r}"
                return res
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                try:
                    chunk = json.loads(data)
                except json.JSONDecodeError:
                    res.error, res.error_detail = "bad_response", f"not JSON: {data[:200]!r}"
                    return res
                if "choices" not in chunk:
                    res.error = "bad_response"
                    res.error_detail = f"a stream chunk without 'choices': {str(chunk)[:300]}"
                    return res
                now = time.perf_counter()
                if chunk["choices"] and _content(chunk, api):
                    if keep_text:
                        parts.append(_content(chunk, api))
                    if last is None:
                        res.ttft_s = now - res.send_time
                    else:
                        res.itl_s.append(now - last)
                    last = now
                if chunk.get("usage"):
                    res.prompt_tokens = chunk["usage"].get("prompt_tokens")
                    res.output_tokens = chunk["usage"].get("completion_tokens")
            res.e2e_s = time.perf_counter() - res.send_time
            res.text = "".join(parts) if keep_text else None
            if res.ttft_s is None:
                res.error, res.error_detail = "no_tokens", "the stream ended with no content"
    except aiohttp.ClientConnectorError as e:
        res.error, res.error_detail = "connection", f"cannot connect to {base_url}: {e}{net.proxy_note(base_url)}"
    except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as e:
        res.error, res.error_detail = "disconnected", f"the server dropped the stream: {e}"
    except asyncio.TimeoutError:
        res.error, res.error_detail = "timeout", "no complete answer within the request timeout"
    except aiohttp.ClientError as e:
        res.error, res.error_detail = "client", f"{type(e).__name__}: {e}"
    return res


def auth_header(api_key: str | None) -> dict:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def _session(timeout_s: float, concurrency: int, proxy: str | None = None) -> aiohttp.ClientSession:
    # trust_env=False: proxy variables never capture a target (net.py says why); a
    # study that needs a proxy names it per target.
    return aiohttp.ClientSession(
        timeout=aiohttp.ClientTimeout(total=timeout_s),
        connector=aiohttp.TCPConnector(limit=concurrency + 4),
        read_bufsize=READ_BUFSIZE, trust_env=False, proxy=proxy)


async def run_closed_loop(base_url: str, model: str, api: str, requests: list[Request],
                          concurrency: int, timeout_s: float = 600.0,
                          api_key: str | None = None, proxy: str | None = None) -> list[RequestResult]:
    """Send `requests` keeping `concurrency` in flight; results in request order."""
    headers = auth_header(api_key)
    queue: asyncio.Queue[Request] = asyncio.Queue()
    for r in requests:
        queue.put_nowait(r)
    results: dict[int, RequestResult] = {}

    async with _session(timeout_s, concurrency, proxy) as session:
        async def worker():
            while not queue.empty():
                req = queue.get_nowait()
                results[req.index] = await _one(session, base_url, model, api, req, headers)
        await asyncio.gather(*(worker() for _ in range(min(concurrency, len(requests)))))
    return [results[r.index] for r in requests]


async def run_open_loop(base_url: str, model: str, api: str, requests: list[Request],
                        arrivals_s: list[float], timeout_s: float = 600.0, api_key: str | None = None,
                        max_concurrency: int | None = None, proxy: str | None = None) -> list[RequestResult]:
    """Send request i at arrivals_s[i] seconds after the start, whether or not earlier
    ones have finished (an open loop: the server's queue, not the client, absorbs load).
    max_concurrency, if given, caps requests in flight (later ones wait for a slot)."""
    headers = auth_header(api_key)
    cap = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    async with _session(timeout_s, max_concurrency or len(requests), proxy) as session:
        t0 = time.perf_counter()

        async def fire(req: Request, at: float) -> RequestResult:
            await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
            if cap is None:
                res = await _one(session, base_url, model, api, req, headers)
            else:
                async with cap:
                    res = await _one(session, base_url, model, api, req, headers)
            # send_time - due_time: how late the client sent it (a stalled event loop, or the cap)
            res.due_time = t0 + at
            return res
        return list(await asyncio.gather(*(fire(r, a) for r, a in zip(requests, arrivals_s))))


async def run_conversations(base_url: str, model: str, workload, conversations: int, concurrency: int,
                            think_time_s: float = 0.0, timeout_s: float = 600.0, api_key: str | None = None,
                            stream: str = "measure", proxy: str | None = None) -> list[RequestResult]:
    """Multi-turn: `concurrency` conversations at a time; each sends its turns in order,
    every turn resending the history with the answers the server actually gave, and
    pauses think_time_s between an answer and the next question."""
    headers = auth_header(api_key)
    todo = list(range(conversations))
    out: list[RequestResult] = []
    async with _session(timeout_s, concurrency, proxy) as session:
        async def worker():
            while todo:
                c = todo.pop(0)
                answers: list[str] = []
                for t in range(workload.turns):
                    if t and think_time_s:
                        await asyncio.sleep(think_time_s)
                    r = await _one(session, base_url, model, "chat", workload.turn(c, t, answers, stream),
                                   headers, keep_text=True)
                    out.append(r)
                    if not r.ok:
                        break  # the conversation cannot go on without its answer
                    answers.append(r.text)
        await asyncio.gather(*(worker() for _ in range(min(concurrency, conversations))))
    return sorted(out, key=lambda r: r.index)


def check_endpoint(base_url: str, model: str, api_key: str | None = None,
                   timeout_s: float = 10.0, proxy: str | None = None) -> None:
    """Fail early, with a fix, when the endpoint cannot be measured: unreachable,
    key rejected, not an OpenAI API, or not serving `model`."""
    async def probe():
        headers = auth_header(api_key)
        async with _session(timeout_s, 1, proxy) as s:
            try:
                async with s.get(base_url + "/v1/models", headers=headers) as r:
                    body = await r.text()
                    status = r.status
            except aiohttp.ClientConnectorError as e:
                where = f"{base_url} through the proxy {proxy}" if proxy else base_url
                raise EndpointError(f"cannot connect to {where} ({e}); is the server running, and is the URL "
                                    f"right?{'' if proxy else net.proxy_note(base_url)}") from e
            except asyncio.TimeoutError as e:
                raise EndpointError(f"{base_url}/v1/models gave no answer within {timeout_s:.0f} s") from e
            except aiohttp.ClientError as e:
                raise EndpointError(f"{base_url} does not answer HTTP like an OpenAI server "
                                    f"({type(e).__name__}: {e}); check the URL and port") from e
        if status != 200:
            raise EndpointError(_classify_http(status, body, base_url + "/v1/models")[1])
        try:
            served = [m["id"] for m in json.loads(body)["data"]]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise EndpointError(f"{base_url}/v1/models did not answer an OpenAI model list "
                                f"(got {net.one_line(body)!r}); check the base URL") from e
        if model not in served:
            raise EndpointError(f"model {model!r} is not served at {base_url}; "
                                f"it serves: {', '.join(served)}")
    run_sync(probe())
