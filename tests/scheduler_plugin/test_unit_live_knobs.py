"""Live scheduler limits without a vLLM server: the control message's checks and caps,
the control channel inside vLLM's real scheduler (driven in-process, its watcher thread
reading a real control file), and the kit's side against a real Prometheus endpoint."""
# ruff: noqa: F811  (vllm_parts, the imported fixture, is every test's argument)
from __future__ import annotations

import json
import socket
import time

import pytest

# vllm_parts is the prefix-budget tests' fixture (a real scheduler's configs), shared here
from test_unit_prefix_budget import _req, admitted, make_scheduler, vllm_parts  # noqa: F401
from vllm_study.measure import live_knobs
from vllm_study.scheduler_plugin import CONTROL_ENV, Limits, Refused, check_message, read_stats
from vllm_study.scheduler_plugin.counters_file import STATS_ENV

LAUNCH = Limits(max_num_batched_tokens=512, max_num_seqs=8, long_prefill_token_threshold=0)


# -- the message ------------------------------------------------------------------------
@pytest.mark.parametrize("msg,expected", [
    ({"seq": 1}, LAUNCH),                                           # left out: launch values
    ({"seq": 2, "max_num_batched_tokens": 256, "max_num_seqs": 4}, Limits(256, 4, 0)),
    ({"seq": 3, "max_num_batched_tokens": 512, "max_num_seqs": 8}, LAUNCH),  # the launch itself
    ({"seq": 4, "long_prefill_token_threshold": 64}, Limits(512, 8, 64)),   # a cap below "none"
    ({"seq": 5, "max_num_batched_tokens": 8, "max_num_seqs": 8}, Limits(8, 8, 0)),  # one token each
])
def test_allowed_messages(msg, expected):
    assert check_message(msg, LAUNCH) == expected


@pytest.mark.parametrize("msg,says", [
    ({"seq": 1, "max_num_batched_tokens": 1024}, "max_num_batched_tokens 1024 is above its launch value 512"),
    ({"seq": 1, "max_num_seqs": 9}, "max_num_seqs 9 is above its launch value 8"),
    ({"seq": 1, "max_num_batched_tokens": 4, "max_num_seqs": 8}, "below max_num_seqs 8"),
    ({"seq": 1, "max_num_seqs": 0}, "max_num_seqs must be >= 1, got 0"),
    ({"seq": 1, "max_num_batched_tokens": -5}, "max_num_batched_tokens must be >= 1"),
    ({"seq": 1, "max_num_seqs": "4"}, "max_num_seqs must be an integer, got '4'"),
    ({"seq": 1, "max_num_seqs": 4.0}, "must be an integer, got 4.0"),
    ({"seq": 1, "max_num_seqs": True}, "must be an integer, got True"),
    ({"seq": 1, "max_num_seqs": None}, "must be an integer, got None"),
    ({"seq": 1, "long_prefill_token_threshold": -1}, "long_prefill_token_threshold must be >= 0"),
    ({"seq": 1, "max_num_seq": 4}, "unknown key(s) max_num_seq"),
    ({"max_num_seqs": 4}, "integer 'seq' >= 1"),
    ({"seq": 0}, "seq must be >= 1"),
    ([1, 2], "a JSON object"),
])
def test_refused_messages_name_what_is_wrong(msg, says):
    with pytest.raises(Refused) as e:
        check_message(msg, LAUNCH)
    assert says in str(e.value)


def test_a_launch_cap_on_long_prefills_can_only_go_down():
    launch = Limits(512, 8, 128)
    assert check_message({"seq": 1, "long_prefill_token_threshold": 32}, launch).long_prefill_token_threshold == 32
    for above in (129, 0):  # 0 is "no cap": above any cap
        with pytest.raises(Refused, match=f"long_prefill_token_threshold {above} is above its launch value 128"):
            check_message({"seq": 1, "long_prefill_token_threshold": above}, launch)


def test_without_chunked_prefill_the_token_budget_stays():
    assert check_message({"seq": 1, "max_num_seqs": 2}, LAUNCH, chunked_prefill=False).max_num_seqs == 2
    with pytest.raises(Refused, match="only with chunked prefill on"):
        check_message({"seq": 1, "max_num_batched_tokens": 256}, LAUNCH, chunked_prefill=False)


# -- inside vLLM's real scheduler -------------------------------------------------------
def _live(vllm_parts, tmp_path, monkeypatch, budget=False, **kw):
    from vllm_study.scheduler_plugin import LiveLimitsScheduler
    monkeypatch.setenv(CONTROL_ENV, str(tmp_path / "control.json"))
    monkeypatch.setenv(STATS_ENV, str(tmp_path / "stats.json"))
    return make_scheduler(vllm_parts, {"min_reuse_ratio": 0.0} if budget else None,
                          cls=None if budget else LiveLimitsScheduler, **kw)


def _send(tmp_path, msg: dict) -> None:
    (tmp_path / "control.json").write_text(json.dumps(msg))


def _answer(s, seq: int, timeout_s: float = 10.0) -> dict:
    """The knobs section once the engine has handled message seq (as written to disk)."""
    deadline = time.monotonic() + timeout_s
    while True:
        snap = s._kn_stats.snapshot()["knobs"]
        if snap["seq"] == seq and snap["status"] != "pending":
            return snap
        assert time.monotonic() < deadline, f"message {seq} not handled: {snap}"
        time.sleep(0.02)


def _requests(vllm_parts, n, tokens=100):
    return [_req(vllm_parts, f"R{i}", range(30000 + 1000 * i, 30000 + 1000 * i + tokens)) for i in range(n)]


def _trace(s, reqs, steps=12):
    """Per step: (tokens scheduled, running requests, requests admitted)."""
    for r in reqs:
        s.add_request(r)
    out = []
    for _ in range(steps):
        o = s.schedule()
        out.append((o.total_num_scheduled_tokens, len(s.running), tuple(admitted(o))))
    return out


@pytest.mark.parametrize("budget", [False, True])
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_lowered_limits_schedule_like_a_server_launched_at_them(vllm_parts, tmp_path, monkeypatch,
                                                                 budget, async_scheduling):
    """Launched at 1024 tokens / 8 sequences and lowered to 64 / 2 with a 48-token cap
    on long prefills, the scheduler makes the same steps as vLLM's own scheduler started
    at 64 / 2 / 48; the engine's shared config keeps the launch values."""
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler

    s = _live(vllm_parts, tmp_path, monkeypatch, budget=budget, max_num_seqs=8,
              async_scheduling=async_scheduling)
    assert s._kn_stats.snapshot()["knobs"]["launch"] == {"max_num_batched_tokens": 1024, "max_num_seqs": 8,
                                                         "long_prefill_token_threshold": 0}
    _send(tmp_path, {"seq": 1, "max_num_batched_tokens": 64, "max_num_seqs": 2,
                     "long_prefill_token_threshold": 48})
    k = _answer(s, 1)
    assert k["status"] == "applied" and k["applied_seq"] == 1
    assert k["in_force"] == {"max_num_batched_tokens": 64, "max_num_seqs": 2, "long_prefill_token_threshold": 48}
    assert s.vllm_config.scheduler_config.max_num_batched_tokens == 1024  # the launch config stays

    fresh = make_scheduler(vllm_parts, None, max_num_seqs=2, cls=AsyncScheduler if async_scheduling else Scheduler)
    fresh.scheduler_config.max_num_batched_tokens = fresh.max_num_scheduled_tokens = 64
    fresh.scheduler_config.long_prefill_token_threshold = 48
    live = _trace(s, _requests(vllm_parts, 4))
    assert live == _trace(fresh, _requests(vllm_parts, 4))
    assert max(t for t, _, _ in live) == 64 and max(r for _, r, _ in live) == 2  # the limits bound
    assert live[0] == (64, 2, ("R0", "R1"))  # two prefills of 48 and 16 tokens: the cap, then the budget
    time.sleep(0.4)  # the counters file is rewritten every 0.2 s
    on_disk = read_stats(tmp_path / "stats.json")["knobs"]
    assert (on_disk["peak_step_tokens"], on_disk["peak_running"], on_disk["steps"]) == (64, 2, 12)
    s.shutdown()


def test_a_refused_message_changes_nothing(vllm_parts, tmp_path, monkeypatch):
    s = _live(vllm_parts, tmp_path, monkeypatch, max_num_seqs=8)
    _send(tmp_path, {"seq": 1, "max_num_batched_tokens": 256, "max_num_seqs": 4})
    assert _answer(s, 1)["status"] == "applied"
    for seq, msg, why in ((2, {"max_num_batched_tokens": 2048}, "2048 is above its launch value 1024"),
                          (3, {"max_num_seqs": "lots"}, "max_num_seqs must be an integer")):
        _send(tmp_path, {"seq": seq, **msg})
        k = _answer(s, seq)
        assert k["status"] == "refused" and k["applied_seq"] == 1 and why in k["reason"]
        assert k["in_force"] == {"max_num_batched_tokens": 256, "max_num_seqs": 4, "long_prefill_token_threshold": 0}
        assert (s.max_num_scheduled_tokens, s.max_num_running_reqs) == (256, 4)
    # an old number is not handled again; a file that is not JSON is reported, not applied
    _send(tmp_path, {"seq": 1, "max_num_seqs": 1})
    (tmp_path / "control.json").write_text("{not json")
    deadline = time.monotonic() + 10
    while not s._kn_stats.snapshot()["knobs"].get("control_error"):
        assert time.monotonic() < deadline
        time.sleep(0.02)
    k = s._kn_stats.snapshot()["knobs"]
    assert "not JSON" in k["control_error"] and k["seq"] == 3 and k["applied_seq"] == 1
    assert s.max_num_running_reqs == 4
    s.shutdown()


def test_a_message_waits_until_the_engine_holds_no_request(vllm_parts, tmp_path, monkeypatch):
    from vllm.v1.request import RequestStatus
    s = _live(vllm_parts, tmp_path, monkeypatch, max_num_seqs=8)
    for r in _requests(vllm_parts, 3):
        s.add_request(r)
    s.schedule()
    _send(tmp_path, {"seq": 1, "max_num_seqs": 2})  # 3 running: lowering now would break vLLM
    time.sleep(0.5)
    k = read_stats(tmp_path / "stats.json")["knobs"]
    assert k["status"] == "pending" and k["applied_seq"] == 0 and s.max_num_running_reqs == 8
    assert k["requests"] == 3  # what the kit's drain check reads
    s.finish_requests(["R0", "R1", "R2"], RequestStatus.FINISHED_ABORTED)
    assert _answer(s, 1)["status"] == "applied" and s.max_num_running_reqs == 2
    s.shutdown()


def test_a_message_from_an_earlier_start_is_not_applied(vllm_parts, tmp_path, monkeypatch):
    _send(tmp_path, {"seq": 7, "max_num_seqs": 1})  # left by the server started before
    s = _live(vllm_parts, tmp_path, monkeypatch, max_num_seqs=8)
    time.sleep(0.3)
    k = read_stats(tmp_path / "stats.json")["knobs"]
    assert (k["seq"], k["applied_seq"], k["status"]) == (7, 0, "launch")
    assert "before this engine started" in k["reason"] and s.max_num_running_reqs == 8
    _send(tmp_path, {"seq": 8, "max_num_seqs": 2})  # the kit's next number is applied
    assert _answer(s, 8)["status"] == "applied" and s.max_num_running_reqs == 2
    s.shutdown()


def test_without_a_control_file_nothing_changes(vllm_parts, tmp_path, monkeypatch):
    monkeypatch.delenv(CONTROL_ENV, raising=False)
    s = make_scheduler(vllm_parts, {"stats_path": str(tmp_path / "pb.json")})
    assert s.scheduler_config is s.vllm_config.scheduler_config  # no private copy
    s.shutdown()
    assert "knobs" not in read_stats(tmp_path / "pb.json")


def test_live_limits_need_a_counters_file(vllm_parts, tmp_path, monkeypatch):
    from vllm_study.scheduler_plugin import LiveLimitsScheduler
    monkeypatch.setenv(CONTROL_ENV, str(tmp_path / "control.json"))
    monkeypatch.delenv(STATS_ENV, raising=False)
    with pytest.raises(ValueError, match=f"{CONTROL_ENV} is set but .* set {STATS_ENV}"):
        make_scheduler(vllm_parts, None, cls=LiveLimitsScheduler)


# -- the kit's side ---------------------------------------------------------------------
@pytest.fixture
def metrics_server():
    """A real Prometheus endpoint with vLLM's two queue gauges."""
    from prometheus_client import CollectorRegistry, Gauge, start_http_server
    reg = CollectorRegistry()
    gauges = {n: Gauge(f"vllm:num_requests_{n}", n, registry=reg) for n in ("running", "waiting")}
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server, thread = start_http_server(port, addr="127.0.0.1", registry=reg)
    yield f"http://127.0.0.1:{port}", gauges
    server.shutdown()
    thread.join(5)


def test_set_limits_returns_what_the_engine_put_in_force(vllm_parts, tmp_path, monkeypatch, metrics_server):
    url, _ = metrics_server
    s = _live(vllm_parts, tmp_path, monkeypatch, max_num_seqs=8)
    stats, control = tmp_path / "stats.json", tmp_path / "control.json"
    got = live_knobs.set_limits(url, stats, control, max_num_batched_tokens=256, max_num_seqs=4)
    assert got == {"seq": 1, "max_num_batched_tokens": 256, "max_num_seqs": 4, "long_prefill_token_threshold": 0}
    assert (s.max_num_scheduled_tokens, s.max_num_running_reqs) == (256, 4)
    got = live_knobs.set_limits(url, stats, control, max_num_seqs=2)  # the rest: launch values
    assert got == {"seq": 2, "max_num_batched_tokens": 1024, "max_num_seqs": 2, "long_prefill_token_threshold": 0}
    with pytest.raises(Refused, match="refused control message 3 .*max_num_seqs 99 is above its launch "
                                      "value 8.*stay {'max_num_batched_tokens': 1024, 'max_num_seqs': 2"):
        live_knobs.send_message(url, stats, control, {"max_num_seqs": 99})
    used = live_knobs.limits_used(stats, 2)
    assert used["max_num_seqs"] == 2 and used["steps"] == 0
    with pytest.raises(live_knobs.KnobsError, match="started under message 1"):
        live_knobs.limits_used(stats, 1)
    s.shutdown()


def test_set_limits_refuses_a_wrong_value_before_writing(tmp_path):
    from vllm_study.scheduler_plugin import StatsRecorder
    rec = StatsRecorder(tmp_path / "stats.json", {}, interval_s=3600)
    rec.set_section("knobs", {"launch": LAUNCH.to_dict(), "seq": 0})
    rec.close()
    # an unreachable URL: the check must fail before any wait or write
    with pytest.raises(Refused, match="max_num_batched_tokens 4096 is above its launch value 512"):
        live_knobs.set_limits("http://127.0.0.1:9", tmp_path / "stats.json", tmp_path / "control.json",
                              max_num_batched_tokens=4096)
    assert not (tmp_path / "control.json").exists()


def test_no_message_while_the_server_holds_requests(tmp_path, metrics_server):
    url, gauges = metrics_server
    gauges["waiting"].set(3)
    t0 = time.monotonic()
    with pytest.raises(live_knobs.KnobsError, match="still holds 3 request.*between rounds"):
        live_knobs.wait_drained(url, timeout_s=0.3)
    assert time.monotonic() - t0 >= 0.3
    gauges["waiting"].set(0)
    live_knobs.wait_drained(url, timeout_s=0.3)
    # /metrics at 0 but the engine holds requests without stepping (paused): not drained
    from vllm_study.scheduler_plugin import StatsRecorder
    rec = StatsRecorder(tmp_path / "stats.json", {}, interval_s=3600)
    rec.set_section("knobs", {"requests": 2})
    rec.flush()
    with pytest.raises(live_knobs.KnobsError, match="still holds 2 request"):
        live_knobs.wait_drained(url, timeout_s=0.3, stats_path=tmp_path / "stats.json")
    rec.set_section("knobs", {"requests": 0})
    rec.close()
    live_knobs.wait_drained(url, timeout_s=0.3, stats_path=tmp_path / "stats.json")


def test_a_server_without_the_channel_is_named(tmp_path):
    from vllm_study.scheduler_plugin import StatsRecorder
    StatsRecorder(tmp_path / "pb.json", {}, interval_s=3600).close()
    with pytest.raises(live_knobs.KnobsError, match=f"no live-limits section.*{CONTROL_ENV}"):
        live_knobs.knobs_state(tmp_path / "pb.json")
