"""The plugin's counters: kept in the EngineCore process, written there as JSON, read
and differenced by a client.

The scheduler runs in vLLM's EngineCore process, not in the API server, so the API
server's Prometheus /metrics never sees it. The recorder writes cumulative counters
to ``stats_path`` (tmp file + os.replace, so a reader never sees half a file) from a
daemon thread at most every ``interval_s`` and once more at shutdown. A client takes
``read_stats`` before and after a round and ``stats_delta`` of the two, as it does
with vLLM's own cumulative Prometheus counters.

File layout (``schema`` 1):
    run_id, pid, started_at, updated_at, vllm_version, base_class, params,
    counters: {deferred, admitted_by_ratio, admitted_by_age, admitted_idle,
               admitted_idle_undeferred, aborted_while_deferred, lookups, steps},
    defer_ms: [...]         one entry per deferred request, appended when vLLM admits it:
                            how long the plugin held it (first deferral -> release)
    release_step_ms: [...]  parallel to defer_ms: the gap between the scheduling step
                            that released it and the step before, i.e. one engine step
    admit_wait_ms: [...]    parallel to defer_ms: release -> admission by vLLM (its own
                            FCFS queueing, not the plugin's; usually 0)
    knobs: {...}            only with live limits on (live_limits.py): the limits in force and
                            the last control message handled
Every deferred request's durations are kept (append-only), so a delta's percentiles
are exact; the file grows by ~3 numbers per deferred request.
"""
from __future__ import annotations

import json
import math
import os
import threading
import time
from pathlib import Path

SCHEMA = 1
COUNTERS = ("deferred", "admitted_by_ratio", "admitted_by_age", "admitted_idle",
            "admitted_idle_undeferred", "aborted_while_deferred", "lookups", "steps")
SERIES = ("defer_ms", "release_step_ms", "admit_wait_ms")


class StatsRecorder:
    """Cumulative counters plus a writer thread. The scheduler thread mutates them
    under the lock; the writer copies them under the same lock."""

    def __init__(self, path: str | os.PathLike | None, meta: dict, interval_s: float = 0.2):
        self.path = Path(path) if path else None
        self.interval_s = interval_s
        self.counters = {k: 0 for k in COUNTERS}
        self.series: dict[str, list[float]] = {k: [] for k in SERIES}
        self.sections: dict[str, dict] = {}  # e.g. "knobs" (live_limits.py): written as top-level keys
        now = time.time()
        self.meta = {"schema": SCHEMA, "run_id": f"{os.getpid()}-{now:.6f}", "pid": os.getpid(),
                     "started_at": now, **meta}
        self._lock = threading.Lock()
        self._write_lock = threading.Lock()  # flush() from any thread: one tmp file at a time
        self._dirty = True
        self._stop = threading.Event()
        self._thread = None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.flush()  # the file exists as soon as the engine is up
            self._thread = threading.Thread(target=self._loop, name="prefix-budget-stats",
                                            daemon=True)
            self._thread.start()

    def add(self, counter: str, n: int = 1) -> None:
        with self._lock:
            self.counters[counter] += n
            self._dirty = True

    def record_admission(self, reason: str, defer_ms: float, release_step_ms: float,
                         admit_wait_ms: float) -> None:
        with self._lock:
            self.counters[f"admitted_by_{reason}" if reason in ("ratio", "age")
                          else "admitted_idle"] += 1
            self.series["defer_ms"].append(round(defer_ms, 3))
            self.series["release_step_ms"].append(round(release_step_ms, 3))
            self.series["admit_wait_ms"].append(round(admit_wait_ms, 3))
            self._dirty = True

    def set_section(self, name: str, values: dict) -> None:
        """Merge values into a section of the file (created on first use)."""
        with self._lock:
            self.sections.setdefault(name, {}).update(values)
            self._dirty = True

    def update_section(self, name: str, change) -> None:
        """change(section) under the lock: a read-modify-write no snapshot can split."""
        with self._lock:
            change(self.sections[name])
            self._dirty = True

    def snapshot(self) -> dict:
        with self._lock:
            self._dirty = False
            return {**self.meta, "updated_at": time.time(), "counters": dict(self.counters),
                    **{k: list(v) for k, v in self.series.items()},
                    **{k: dict(v) for k, v in self.sections.items()}}

    def flush(self) -> None:
        if self.path is None:
            return
        with self._write_lock:
            data = self.snapshot()
            tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(data))
            os.replace(tmp, self.path)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            if self._dirty:
                try:
                    self.flush()
                except OSError:
                    pass  # a full disk must not kill the engine; the next try may work

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
            self._thread = None
        self.flush()


STATS_ENV = "VLLM_STUDY_PB_STATS"


def stats_path_for(params, vllm_config) -> str | None:
    # The environment variable serves a launcher that changes the path per server start:
    # additional_config is part of vLLM's compile-cache hash, the environment is not.
    path = params.stats_path or os.environ.get(STATS_ENV) or None
    pc = getattr(vllm_config, "parallel_config", None)
    if path and pc is not None and getattr(pc, "data_parallel_size", 1) > 1:
        # one EngineCore per data-parallel rank: one file each, not one clobbered file
        stem, dot, ext = path.rpartition(".")
        rank = getattr(pc, "data_parallel_rank", 0)
        path = f"{stem}.dp{rank}.{ext}" if dot and "/" not in ext else f"{path}.dp{rank}"
    return path


def read_stats(path: str | os.PathLike) -> dict:
    """The counters the EngineCore last wrote to ``path`` (the plugin's stats_path)."""
    p = Path(path)
    try:
        data = json.loads(p.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(
            f"no prefix-budget stats at {p}: is the server running with --scheduler-cls "
            "vllm_study.scheduler_plugin.PrefixBudgetScheduler and this stats_path in "
            "--additional-config?") from None
    if data.get("schema") != SCHEMA:
        raise ValueError(f"{p}: stats schema {data.get('schema')!r}, this kit reads {SCHEMA}")
    return data


def percentile(values: list[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default method)."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def stats_delta(before: dict, after: dict) -> dict:
    """What happened between two read_stats snapshots of one engine run.

    Counters are differences; defer_ms_* are over the deferred requests that vLLM
    admitted in between (durations are appended at admission). A request deferred
    before `before` and admitted after it counts in the durations but not in
    `deferred` (which counts first deferrals).
    """
    if before.get("run_id") != after.get("run_id"):
        raise ValueError("the two snapshots come from different engine runs (the server "
                         f"restarted: run_id {before.get('run_id')} vs {after.get('run_id')}); "
                         "counters restart at 0 with each engine, take both in one run")
    n0 = len(before["defer_ms"])
    if len(after["defer_ms"]) < n0:
        raise ValueError("'after' has fewer defer_ms entries than 'before': are they swapped?")
    out = {k: after["counters"][k] - before["counters"][k] for k in COUNTERS}
    new = {k: after[k][n0:] for k in SERIES}
    d = new["defer_ms"]
    out.update(
        n_defer_samples=len(d),
        defer_ms_p50=percentile(d, 50), defer_ms_p99=percentile(d, 99),
        defer_ms_max=max(d) if d else None,
        # max over requests of (defer - the step that released it): <= max_defer_ms when
        # every request was let go by the first step past the age bound
        defer_ms_minus_step_max=max((x - g for x, g in zip(d, new["release_step_ms"])), default=None),
        release_step_ms_max=max(new["release_step_ms"], default=None),
        admit_wait_ms_max=max(new["admit_wait_ms"], default=None),
        defer_ms=d, release_step_ms=new["release_step_ms"], admit_wait_ms=new["admit_wait_ms"],
        seconds=after["updated_at"] - before["updated_at"],
    )
    return out
