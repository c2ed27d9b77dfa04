"""The load generator and the endpoint check, against a small local HTTP server on
127.0.0.1 that answers like an OpenAI-compatible endpoint does (and like broken ones)."""
from __future__ import annotations

import asyncio
import json
import socket
import threading

import pytest
from aiohttp import web

from vllm_study.client import EndpointError, check_endpoint, run_closed_loop
from vllm_study.server import free_port
from vllm_study.workload import Request

N_CONTENT = 5          # content chunks in the good stream
FIRST_DELAY = 0.06     # before the first content chunk
GAP = 0.03             # between content chunks
MODEL = "tiny"


class Stub:
    """An aiohttp server in its own thread; the first path segment picks the behaviour."""

    def __init__(self):
        self.bodies: list[dict] = []
        self.headers: list[dict] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.runner = web.AppRunner(self._app())
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(10)
        host, port = self.runner.addresses[0][:2]
        assert host == "127.0.0.1"
        self.base = f"http://127.0.0.1:{port}"

    async def _start(self):
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", 0).start()

    def close(self):
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)

    def url(self, mode: str) -> str:
        return f"{self.base}/{mode}"

    def _app(self):
        app = web.Application()
        app.router.add_get("/{mode}/v1/models", self.models)
        app.router.add_post("/{mode}/v1/{api:(chat/)?completions}", self.complete)
        return app

    async def models(self, request: web.Request):
        mode = request.match_info["mode"]
        if mode == "s401":
            return web.json_response({"error": "Unauthorized"}, status=401)
        if mode == "html":
            return web.Response(text="<html><body>Welcome to nginx!</body></html>",
                                content_type="text/html")
        if mode == "nodata":
            return web.json_response({"object": "list"})
        if mode == "slow":
            await asyncio.sleep(1.5)  # well past the client's timeout in the test
        return web.json_response({"object": "list", "data": [
            {"id": MODEL, "object": "model", "owned_by": "vllm"},
            {"id": "other-model", "object": "model", "owned_by": "vllm"}]})

    async def complete(self, request: web.Request):
        mode = request.match_info["mode"]
        chat = request.match_info["api"].startswith("chat")
        body = await request.json()
        self.bodies.append(body)
        self.headers.append(dict(request.headers))
        if mode == "s401":
            return web.json_response({"error": "Unauthorized"}, status=401)
        if mode == "s500":
            return web.Response(text="Internal Server Error", status=500)
        if mode == "s404":
            return web.json_response({"error": {
                "message": f"The model `{body['model']}` does not exist.",
                "type": "NotFoundError", "param": "model", "code": 404}}, status=404)
        if mode == "html":
            return web.Response(text="<html><body>Welcome to nginx!</body></html>",
                                content_type="text/html")
        if mode == "json200":
            return web.json_response({"id": "cmpl-1", "object": "chat.completion"})
        if mode == "slow":
            await asyncio.sleep(1.5)  # well past the client's timeout in the test
            return web.Response(text="late")
        return await self._stream(request, body, chat, mode)

    async def _stream(self, request, body, chat, mode):
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)

            async def send(obj):
                data = obj if isinstance(obj, str) else json.dumps(obj)
                await resp.write(f"data: {data}\n\n".encode())

            base = {"id": "chatcmpl-1", "object": "chat.completion.chunk" if chat else "text_completion",
                    "created": 1, "model": body["model"]}

            def choice(text, finish=None):
                if chat:
                    return {"index": 0, "delta": {"content": text}, "finish_reason": finish}
                return {"index": 0, "text": text, "finish_reason": finish}

            if chat:  # vLLM's first chat chunk carries the role and no content
                await send({**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                                  "finish_reason": None}]})
            if mode == "nochoices":  # an error object in the stream, as vLLM sends mid-stream
                await send({"error": {"message": "engine dead", "type": "InternalServerError",
                                      "code": 500}})
                await send("[DONE]")
                return resp
            if mode == "empty":
                await send({**base, "choices": [choice("", "length")]})
                await send("[DONE]")
                return resp
            await asyncio.sleep(FIRST_DELAY)
            for i in range(N_CONTENT):
                if i:
                    await asyncio.sleep(GAP)
                await send({**base, "choices": [choice(f" tok{i}")]})
            await send({**base, "choices": [choice("", "length")]})
            await send({**base, "choices": [], "usage": {
                "prompt_tokens": 17, "completion_tokens": N_CONTENT, "total_tokens": 17 + N_CONTENT}})
            await send("[DONE]")
            await resp.write_eof()
            return resp
        finally:
            self.in_flight -= 1


@pytest.fixture(scope="module")
def stub():
    s = Stub()
    yield s
    s.close()


def _req(i: int, chat: bool = True) -> Request:
    if chat:
        return Request(i, [{"role": "system", "content": "sys"}, {"role": "user", "content": f"q{i}"}],
                       None, 20, N_CONTENT)
    return Request(i, None, f"sys q{i}", 20, N_CONTENT)


def _run(base, api="chat", n=1, concurrency=1, **kw):
    return asyncio.run(run_closed_loop(base, MODEL, api, [_req(i, api == "chat") for i in range(n)],
                                       concurrency=concurrency, **kw))


# ---------------------------------------------------------------- run_closed_loop

@pytest.mark.parametrize("mode, kind, detail", [
    ("s401", "http_401", "API key"),
    ("s500", "http_5xx", "HTTP 500"),
    ("s404", "unknown_model", "does not serve this model"),
    ("nochoices", "bad_response", "without 'choices'"),
])
def test_error_kinds(stub, mode, kind, detail):
    (r,) = _run(stub.url(mode))
    assert r.error == kind
    assert detail in r.error_detail
    assert not r.ok and r.tpot_s is None


def test_unknown_model_detail_quotes_the_server(stub):
    (r,) = _run(stub.url("s404"))
    assert "The model `tiny` does not exist" in r.error_detail


@pytest.mark.parametrize("mode", ["html", "json200"])
def test_non_stream_200_is_bad_response(stub, mode):
    # such an answer must never count as a completed request
    (r,) = _run(stub.url(mode))
    assert r.error == "bad_response" and r.ttft_s is None


def test_stream_without_content_is_no_tokens(stub):
    (r,) = _run(stub.url("empty"))
    assert r.error == "no_tokens" and r.ttft_s is None


@pytest.mark.parametrize("api", ["chat", "completions"])
def test_good_stream_timings(stub, api):
    (r,) = _run(stub.url("good"), api=api)
    assert r.ok, r.error_detail
    assert r.index == 0
    assert r.ttft_s >= FIRST_DELAY * 0.8
    assert len(r.itl_s) == N_CONTENT - 1     # gaps between content chunks only
    assert all(g >= GAP * 0.5 for g in r.itl_s)
    assert r.e2e_s >= r.ttft_s + sum(r.itl_s)
    assert r.output_tokens == N_CONTENT and r.prompt_tokens == 17  # from the usage chunk
    assert r.tpot_s == pytest.approx((r.e2e_s - r.ttft_s) / (N_CONTENT - 1))
    assert r.to_dict()["itl_s"] == r.itl_s


def test_payload_and_api_key(stub):
    stub.bodies.clear()
    stub.headers.clear()
    _run(stub.url("good"), api="chat", api_key="sekrit")
    _run(stub.url("good"), api="completions")
    chat, comp = stub.bodies
    assert chat["model"] == MODEL and chat["stream"] is True
    assert chat["stream_options"] == {"include_usage": True}
    assert chat["ignore_eos"] is True and chat["max_tokens"] == N_CONTENT
    assert chat["messages"][1] == {"role": "user", "content": "q0"} and "prompt" not in chat
    assert comp["prompt"] == "sys q0" and "messages" not in comp
    assert stub.headers[0]["Authorization"] == "Bearer sekrit"
    assert "Authorization" not in stub.headers[1]


def test_closed_loop_keeps_concurrency_and_order(stub):
    stub.max_in_flight = 0
    results = _run(stub.url("good"), n=6, concurrency=3)
    assert [r.index for r in results] == list(range(6))
    assert all(r.ok for r in results)
    assert stub.max_in_flight == 3


def test_timeout_and_refused_connection(stub):
    (r,) = _run(stub.url("slow"), timeout_s=0.3)
    assert r.error == "timeout"
    (r,) = _run(f"http://127.0.0.1:{free_port()}")
    assert r.error == "connection"
    assert "cannot connect" in r.error_detail


# ---------------------------------------------------------------- check_endpoint

def test_check_endpoint_accepts_good_server(stub):
    assert check_endpoint(stub.url("good"), MODEL) is None


def test_check_endpoint_401(stub):
    with pytest.raises(EndpointError, match="401 Unauthorized: the API key is wrong or missing"):
        check_endpoint(stub.url("s401"), MODEL, api_key="wrong")


@pytest.mark.parametrize("mode", ["html", "nodata"])
def test_check_endpoint_not_openai(stub, mode):
    with pytest.raises(EndpointError) as ei:
        check_endpoint(stub.url(mode), MODEL)
    msg = str(ei.value)
    assert "did not answer an OpenAI model list" in msg
    assert "check the base URL" in msg


def test_check_endpoint_model_not_served_lists_served(stub):
    with pytest.raises(EndpointError) as ei:
        check_endpoint(stub.url("good"), "qwen-7b")
    msg = str(ei.value)
    assert "'qwen-7b' is not served" in msg
    assert "it serves: tiny, other-model" in msg


def test_check_endpoint_works_inside_a_running_loop(stub):
    """As in a notebook, whose kernel already runs an event loop."""
    async def inside():
        check_endpoint(stub.url("good"), MODEL)
        with pytest.raises(EndpointError, match="it serves: tiny"):
            check_endpoint(stub.url("good"), "nope")
        return "done"
    assert asyncio.run(inside()) == "done"


def test_check_endpoint_refused_connection():
    port = free_port()  # nothing listens there
    with pytest.raises(EndpointError) as ei:
        check_endpoint(f"http://127.0.0.1:{port}", MODEL, timeout_s=5)
    msg = str(ei.value)
    assert f"cannot connect to http://127.0.0.1:{port}" in msg
    assert "is the server running" in msg


@pytest.fixture
def hangup_port():
    """A TCP port that accepts and closes at once: not an HTTP server at all."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    srv.settimeout(0.2)
    stop = threading.Event()

    def serve():
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
            except OSError:
                continue
            conn.close()
    t = threading.Thread(target=serve, daemon=True)
    t.start()
    yield srv.getsockname()[1]
    stop.set()
    t.join(5)
    srv.close()


def test_closed_loop_records_dropped_connection(hangup_port):
    # a peer that hangs up is a failed request, never an exception out of the loop
    results = _run(f"http://127.0.0.1:{hangup_port}", n=3, concurrency=2)
    assert [r.index for r in results] == [0, 1, 2]
    for r in results:
        # aiohttp reports the hang-up while writing (ClientOSError -> "client") or while
        # reading (ServerDisconnectedError -> "disconnected"), depending on timing
        assert r.error in ("disconnected", "client")
        assert r.error_detail and r.ttft_s is None and r.e2e_s is None


@pytest.mark.parametrize("where", ["hung", "not_http"])
def test_check_endpoint_hung_or_not_http_is_endpoint_error(stub, hangup_port, where):
    url = stub.url("slow") if where == "hung" else f"http://127.0.0.1:{hangup_port}"
    with pytest.raises(EndpointError):
        check_endpoint(url, MODEL, timeout_s=0.3)
