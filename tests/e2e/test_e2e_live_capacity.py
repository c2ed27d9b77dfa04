"""A capacity grid of two max_num_seqs on the CPU engine: live knobs are on by default
there, so one start serves both points and each runs its own capacity search on it (the
fake engine's: the searches' sharing of a start is the kit's; the limits are reported by
the kit's own live-limits plugin code running in it).
The SLO (TTFT P90 within 1 ms) misses at every load, so each search takes exactly its
two steps (hi, then lo) and ends in a bound below lo: the step count does not hang on
how fast this machine is. Every round's limits are the engine's own report of what it
ran the round under."""
from __future__ import annotations

import pytest

from e2e_support import fake_engine_study, sweep, tiny, write
from procs import group_gone
from vllm_study.records.results import RunFolder

pytestmark = [pytest.mark.e2e, pytest.mark.fake_engine]

STUDY = fake_engine_study(tiny(grid={"max_num_seqs": [2, 4]},
                               workload={**tiny()["workload"], "load": {"kind": "closed"}, "requests_per_round": 8},
                               capacity={"over": "concurrency", "lo": 1, "hi": 4, "max_steps": 2,
                                         "slo": {"ttft_p90_ms": 1}}))
LEAD, OTHER = "mns=4", "mns=2"


def test_two_capacity_searches_in_one_server_start_each_under_its_own_limits(tmp_path):
    done = sweep(write(tmp_path, STUDY), "--results", tmp_path / "results", timeout=900)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "live knobs: 1 server start(s) a block serve the 2 points" in done.stdout
    run = RunFolder(next((tmp_path / "results").iterdir()))
    (unit,) = run.manifest().order  # one server start for both points
    assert unit.point == LEAD and unit.serves == [LEAD, OTHER]

    starts = {p: run.point(p).start(1) for p in unit.serves}
    assert all(s.status == "ok" for s in starts.values()), {p: s.reason for p, s in starts.items()}
    assert starts[LEAD].serves == [LEAD, OTHER] and starts[LEAD].launch.startup_s > 0
    assert group_gone(starts[LEAD].launch.server_pgid)
    assert starts[OTHER].served_by == f"{LEAD}/s1" and starts[OTHER].launch.startup_s is None
    assert not (run.point(OTHER).start_dir(1) / "server.log.gz").exists()

    seqs = []
    for p, s in starts.items():
        cap, rounds = s.capacity, run.point(p).rounds()
        mns = run.point(p).plan().point.values["max_num_seqs"]
        # each its own whole search: hi missed, then lo, and below it a bound, never a zero
        assert [st["load"] for st in cap.steps] == [r.load for r in rounds] == [4, 1]
        assert cap.load is None and cap.censored == "below" and cap.bracket == (0.0, 1.0)
        assert [r.round for r in rounds] == [0, 1] and all(r.status == "ok" for r in rounds)
        for r in rounds:  # the engine ran every step under its point's limits, and kept to them
            assert r.limits["max_num_seqs"] == mns
            assert 0 < r.limits["peak_running"] <= mns
            seqs.append(r.limits["seq"])
    assert sorted(seqs) == [1, 2, 3, 4]  # one control message a step, none lost
    # the searches ran one after the other: each point's two steps under consecutive messages
    for p in unit.serves:
        a, b = (r.limits["seq"] for r in run.point(p).rounds())
        assert b == a + 1
    assert {s.point: s.status for s in run.summaries()} == {LEAD: "ok", OTHER: "ok"}
    assert all(p in (run.path / "report.html").read_text() for p in unit.serves)
