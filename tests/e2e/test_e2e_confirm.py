"""Confirmation until resolved (`confirm:`) on the fake engine (tests/fake_engine.py: the
loop is the kit's, whatever serves), through `python -m vllm_study sweep`: after the
planned start of each point, the best, the runner-up and the baseline get fresh starts
in blocks until both gains are resolved or confirm.max_starts is reached; confirm.json
and the report's answer say how it ended.

The verdicts come from real measurements, so the test asserts what holds for any of
them. The study is chosen so that a block is likely: max_num_seqs 8 and 16 both serve
concurrency 8 in one batch, so both usually meet the SLO at capacity.hi, a pair of lower
bounds that no start tells apart; max_num_seqs 1 queues 8 requests and meets it only at
lower concurrency."""
from __future__ import annotations

import json

import pytest
from e2e_support import UNI, fake_engine_study, sweep, tiny, write

from vllm_study.analysis import confirmation as confirming
from vllm_study.records import confirmation
from vllm_study.records.results import RunFolder

REASONS = (confirmation.RESOLVED, confirmation.MAX_STARTS, confirmation.BUDGET, confirmation.FAILED,
           confirmation.NOTHING)

# One planned start a point and at most one more: the loop is the same for any count.
CONFIRM_STUDY = fake_engine_study(tiny(
    name="e2e-confirm", grid={"max_num_seqs": [1, 8, 16]}, baseline="mns=16",
    workload={"system_prompt_tokens": 512, "question_tokens": 16, "output_tokens": 32,
              "requests_per_round": 16, "warmup_requests": 2},
    slo={"ttft_p90_ms": 1000},
    capacity={"over": "concurrency", "lo": 1, "hi": 8, "max_steps": 2},
    replicates=1, confirm={"until": "resolved", "max_starts": 2}, server={"extra_cli_args": UNI}))


@pytest.mark.e2e
@pytest.mark.fake_engine
def test_confirmation_adds_blocks_of_the_best_runner_up_and_baseline_and_says_why_it_stopped(tmp_path):
    results = tmp_path / "results"
    r = sweep(write(tmp_path, CONFIRM_STUDY), "--results", results)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    (path,) = results.iterdir()
    run = RunFolder(path)
    rec = confirmation.read(path)
    assert rec is not None, "confirm.json is missing"
    assert f"confirm: stopped: {rec.stop}" in r.stdout

    # the stop reason is one of the loop's; nothing here spends a budget or fails a start
    assert rec.stop and rec.stop.split(": ", 1)[0] in REASONS, rec.stop
    assert not rec.stop.startswith((confirmation.BUDGET, confirmation.FAILED)), rec.stop
    assert all(s.status == "ok" for s in run.summaries()), [(s.point, s.reasons) for s in run.summaries()]

    # one verdict per block from the planned blocks' last on; a block follows only an unresolved verdict
    order = run.manifest().order
    last = max(u.block for u in order)
    assert rec.planned_blocks == CONFIRM_STUDY["replicates"]
    assert [v.block for v in rec.verdicts] == list(range(rec.planned_blocks, last + 1))
    assert not any(v.resolved for v in rec.verdicts[:-1])
    assert rec.last.resolved == (rec.stop == confirmation.RESOLVED)

    # each block after the planned ones: one fresh start of each of its verdict's best, runner-up and
    # baseline, numbered on from that point's last
    starts = {p: CONFIRM_STUDY["replicates"] for p in run.point_ids()}
    for v in rec.verdicts[:-1]:
        block = [u for u in order if u.block == v.block + 1]
        assert sorted(u.point for u in block) == sorted({v.best, v.runner_up, v.baseline})
        for u in block:
            starts[u.point] += 1
            assert u.start == starts[u.point]
    # on disk: more than `replicates` starts only where a verdict named the point, none beyond max_starts
    named = {p for v in rec.verdicts[:-1] for p in (v.best, v.runner_up, v.baseline)}
    max_starts = CONFIRM_STUDY["confirm"]["max_starts"]
    for p in run.point_ids():
        done = len(run.point(p).starts())
        assert done == starts[p] <= max_starts, (p, done, starts[p])
        assert done == CONFIRM_STUDY["replicates"] or p in named, p
    # the last verdict counts the starts it judged
    assert rec.last.starts == {p: starts[p] for p in rec.last.starts}
    if rec.stop.startswith(confirmation.MAX_STARTS):  # names the points at the cap, and they are
        full = [p for p in (rec.last.best, rec.last.runner_up, rec.last.baseline) if starts[p] >= max_starts]
        assert full and all(p in rec.stop for p in full), rec.stop

    # the report's answer states what was resolved and why it stopped, as the record says
    nb = json.loads((path / "report.ipynb").read_text())
    text = "".join("".join(o.get("text", "")) for c in nb["cells"] for o in c.get("outputs", []))
    words = confirming.stop_words(rec)
    assert words and words in text, (words, text[-3000:])
    assert f"stopped: {rec.stop}." in text
