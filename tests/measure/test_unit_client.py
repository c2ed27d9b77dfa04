"""The load generator and the endpoint check, against a small local HTTP server on
127.0.0.1 that answers like an OpenAI-compatible endpoint does (and like broken ones);
and net.py, the proxy-free HTTP and error wording they share."""
from __future__ import annotations

import asyncio
import json
import socket
import threading

import pytest
from aiohttp import web

from vllm_study.launch import net
from vllm_study.measure.client import EndpointError, _classify_http, check_endpoint, run_closed_loop
from vllm_study.launch.server import free_port
from vllm_study.workload.workload import Request

BAD_GATEWAY_HTML = ("<html>\r\n<head><title>502 Bad Gateway</title></head>\r\n<body>\r\n"
                    "<center><h1>502 Bad Gateway</h1></center>\r\n<hr><center>nginx/1.25.3</center>\r\n"
                    + "<p>The upstream server did not answer in time.</p>\r\n" * 10 + "</body>\r\n</html>\r\n")
N_CONTENT = 5          # content chunks in the good stream
FIRST_DELAY = 0.06     # before the first content chunk
GAP = 0.03             # between content chunks
MODEL = "tiny"


class Stub:
    """An aiohttp server in its own thread; the first path segment picks the behaviour."""

    def __init__(self):
        self.bodies: list[dict] = []
        self.headers: list[dict] = []
        self.urls: list[str] = []      # as the request line named them (absolute via a proxy)
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
        self.urls.append(str(request.url))
        if mode == "s401":
            return web.json_response({"error": "Unauthorized"}, status=401)
        if mode == "s500":
            return web.Response(text="Internal Server Error", status=500)
        if mode == "s502html":  # what a gateway in front of a dead server answers
            return web.Response(text=BAD_GATEWAY_HTML, status=502, content_type="text/html")
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
    ("s502html", "http_5xx", "HTTP 502"),
    ("s404", "unknown_model", "does not serve this model"),
    ("nochoices", "bad_response", "without 'choices'"),
])
def test_error_kinds(stub, mode, kind, detail):
    (r,) = _run(stub.url(mode))
    assert r.error == kind
    assert detail in r.error_detail
    assert not r.ok and r.tpot_s is None
    assert r.end_time is not None and r.end_time >= r.send_time  # set whatever the outcome


def test_http_error_detail_names_the_url_and_the_body_in_one_line(stub):
    (r,) = _run(stub.url("s500"))
    assert r.error_detail == f"HTTP 500 from {stub.url('s500')}/v1/chat/completions: Internal Server Error"
    (r,) = _run(stub.url("s401"), api="completions")
    assert r.error_detail.startswith(f"401 Unauthorized from {stub.url('s401')}/v1/completions: "
                                     "the API key is wrong or missing (")
    (r,) = _run(stub.url("s502html"))
    head = f"HTTP 502 from {stub.url('s502html')}/v1/chat/completions: "
    assert r.error_detail.startswith(head + "502 Bad Gateway 502 Bad Gateway nginx/1.25.3")
    assert "\n" not in r.error_detail and "\r" not in r.error_detail and "<" not in r.error_detail
    assert len(r.error_detail) <= len(head) + 160 and r.error_detail.endswith("...")


def test_classify_http_without_a_server():
    url = "http://h:1/v1/completions"
    assert _classify_http(503, "", url) == ("http_5xx", f"HTTP 503 from {url}: (empty body)")
    assert _classify_http(400, "bad\nrequest", url) == ("http_4xx", f"HTTP 400 from {url}: bad request")
    kind, detail = _classify_http(404, '{"message": "The model `x` does not exist."}', url)
    assert kind == "unknown_model" and "The model `x` does not exist." in detail
    assert _classify_http(404, "Not Found", url) == ("http_4xx", f"HTTP 404 from {url}: Not Found")


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
    # the stub sends content GAP apart; a client the loaded machine holds back reads two
    # chunks together (a gap near 0), so the gaps are checked over the stream, not each
    assert all(g >= 0 for g in r.itl_s) and sum(r.itl_s) >= (N_CONTENT - 1) * GAP * 0.5
    assert r.e2e_s >= r.ttft_s + sum(r.itl_s)
    assert r.output_tokens == N_CONTENT and r.prompt_tokens == 17  # from the usage chunk
    assert r.tpot_s == pytest.approx((r.e2e_s - r.ttft_s) / (N_CONTENT - 1))
    assert r.to_dict()["itl_s"] == r.itl_s
    # the end: after the last chunk, and what the e2e time measures up to
    assert r.end_time >= r.send_time + r.e2e_s
    assert r.end_time - r.send_time == pytest.approx(r.e2e_s, abs=0.05)


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
    assert r.end_time is not None and r.e2e_s is None


# ---------------------------------------------------------------- check_endpoint

def test_check_endpoint_accepts_good_server(stub):
    assert check_endpoint(stub.url("good"), MODEL) is None


def test_check_endpoint_401(stub):
    with pytest.raises(EndpointError) as ei:
        check_endpoint(stub.url("s401"), MODEL, api_key="wrong")
    assert str(ei.value).startswith(f"401 Unauthorized from {stub.url('s401')}/v1/models: "
                                    "the API key is wrong or missing")


@pytest.mark.parametrize("mode", ["html", "nodata"])
def test_check_endpoint_not_openai(stub, mode):
    with pytest.raises(EndpointError) as ei:
        check_endpoint(stub.url(mode), MODEL)
    msg = str(ei.value)
    assert "did not answer an OpenAI model list" in msg
    assert "check the base URL" in msg
    assert "<" not in msg  # the body quoted as one line of text, tags removed


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


# ---------------------------------------------------------------- proxies

_PROXY_VARS = ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "NO_PROXY", "REQUEST_METHOD")


@pytest.fixture
def env(monkeypatch):
    """No proxy variable of this machine leaks into a test; the test sets its own."""
    for var in _PROXY_VARS:
        monkeypatch.delenv(var, raising=False)
        monkeypatch.delenv(var.lower(), raising=False)
    return monkeypatch


DEAD_PROXY = "http://127.0.0.1:9"  # nothing listens there


def test_proxy_variables_never_capture_the_load(stub, env):
    env.setenv("HTTP_PROXY", DEAD_PROXY)
    env.setenv("http_proxy", DEAD_PROXY)
    assert net.env_proxy_for(stub.base)  # a tool that honours them would go to the dead proxy
    (r,) = _run(stub.url("good"))
    assert r.ok, r.error_detail
    assert check_endpoint(stub.url("good"), MODEL) is None


def test_refused_connection_names_the_proxy_variable_it_bypassed(env):
    env.setenv("HTTP_PROXY", DEAD_PROXY)
    url = f"http://127.0.0.1:{free_port()}"
    (r,) = _run(url)
    assert r.error == "connection"
    assert f"HTTP_PROXY={DEAD_PROXY} is set and would capture {url}" in r.error_detail
    assert "set the target's `proxy`" in r.error_detail
    with pytest.raises(EndpointError) as ei:
        check_endpoint(url, MODEL, timeout_s=5)
    assert f"HTTP_PROXY={DEAD_PROXY} is set and would capture {url}" in str(ei.value)


def test_refused_connection_without_proxy_variables_has_no_proxy_note(env):
    (r,) = _run(f"http://127.0.0.1:{free_port()}")
    assert r.error == "connection" and "PROXY" not in r.error_detail


def test_an_explicit_proxy_is_used(stub, env):
    """targets[].proxy: the request goes to the proxy, which forwards it (the stub plays
    the proxy here and answers itself: the URL nothing listens on is never dialled)."""
    nowhere = f"http://127.0.0.1:{free_port()}/good"
    stub.urls.clear()
    (r,) = _run(nowhere, proxy=stub.base)
    assert r.ok, r.error_detail
    assert stub.urls == [nowhere + "/v1/chat/completions"]  # the absolute URL a proxy receives
    assert check_endpoint(nowhere, MODEL, proxy=stub.base) is None
    (r,) = _run(nowhere)  # and without it, that URL is unreachable
    assert r.error == "connection"


def test_env_proxy_for_loopback_and_no_proxy(env):
    url = "http://127.0.0.1:8000"
    assert net.env_proxy_for(url) is None and net.proxy_note(url) == ""
    env.setenv("HTTP_PROXY", "http://proxy.example:3128")
    assert net.env_proxy_for(url) == "HTTP_PROXY=http://proxy.example:3128"
    assert net.env_proxy_for("http://localhost:8000/v1") == "HTTP_PROXY=http://proxy.example:3128"
    assert net.env_proxy_for("https://127.0.0.1:8000") is None  # HTTP_PROXY is for http only
    note = net.proxy_note(url)
    assert note.startswith(" (HTTP_PROXY=http://proxy.example:3128 is set and would capture "
                           "http://127.0.0.1:8000; the kit does not use proxy variables")
    env.setenv("NO_PROXY", "localhost,127.0.0.1")
    assert net.env_proxy_for(url) is None and net.proxy_note(url) == ""
    assert net.env_proxy_for("http://10.1.2.3:8000") == "HTTP_PROXY=http://proxy.example:3128"


def test_env_proxy_for_https_and_all_proxy(env):
    env.setenv("HTTPS_PROXY", "http://p:1")
    assert net.env_proxy_for("https://api.example.com/v1") == "HTTPS_PROXY=http://p:1"
    assert net.env_proxy_for("http://api.example.com") is None
    env.setenv("ALL_PROXY", "socks5://p:2")
    assert net.env_proxy_for("http://api.example.com") == "HTTP_PROXY=socks5://p:2"
    env.setenv("no_proxy", ".example.com")
    assert net.env_proxy_for("https://api.example.com/v1") is None


def test_open_url_goes_direct_unless_given_a_proxy(stub, env):
    env.setenv("HTTP_PROXY", DEAD_PROXY)
    env.setenv("http_proxy", DEAD_PROXY)
    with net.open_url(stub.url("good") + "/v1/models", timeout=5) as r:
        assert r.status == 200
    nowhere = f"http://127.0.0.1:{free_port()}/good/v1/models"
    with net.open_url(nowhere, timeout=5, proxy=stub.base) as r:  # the stub plays the proxy
        assert r.status == 200 and MODEL in r.read().decode()


def test_one_line_strips_tags_and_cuts_long_bodies():
    assert net.one_line("<html><body><h1>502 Bad Gateway</h1>\n<p>nginx</p></body></html>") == \
        "502 Bad Gateway nginx"
    assert net.one_line("  a\r\n\tb  ") == "a b"
    assert net.one_line("") == ""
    long = net.one_line("x" * 1000)
    assert len(long) == 160 and long.endswith("...") and long.startswith("x" * 157)
    assert net.one_line("y" * 160) == "y" * 160                  # at the limit: kept whole
    assert len(net.one_line("z " * 100, limit=20)) == 20
    one = net.one_line(BAD_GATEWAY_HTML)
    assert "<" not in one and "\n" not in one and len(one) <= 160


def test_http_error_reason():
    assert net.http_error_reason(502, "http://h/v1/models", BAD_GATEWAY_HTML).startswith(
        "HTTP 502 from http://h/v1/models: 502 Bad Gateway 502 Bad Gateway nginx/1.25.3")
    assert net.http_error_reason(500, "http://h", "  ") == "HTTP 500 from http://h: (empty body)"
