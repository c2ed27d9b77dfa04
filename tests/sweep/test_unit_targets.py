"""The preflight of endpoint targets against real HTTP servers on loopback: a plain file
server (not an OpenAI API), a closed port, and an OpenAI-like server without vLLM's
/metrics and /reset_prefix_cache. Bad targets are refused in about a second with the
fix, before a run folder exists; what a usable target lacks (rounds that start warm,
no server counters) is said on the console before the sweep starts, and in the report."""
from __future__ import annotations

import functools
import http.server
import json
import threading
import time

import pytest
import yaml

from vllm_study import cli, doctor, notebook_support, sweep
from vllm_study.measure import counters
from vllm_study.report import report
from vllm_study.define.study_file import study_from_dict
from vllm_study.launch.server import free_port


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


class _OpenAILike(_Quiet):
    """/v1/models lists `tiny`; every other path is a FastAPI-style JSON 404, as an OpenAI
    server without vLLM's dev mode or /metrics answers."""

    def _send(self, status: int, obj: dict):
        body = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        if self.path == "/v1/models":
            self._send(200, {"object": "list", "data": [{"id": "tiny", "object": "model"}]})
        else:
            self._send(404, {"detail": "Not Found"})

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self._send(404, {"detail": "Not Found"})


def _serve(handler):
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv, f"http://127.0.0.1:{srv.server_port}"


@pytest.fixture
def servers(tmp_path):
    """(file server URL, OpenAI-like URL, a closed port's URL)."""
    (tmp_path / "www").mkdir()
    files, files_url = _serve(functools.partial(_Quiet, directory=str(tmp_path / "www")))
    oai, oai_url = _serve(_OpenAILike)
    yield files_url, oai_url, f"http://127.0.0.1:{free_port()}"
    for s in (files, oai):
        s.shutdown()
        s.server_close()


def _study(*targets: tuple[str, str, str]) -> dict:
    return {"name": "t", "model": {"card": "tiny-qwen2"}, "rounds": 1,
            "targets": [{"name": n, "base_url": u, "model": m} for n, u, m in targets]}


def _by_check(findings) -> dict[str, list[doctor.Finding]]:
    out: dict[str, list[doctor.Finding]] = {}
    for f in findings:
        out.setdefault(f.check, []).append(f)
    return out


def test_preflight_refuses_unreachable_and_non_openai_targets_in_about_a_second(servers):
    files, oai, closed = servers
    study = study_from_dict(_study(("web", files + "/v1", "tiny"), ("off", closed, "tiny"),
                                   ("wrong", oai, "qwen"), ("ok", oai, "tiny")))
    t0 = time.monotonic()
    found = _by_check(doctor.target_findings(study))
    took = time.monotonic() - t0
    assert took < 1.5, took
    (web,) = found["target web"]
    assert web.status == doctor.FAIL
    # status code and a short reason in one line, not the HTML page's text twice
    assert web.detail == f"{files}/v1/models answered HTTP 404 Not Found, an HTML page: not an OpenAI-compatible server"
    assert "Error response" not in web.detail and "\n" not in web.detail
    assert "base_url" in web.fix
    (off,) = found["target off"]
    assert off.status == doctor.FAIL and off.detail == f"cannot connect to {closed} (Connection refused)"
    assert "start the server" in off.fix
    (wrong,) = found["target wrong"]
    assert wrong.status == doctor.FAIL and wrong.detail == f"model 'qwen' is not served at {oai}; it serves: tiny"
    ok = found["target ok"]
    assert [f.status for f in ok] == [doctor.OK, doctor.WARN, doctor.WARN]
    assert ok[0].detail == f"{oai} serves tiny"


@pytest.mark.parametrize("which", ["web", "off"])
def test_sweep_refuses_a_bad_target_before_a_run_folder_exists(servers, tmp_path, capsys, which):
    files, oai, closed = servers
    url = {"web": files, "off": closed}[which]
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump(_study(("good", oai, "tiny"), (which, url, "tiny"))))
    t0 = time.monotonic()
    rc = cli.main(["sweep", str(path), "--results", str(tmp_path / "results"), "--no-report"])
    took = time.monotonic() - t0
    err = capsys.readouterr().err
    assert rc == 2, err
    assert not (tmp_path / "results").exists()  # no run folder, no kernel, no report
    assert took < 5, took  # a dead target is refused before the tokenizer loads, not after a kernel started
    assert f"  target {which}: " in err and "fix: " in err
    assert ("HTTP 404 Not Found, an HTML page" if which == "web" else "Connection refused") in err
    assert "target good" not in err  # only what is wrong


def test_doctor_and_dry_run_report_the_preflight(servers, tmp_path, capsys):
    files, oai, _ = servers
    bad, good = tmp_path / "bad.yaml", tmp_path / "good.yaml"
    bad.write_text(yaml.safe_dump(_study(("web", files, "tiny"))))
    good.write_text(yaml.safe_dump(_study(("gw", oai, "tiny"))))
    assert cli.main(["doctor", str(bad)]) == 1
    assert "[FAIL] target web: " in capsys.readouterr().out
    assert cli.main(["sweep", "--dry-run", str(bad)]) == 2
    out = capsys.readouterr()
    assert "[FAIL] target web: " in out.out and "cannot run" in out.err
    assert cli.main(["sweep", "--dry-run", str(good)]) == 0
    out = capsys.readouterr().out
    assert f"[  ok] target gw: {oai} serves tiny" in out and "rounds will start warm" in out


def test_warm_rounds_and_missing_metrics_are_said_before_the_sweep_starts(servers, capsys):
    """sweep() calls prepare() before it creates the run: the console says what the
    target lacks, with the fix, before anything starts."""
    _, oai, _ = servers
    study = study_from_dict(_study(("gw", oai, "tiny")))
    (point,) = sweep.prepare(study, "cpu")
    out = capsys.readouterr().out
    assert point.id == "target=gw"
    assert ("[warn] target gw: rounds will start warm: /reset_prefix_cache is refused (HTTP 404 Not Found: "
            "Not Found), so the prefix cache is not reset between rounds") in out
    assert "VLLM_SERVER_DEV_MODE=1" in out
    assert "[warn] target gw: no /metrics (HTTP 404 Not Found: Not Found): vLLM's counters" in out


def test_the_report_shows_a_targets_warnings_beside_it(servers, tmp_path, capsys):
    """The warnings the point notebook records in start.json (here from the real probe of
    the OpenAI-like server) are printed by the report's first cell, next to the target."""
    from synthetic_run import make_run
    _, oai, _ = servers
    run = make_run(tmp_path, {"target=gw": {"ttft_p90_ms": 50.0}}, study_over={
        "grid": {}, "targets": [{"name": "gw", "base_url": oai, "model": "tiny"}], "replicates": 1})
    notes = counters.probe_server_api(oai).notes
    assert len(notes) == 2
    folder = run.point("target=gw")
    for rec in folder.starts():
        rec.warnings += notes
        rec.save(folder.start_dir(rec.start) / "start.json")
    notebook_support.describe_run(report.Run.load(run))
    out = capsys.readouterr().out
    assert f"target gw ({oai}): {oai}/reset_prefix_cache is refused" in out and "NOT reset between rounds" in out
    assert f"target gw ({oai}): {oai}/metrics does not answer" in out
    # a grid run prints what it printed before
    grid = make_run(tmp_path / "grid", {})
    notebook_support.describe_run(report.Run.load(grid))
    assert capsys.readouterr().out.strip() == report.describe(report.Run.load(grid))
