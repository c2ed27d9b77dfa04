"""What a start's rounds send, built by its launch while the server starts (seconds of
CPU: the tokenizer, the word pieces, a round's prompts): the tokenizer, the workload
and, with trace.windows, the trace's windows; and what a cache that never evicts would
hit on it."""
from __future__ import annotations

from ..define import models, tokenizer
from ..records.results import StartRecord
from ..workload import windows as trace_windows
from ..workload.build_workload import make_workload
from ..workload.trace_workload import window_workload


class StartWorkload:
    """The workload of the point in `plan`, once `build` has run: `tokenizer`, `workload`
    (with trace.windows, the first window's until a round picks its own) and `windows`
    (trace.windows: the whole trace, its windows and their workloads; else None)."""

    def __init__(self, plan):
        self.study, self.point = plan.study, plan.point
        self.tokenizer = self.workload = self.windows = None

    def build(self, model: str, record: StartRecord) -> None:
        """The tokenizer of `model` and the workload; a trace's record (its rows, the
        requests left out) into `record`."""
        self.tokenizer = tokenizer.load(model)
        w = self.study.workload
        if w.kind == "trace":
            self.workload = self.trace_workload(record)
        else:
            self.workload = make_workload(self.tokenizer, w)

    def trace_workload(self, record: StartRecord):
        """The trace's window, less the requests longer than the server allows (counted in
        `record`), as prompts of exact length and prefix structure."""
        w = self.study.workload
        limit = (self.point.effective.max_model_len if self.point.effective else None) \
            or models.max_positions(self.study.model)
        if w.trace.windows:  # one workload a window; the first is the start's until a round picks its own
            self.windows, record.trace = trace_windows.build(self.tokenizer, w, limit)
            return self.windows.workloads[0]
        wl, record.trace = window_workload(self.tokenizer, w, limit)
        return wl

    def expected_hit_rate(self, kv_block: int) -> float | None:
        """What a cache that never evicts would hit (the report puts it beside the measured
        rate) at KV-cache block size `kv_block`, for the workloads that share a prefix; a
        trace's from its prefix block ids."""
        kind = self.study.workload.kind
        if kind == "trace":
            if self.windows:  # each round records its window's; the start, their mean
                return self.windows.expected_hit_rate()
            return self.workload.expected_hit_rate()
        if kind not in ("shared_prefix", "mixed", "eviction"):
            return None
        return self.workload.expected_hit_rate(self.study.workload.requests_per_round, kv_block)
