"""Live knobs in a capacity grid: points that differ only in live limits share one start,
each runs its own whole capacity search on it (its limits set before every step), and
each keeps the CapacityRecord a start of its own would; a search study is still
refused; the plan counts every point's rounds; confirmation starts a served point alone.

The searches here run the kit's real round protocol (rounds.py run_round, the bracket)
against a fake server whose latency follows the max_num_seqs in force, through a fake
control channel: a point searched under another point's limits finds that one's capacity."""
from __future__ import annotations

import contextlib
from types import SimpleNamespace

from e2e_support import plan_of, tiny
from synthetic_run import add_capacity_start, make_capacity_run

from vllm_study.define.grid import Unit, expand, live_groups, point_limits, search_order
from vllm_study.define.study_file import study_from_dict
from vllm_study.measure import client
from vllm_study.measure.live_start import SharedStart
from vllm_study.measure.point import PointStart
from vllm_study.measure.rounds import RoundProtocol
from vllm_study.point_notebook import planned_rounds
from vllm_study.records import confirmation
from vllm_study.records.results import StartRecord
from vllm_study.sweep import SweepOutcome, confirm_until_resolved

SLO_MS = 1000.0
CAPACITY = {"over": "concurrency", "lo": 1, "hi": 32, "max_steps": 8, "slo": {"ttft_p90_ms": SLO_MS}}
STUDY = tiny(grid={"max_num_seqs": [2, 4]}, capacity=CAPACITY,
             workload={**tiny()["workload"], "load": {"kind": "closed"}})
LEAD, OTHER = "mns=4", "mns=2"


def test_a_capacity_grid_shares_one_start_led_by_its_largest_limits():
    study = study_from_dict(STUDY)
    groups, why = live_groups(study, "cpu", expand(study, "cpu"))
    assert why is None and [[p.id for p in g] for g in groups] == [[LEAD, OTHER]]
    study = study_from_dict({**STUDY, "server": {"live_knobs": True}})  # accepted when asked, on the GPU too
    assert [len(g) for g in live_groups(study, "gpu", expand(study, "gpu"))[0]] == [2]
    default = study_from_dict(STUDY)  # the GPU's default: one start a point
    assert [len(g) for g in live_groups(default, "gpu", expand(default, "gpu"))[0]] == [1, 1]


class FakeChannel:
    """The control channel's two calls; `in_force` is what the fake server runs under."""

    def __init__(self):
        self.in_force, self.entered = None, []

    def enter(self, limits: dict) -> dict:
        self.in_force = dict(limits)
        self.entered.append(dict(limits))
        return {**limits, "seq": len(self.entered)}

    def used(self, entered: dict) -> dict:  # (the engine reports no cap on long prefills as 0)
        return {**self.in_force, "long_prefill_token_threshold": self.in_force["long_prefill_token_threshold"] or 0,
                "seq": entered["seq"]}


class FakeWorkload:
    def requests(self, n, *_):
        return list(range(n))


def _fake_server(monkeypatch, channel: FakeChannel, steps: list):
    """TTFT 250 ms x concurrency / max_num_seqs in force: the SLO (1 s) holds up to
    4 x max_num_seqs requests in flight."""
    monkeypatch.setattr(client, "run_closed_loop", lambda url, model, api, reqs, c, **kw: (reqs, c))

    def run_sync(sending):
        reqs, c = sending
        mns = channel.in_force["max_num_seqs"]
        steps.append((c, dict(channel.in_force)))
        ttft = 0.25 * c / mns
        return [client.RequestResult(index=i, send_time=0.0, end_time=ttft + 0.1, prompt_tokens=500,
                                     output_tokens=16, ttft_s=ttft, e2e_s=ttft + 0.1, itl_s=[0.1 / 15] * 15)
                for i in reqs]
    monkeypatch.setattr(client, "run_sync", run_sync)


def _launched(launcher, logs) -> None:
    """What launch() hands over to the rounds, on the fake server."""
    launcher.served.url, launcher.served.model_name = "http://127.0.0.1:9", "tiny"
    launcher.work.workload = FakeWorkload()
    for log in logs:
        log.record.launch.has_metrics = log.record.launch.cache_reset = False


def _ready(start: PointStart) -> RoundProtocol:
    """A start of its own, launched by hand on the fake server: its round protocol."""
    _launched(start.launcher, [start.log])
    start.protocol = start.rounds_on()
    return start.protocol


def _shared(tmp_path, monkeypatch, study=STUDY):
    plans = [plan_of(study, 1), plan_of(study, 0)]
    assert [p.point.id for p in plans] == [LEAD, OTHER]
    shared = SharedStart(plans, [tmp_path / "points" / p.point.id / "s1" for p in plans], 1, 1)
    channel, steps = FakeChannel(), []
    _fake_server(monkeypatch, channel, steps)
    _launched(shared.launcher, shared.logs)
    shared.live = channel
    shared.protocols = shared.rounds_on()
    return shared, channel, steps


def test_each_point_runs_its_own_search_under_its_own_limits_on_the_shared_start(tmp_path, monkeypatch):
    shared, channel, steps = _shared(tmp_path, monkeypatch)
    ticks = []
    shared.run_rounds(ticks.append)
    recs = {s.point.id: StartRecord.model_validate_json((s.log.dir / "start.json").read_text())
            for s in shared.protocols}
    # each point's capacity is the one its own limits give: 4 x max_num_seqs requests in flight
    assert recs[LEAD].capacity.load == 16 and recs[OTHER].capacity.load == 8
    assert recs[OTHER].served_by == f"{LEAD}/s1" and recs[LEAD].serves == [LEAD, OTHER]
    # a step's limits are set before it runs, and every round records its own point's
    assert len(channel.entered) == len(steps) == sum(len(s.rounds) for s in shared.protocols)
    for s in shared.protocols:
        assert s.rounds and all(r.limits["max_num_seqs"] == s.point.values["max_num_seqs"] for r in s.rounds)
        assert [st["load"] for st in recs[s.point.id].capacity.steps] == [r.load for r in s.rounds]
        assert [r.round for r in s.rounds] == list(range(len(s.rounds)))  # numbered as a start of its own
    # the searches run whole, one after the other, in the seeded order
    first = search_order([LEAD, OTHER], 0, 1)[0]
    n_first = len(next(s for s in shared.protocols if s.point.id == first).rounds)
    by_step = [lim["max_num_seqs"] for _, lim in steps]
    want = {LEAD: 4, OTHER: 2}
    assert by_step == [want[first]] * n_first + [want[({LEAD, OTHER} - {first}).pop()]] * (len(steps) - n_first)
    assert ticks == list(range(len(steps)))  # progress counts the rounds of both searches
    assert planned_rounds(shared) == 2 * shared.study.steps_per_start


def test_a_point_served_in_a_group_keeps_the_capacity_record_a_start_of_its_own_would(tmp_path, monkeypatch):
    shared, _, _ = _shared(tmp_path / "shared", monkeypatch)
    shared.run_rounds()
    for plan, s in zip(shared.plans, shared.protocols):  # the same point, a server of its own at its limits
        alone = PointStart(plan, tmp_path / "alone" / s.point.id / "s1", 1, 1)
        channel = FakeChannel()
        channel.in_force = point_limits(s.point)
        _fake_server(monkeypatch, channel, [])
        _ready(alone)  # no channel
        alone.run_rounds()
        assert alone.record.capacity == s.log.record.capacity and alone.record.capacity.load
        assert [r.load for r in alone.rounds] == [r.load for r in s.rounds]


def test_a_server_that_dies_between_searches_fails_the_points_not_searched(tmp_path, monkeypatch):
    shared, _, _ = _shared(tmp_path, monkeypatch)
    first, second = search_order([LEAD, OTHER], 0, 1)
    by_id = {s.point.id: s for s in shared.protocols}

    class Server:
        up = True

        def alive(self):
            return self.up

        def exited(self, wait_s=0):
            return not self.up
    server = shared.launcher.served.server = Server()  # the one server every point's rounds watch
    search = by_id[first].search_capacity

    def then_die(progress=None):  # the server dies once the first search is done
        search(progress)
        server.up = False
    by_id[first].search_capacity = then_die
    shared.run_rounds()
    assert by_id[first].log.record.capacity and not by_id[first].failed
    assert by_id[second].failed and "the shared server died" in by_id[second].log.record.reason
    assert not by_id[second].rounds and by_id[second].log.record.capacity is None


def test_a_server_gone_before_a_step_fails_the_start_with_what_ended_it(tmp_path, monkeypatch):
    """A start of its own whose server has ended (its exit seen) before a step: no round
    runs and the start fails with what ended the server (vLLM's log, else the signal),
    not with the connection error its first request would meet."""
    channel, steps = FakeChannel(), []
    _fake_server(monkeypatch, channel, steps)
    start = PointStart(plan_of(STUDY, 1), tmp_path / "s1", 1, 1)
    _ready(start)
    channel.in_force = point_limits(start.point)

    class Gone:
        proc, log_path = SimpleNamespace(returncode=-9), tmp_path / "lead" / "server.log"

        def exited(self, wait_s=0):
            return True
    start.launcher.served.server = Gone()
    start.run_rounds()
    assert start.failed and start.record.reason.startswith("server died before step 1: ")
    assert "killed by SIGKILL" in start.record.reason
    assert not start.rounds and not steps and not start.record.capacity.load
    # no step ran, so none is recorded, and the record says why the search stopped
    assert start.record.capacity.steps == [] and start.record.capacity.censored is None
    assert start.record.capacity.stopped == start.record.reason


def test_a_target_that_stops_answering_after_a_round_keeps_the_round_as_failed(tmp_path, monkeypatch):
    """An endpoint the kit did not start answered /metrics before a round and its
    requests, then not the scrape after it: the round is recorded, failed, with why, and
    the start fails with the same reason (it had failed the start with the round lost)."""
    from vllm_study.measure import counters
    channel, steps = FakeChannel(), []
    _fake_server(monkeypatch, channel, steps)
    start = PointStart(plan_of(STUDY, 1), tmp_path / "s1", 1, 1)
    rounds = _ready(start)
    channel.in_force = point_limits(start.point)
    start.record.launch.has_metrics = True
    scrapes = []

    def scrape(*_a, **_k):
        scrapes.append(1)
        if len(scrapes) > 1:
            raise ConnectionRefusedError(111, "Connection refused")
        return {"values": {}, "info": {}, "hist": {}}
    monkeypatch.setattr(counters, "scrape", scrape)

    class NoSampler(contextlib.nullcontext):   # no gauges to sample: the fake serves none
        def __init__(self, *_a, **_k):
            super().__init__()

        def result(self):
            return {}
    monkeypatch.setattr(counters, "RoundSampler", NoSampler)
    rec = rounds.run_round(0, 2.0)
    assert rec is not None, start.record.reason
    assert rec.status == "failed" and [r.status for r in start.rounds] == ["failed"]
    assert start.failed and start.record.reason.startswith("the server stopped answering after round 1: ")
    assert rec.slo_met is False and rec.slo_why == start.record.reason


def test_the_dry_run_says_each_point_searches_in_turn(tmp_path, capsys):
    import yaml
    from vllm_study.sweep import dry_run
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(STUDY, sort_keys=False))
    dry_run([str(tmp_path / "s.yaml")], "cpu")
    out = capsys.readouterr().out
    assert "live knobs: 1 server start(s) a block serve the 2 points" in out
    assert "each point runs its own capacity search in turn" in out
    assert f"start 1 launches as {LEAD} and serves: {LEAD}, {OTHER}" in out


def test_confirmation_starts_a_point_served_in_a_group_alone_after_its_group_starts(tmp_path):
    """The planned starts served every point from the lead's start: a confirmation start of
    a served point is numbered after them and starts it alone, at its own limits."""
    caps = {"mbt=256": [2.5, 2.8, 2.6, 2.7], "mbt=512": [5.0, 6.2, 5.2, 5.4], "mbt=1024": [5.6, 7.2, 6.3, 6.5]}
    run = make_capacity_run(tmp_path / "r", {p: tuple(v[:2]) for p, v in caps.items()}, lo=1.0, hi=16.0,
                            study_over={"grid": {"max_num_batched_tokens": [256, 512, 1024]},
                                        "baseline": "mbt=256", "replicates": 2,
                                        "confirm": {"until": "resolved", "max_starts": 3}})
    manifest = run.manifest()  # as a live-knobs sweep plans it: one start a block serves the three
    manifest.order = [Unit(point="mbt=1024", start=k, block=k, serves=["mbt=1024", "mbt=512", "mbt=256"])
                      for k in (1, 2)]
    manifest.save(run.manifest_path)
    from vllm_study.report.run import Run
    study = Run.load(run).study
    ran = []

    def run_block(units, outcome):
        for u in units:
            ran.append(u)
            add_capacity_start(outcome.run, u.point, u.start, caps[u.point][u.start - 1])
        return SweepOutcome(outcome.run, 0)
    confirm_until_resolved(run, study, SweepOutcome(run, 0), run_block)
    assert ran and sorted(u.point for u in ran) == ["mbt=1024", "mbt=256", "mbt=512"]
    assert all(u.start == 3 and u.serves == [] and u.points == [u.point] for u in ran)
    assert confirmation.read(run.path).stop.startswith(confirmation.MAX_STARTS)


def test_a_served_point_replays_the_windows_the_lead_cut(tmp_path, monkeypatch):
    """trace.windows: the lead cuts the windows at launch; every point it serves picks its
    round's window from them (a capacity step measures each window at its load)."""
    shared, _, _ = _shared(tmp_path, monkeypatch)

    class Windows:
        workloads = ["window 1", "window 2"]

        def pick(self, index):
            return index % 2

    def launch():  # what the launch cuts, into the lead's record and the workload it hands over
        shared.launcher.work.windows, shared.lead.record.trace = Windows(), {"rate": 1.5}
    shared.launcher.launch = launch
    shared.launch()
    lead, other = shared.protocols
    assert other.windows is lead.windows is shared.launcher.work.windows
    assert other.log.record.trace == {"rate": 1.5} and other.log.record.served_by == f"{LEAD}/s1"
    assert other._pick_window(3) == 1 and other.workload == "window 2"
    assert lead.workload != "window 2"  # each point picks its own round's window
