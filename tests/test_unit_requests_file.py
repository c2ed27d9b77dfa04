"""requests.jsonl.gz keeps each request's times to the microsecond (the file is most of a
run's size, and perf_counter's last digits are noise) and everything else as measured."""
from __future__ import annotations

import gzip
import json

from vllm_study.records.results import REQUESTS, RoundRecord, append_round


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
