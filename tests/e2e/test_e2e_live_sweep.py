"""A study with two chunk sizes and two max_num_seqs on the CPU engine: live knobs are
on by default there, so one server start serves all four points. Each point keeps its
own folder and records; every round's limits are the engine's own report of what it ran
the round under (the kit's live-limits plugin code, running in the fake engine), and its
largest step and most running requests stay within them; the report renders. A
precision block whose start serves the whole group again. Both on the fake engine: the
grouping, the control messages and the records are the sweep's own control flow; vLLM's
scheduler keeping to limits lowered live is tested on vLLM in test_e2e_live_knobs.py."""
from __future__ import annotations

import json

import pytest

from e2e_support import fake_engine_study, sweep, tiny, write
from procs import group_gone
from vllm_study.records.results import RunFolder

pytestmark = [pytest.mark.e2e, pytest.mark.fake_engine]

CHUNKS, SEQS = [256, 512], [2, 4]
# the 512-token system prompt (plus its question) is longer than the small chunk and
# fills the large one; 8 requests at concurrency 4 fill either max_num_seqs
STUDY = fake_engine_study(tiny(grid={"max_num_batched_tokens": CHUNKS, "max_num_seqs": SEQS}, rounds=2,
                               workload={**tiny()["workload"], "requests_per_round": 8}))


def test_one_start_serves_four_points_under_the_limits_each_round_recorded(tmp_path):
    done = sweep(write(tmp_path, STUDY), "--results", tmp_path / "results", timeout=900)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "live knobs: 1 server start(s) a block serve the 4 points" in done.stdout
    run = RunFolder(next((tmp_path / "results").iterdir()))
    (unit,) = run.manifest().order
    lead = "mbt=512__mns=4"
    assert unit.point == lead and sorted(unit.serves) == sorted(run.manifest().points)

    starts = {p: run.point(p).start(1) for p in unit.serves}
    assert all(s.status == "ok" for s in starts.values()), {p: s.reason for p, s in starts.items()}
    # one server: its launch, start-up and log in the lead's start only; the others name it
    assert starts[lead].serves == unit.serves and starts[lead].launch.startup_s > 0
    cmd = starts[lead].launch.command
    assert cmd[cmd.index("--max-num-batched-tokens") + 1] == "512" and cmd[cmd.index("--max-num-seqs") + 1] == "4"
    assert "vllm_study.scheduler_plugin.LiveLimitsScheduler" in cmd
    assert group_gone(starts[lead].launch.server_pgid)
    for p, s in starts.items():
        if p != lead:
            assert s.served_by == f"{lead}/s1" and s.launch.command is None and s.launch.startup_s is None
            assert not (run.point(p).start_dir(1) / "server.log.gz").exists()
    assert (run.point(lead).start_dir(1) / "server.log.gz").exists()
    assert run.manifest().overlaps == []  # one server: nothing ran beside it

    seqs = []
    for p in unit.serves:
        values = run.point(p).plan().point.values
        rounds = run.point(p).rounds()
        assert [r.round for r in rounds] == [0, 1] and all(r.status == "ok" for r in rounds)
        for r in rounds:
            lim = r.limits
            assert (lim["max_num_batched_tokens"], lim["max_num_seqs"]) == (
                values["max_num_batched_tokens"], values["max_num_seqs"])
            # what the engine did in the round, beside what it was told
            assert 0 < lim["peak_step_tokens"] <= lim["max_num_batched_tokens"]
            assert 0 < lim["peak_running"] <= lim["max_num_seqs"]
            seqs.append(lim["seq"])
    assert sorted(seqs) == list(range(1, 9))  # one control message a round, none lost
    # the limits were lowered for real: a 512-token step only where the chunk is 512
    peaks = {p: max(r.limits["peak_step_tokens"] for r in run.point(p).rounds()) for p in unit.serves}
    assert all(peaks[p] > 256 for p in unit.serves if p.startswith("mbt=512"))
    # the engine's own last word: the last round's limits are those in force
    knobs = json.loads((run.point(lead).start_dir(1) / "prefix_budget.json").read_text())["knobs"]
    last = max((r for p in unit.serves for r in run.point(p).rounds()), key=lambda r: r.limits["seq"])
    assert knobs["applied_seq"] == 8 and knobs["in_force"] == {
        k: last.limits[k] for k in ("max_num_batched_tokens", "max_num_seqs", "long_prefill_token_threshold")}

    html = (run.path / "report.html").read_text()
    assert all(p in html for p in unit.serves)
    assert {s.point: s.status for s in run.summaries()} == {p: "ok" for p in unit.serves}


def test_precision_adds_a_start_that_serves_the_whole_group_again(tmp_path):
    """One planned start gives no start-to-start spread, so every interval is too wide:
    precision adds a block, and its start serves both points again, as the first did."""
    study = fake_engine_study(tiny(grid={"max_num_batched_tokens": CHUNKS}, rounds=1,
                                   precision={"metric": "ttft_p90_ms", "relative_width": 0.2, "max_starts": 2},
                                   workload={**tiny()["workload"], "requests_per_round": 4, "warmup_requests": 1}))
    done = sweep(write(tmp_path, study), "--results", tmp_path / "results", "--no-report", timeout=900)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "precision: block 2, 1 more server start(s) for 2 point(s), start 2+" in done.stdout
    run = RunFolder(next((tmp_path / "results").iterdir()))
    lead = "mbt=512"
    assert [(u.point, u.start, u.block, sorted(u.serves)) for u in run.manifest().order] == [
        (lead, k, k, ["mbt=256", lead]) for k in (1, 2)]
    for k in (1, 2):
        assert run.point(lead).start(k).serves == [lead, "mbt=256"]
        assert run.point("mbt=256").start(k).served_by == f"{lead}/s{k}"
    assert {s.point: (s.status, s.starts_done) for s in run.summaries()} == {p: ("ok", 2) for p in ("mbt=256", lead)}
