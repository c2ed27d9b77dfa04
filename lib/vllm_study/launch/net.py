"""HTTP to the servers a study measures, never through a proxy the environment names.

A stale HTTP_PROXY in a container is the most common way a study hangs: urllib would
send /health and /metrics of a loopback server to the proxy, and every start would
time out. The kit's own requests (readiness, /metrics, cache reset, the load client)
therefore ignore proxy variables; a target that must go through a proxy says so in
the study (targets[].proxy). Where a proxy variable would have captured a URL, errors
name it, so a user who relied on it sees why the target is unreachable.
"""
from __future__ import annotations

import json
import re
import urllib.request
from http import HTTPStatus
from urllib.parse import urlsplit

_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def open_url(url: str, method: str = "GET", headers: dict | None = None, timeout: float = 5,
             proxy: str | None = None):
    """urllib's urlopen, direct unless `proxy` is given explicitly."""
    opener = _DIRECT if proxy is None else urllib.request.build_opener(
        urllib.request.ProxyHandler({"http": proxy, "https": proxy}))
    return opener.open(urllib.request.Request(url, headers=headers or {}, method=method), timeout=timeout)


def env_proxy_for(url: str) -> str | None:
    """The proxy variable that would capture `url` for a tool that honours them (curl,
    requests, plain urllib), e.g. 'HTTP_PROXY=http://127.0.0.1:9'; None if none would."""
    parts = urlsplit(url)
    proxies = urllib.request.getproxies()
    scheme_proxy = proxies.get(parts.scheme) or proxies.get("all")
    if not scheme_proxy:
        return None
    host = parts.hostname or ""
    if urllib.request.proxy_bypass(f"{host}:{parts.port}" if parts.port else host):
        return None
    return f"{parts.scheme.upper()}_PROXY={scheme_proxy}"


def proxy_note(url: str) -> str:
    """A clause for an error about `url`: which environment proxy the kit bypassed."""
    p = env_proxy_for(url)
    return (f" ({p} is set and would capture {url}; the kit does not use proxy variables - set the "
            "target's `proxy` if it must be reached through one)") if p else ""


def one_line(body: str, limit: int = 160) -> str:
    """A response body as one short line: tags and runs of white space removed."""
    text = re.sub(r"<[^>]+>", " ", body)
    text = re.sub(r"\s+", " ", text).strip()
    return text if len(text) <= limit else text[:limit - 3] + "..."


def http_error_reason(status: int, url: str, body: str) -> str:
    return f"HTTP {status} from {url}: {one_line(body) or '(empty body)'}"


def short_answer(status: int, body: str, content_type: str = "") -> str:
    """An HTTP answer in a few words: 'HTTP 404 Not Found, an HTML page' or a JSON error's
    message. An HTML error page's text repeats its title as its heading (Python's own:
    'Error response Error response ...'); its status line says more."""
    try:
        head = f"HTTP {status} {HTTPStatus(status).phrase}"
    except ValueError:
        head = f"HTTP {status}"
    if "html" in content_type.lower() or body.lstrip().startswith("<"):
        return f"{head}, an HTML page"
    try:  # vLLM: {"message": ...}; OpenAI: {"error": {"message": ...}}; FastAPI: {"detail": ...}
        j = json.loads(body)
        err = j.get("error")
        body = str(j.get("message") or (err.get("message") if isinstance(err, dict) else err) or j.get("detail")
                   or body)
    except (ValueError, AttributeError):
        pass
    text = one_line(body, 80)
    return f"{head}: {text}" if text else head
