"""requests.jsonl.gz keeps each request's times to the microsecond (the file is most of a
run's size, and perf_counter's last digits are noise) and everything else as measured."""
from __future__ import annotations

import gzip
import json

from vllm_study.records.results import REQUESTS, RoundRecord, append_round, read_requests


def test_times_are_kept_to_the_microsecond_and_the_rest_unchanged(tmp_path):
    request = {"index": 3, "send_time": 1344.168346981, "end_time": 1357.933040472, "due_time": None,
               "prompt_tokens": 6758, "output_tokens": 3, "ttft_s": 0.23737538000000313,
               "e2e_s": 13.764576691999991, "itl_s": [0.023053441999991264, 0.0000004, 0.1670404],
               "error": None, "error_detail": None, "tags": {"class": "shared", "weight": 0.123456789},
               "text": None}
    record = RoundRecord(point="p", start=2, round=1, status="ok", utc="2026-12-03T00:00:00Z", metrics={})
    append_round(tmp_path, record, [request])
    with gzip.open(tmp_path / REQUESTS, "rt") as f:
        (line,) = f.read().splitlines()
    got = json.loads(line)
    assert got["send_time"] == 1344.168347 and got["end_time"] == 1357.933040
    assert got["ttft_s"] == 0.237375 and got["e2e_s"] == 13.764577
    assert got["itl_s"] == [0.023053, 0.0, 0.16704]   # a sub-microsecond gap rounds to 0
    assert got["due_time"] is None
    # not a time: as measured
    assert got["tags"] == {"class": "shared", "weight": 0.123456789}
    assert got["prompt_tokens"] == 6758 and got["index"] == 3
    assert (got["start"], got["round"]) == (2, 1)


def test_read_requests_gives_each_rounds_requests_in_the_order_written(tmp_path):
    assert read_requests(tmp_path) is None  # no file: a lean run's start, or one that never served
    for rnd, indices in ((0, (0, 1)), (1, (5, 2, 7))):
        record = RoundRecord(point="p", start=1, round=rnd, status="ok", utc="2026-12-07T00:00:00Z", metrics={})
        append_round(tmp_path, record, [{"index": i, "send_time": 0.5 * i} for i in indices])
    by_round = read_requests(tmp_path)
    assert sorted(by_round) == [0, 1]
    assert [r["index"] for r in by_round[0]] == [0, 1] and [r["index"] for r in by_round[1]] == [5, 2, 7]
    assert all(r["start"] == 1 and r["round"] == rnd for rnd, rs in by_round.items() for r in rs)
