"""One grid point: launch vLLM, warm up, run the rounds, record everything.

The steps are methods so the point notebook can show each as a cell. A failure
(server that never starts, server that dies mid-round) marks the point failed with a
reason and turns the remaining steps into no-ops: the notebook still finishes and
the sweep goes on. Finished rounds are on disk the moment they end.
"""
from __future__ import annotations

import ast
import atexit
import functools
import gzip
import json
import os
import re
import time
from dataclasses import replace
from pathlib import Path

from . import client, counters, loads, runfolder, stats
from .models import build_model_dir
from .params import Point, Study
from .server import ServerStartError, VllmServer, failure_reason, free_port, serve_command
from .workload import make_workload

SUMMARY, ROUNDS, REQUESTS, LOG = "summary.json", "rounds.jsonl", "requests.jsonl.gz", "server.log"


def model_cache_dir() -> Path:
    return Path(os.environ.get("VLLM_STUDY_CACHE", Path.home() / ".cache" / "vllm_study")) / "models"


def prepare_model(study: Study) -> tuple[str, bool]:
    """(model path or id, load dummy weights?)"""
    if study.model.path:
        return study.model.path, False
    return str(build_model_dir(study.model.card, model_cache_dir() / study.model.card)), True


def _non_default_args(log_text: str) -> dict | None:
    """vLLM logs the engine args it was given as a Python dict literal at startup."""
    m = re.search(r"non-default args: (\{.*\})", log_text)
    try:
        return ast.literal_eval(m.group(1)) if m else None
    except (ValueError, SyntaxError):
        return None


def _step(method):
    """A step that raises records the point as failed (with the error) instead of
    stopping the notebook: failures are data, and later steps become no-ops."""
    @functools.wraps(method)
    def wrapper(self, *a, **kw):
        if self.failed:
            return None
        try:
            return method(self, *a, **kw)
        except Exception as e:
            self._fail(f"{method.__name__}: {type(e).__name__}: {e}")
            return None
    return wrapper


class PointRun:
    def __init__(self, study: Study, point: Point, point_dir: str | Path, engine: str):
        self.study, self.point, self.engine = study, point, engine
        self.dir = Path(point_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        for stale in (ROUNDS, REQUESTS):  # a re-run of a point starts clean
            (self.dir / stale).unlink(missing_ok=True)
        self.server: VllmServer | None = None
        self.url = self.model_name = self.api_key = None  # set by launch()
        self.has_metrics = True   # a gateway may not expose vLLM's /metrics
        self.rounds: list[dict] = []
        self.nvml = counters.NvmlProbe()
        self.summary = {
            "point": point.id, "values": point.values, "status": "running", "reason": None,
            "engine": engine, "engine_args": point.engine_args.model_dump(exclude_none=True),
            "effective": dict(point.effective), "warnings": point.warnings,
            "rounds_planned": study.rounds, "rounds_ok": 0,
            **runfolder.machine(self.nvml),
        }
        self._write_summary()

    # -- bookkeeping --------------------------------------------------------
    @property
    def failed(self) -> bool:
        return self.summary["status"] == "failed"

    def _fail(self, reason: str) -> None:
        self.summary.update(status="failed", reason=reason)
        self._write_summary()

    def _write_summary(self) -> None:
        tmp = self.dir / (SUMMARY + ".tmp")
        tmp.write_text(json.dumps(self.summary, indent=2, default=str))
        tmp.replace(self.dir / SUMMARY)  # atomic: a reader never sees half a file

    # -- steps --------------------------------------------------------------
    @_step
    def launch(self) -> None:
        """Start this point's vLLM, or, for an endpoint target, check that it answers."""
        s = self.study
        model, dummy = prepare_model(s)  # also the tokenizer that sizes prompts for targets
        from transformers import AutoTokenizer
        self.tokenizer = AutoTokenizer.from_pretrained(model)
        self.workload = make_workload(self.tokenizer, s.workload)
        self.summary["workload"] = {"kind": s.workload.kind, "seed": s.workload.seed,
                                    "load": s.workload.load.kind}
        if self.point.target:
            self._connect(self.point.target)
        else:
            self._start_server(model, dummy)

    def _connect(self, t) -> None:
        self.url, self.model_name = t.base_url, t.model
        # Only the variable's name is recorded; the key stays in memory.
        self.summary["target"] = {"name": t.name, "base_url": t.base_url, "model": t.model,
                                  "api_key_env": t.api_key_env}
        if t.api_key_env:
            self.api_key = os.environ.get(t.api_key_env)
            if not self.api_key:
                self._fail(f"environment variable {t.api_key_env} (the API key of target "
                           f"{t.name}) is not set; export it before the run")
                return
        try:
            client.check_endpoint(self.url, self.model_name, self.api_key)
        except client.EndpointError as e:
            self._fail(f"target {t.name}: {e}")
            return
        try:
            self.summary["effective"]["cache_config"] = counters.cache_config(
                counters.scrape(self.url, self.api_key))
            counters.reset_prefix_cache(self.url, self.api_key)
        except OSError as e:  # a gateway may expose neither
            self.has_metrics = False
            self.summary["warnings"] = self.summary["warnings"] + [
                f"{self.url}: /metrics or /reset_prefix_cache not available ({e}): server-side "
                "counters are absent and rounds do not start from a reset cache"]
        self._write_summary()

    def _start_server(self, model: str, dummy: bool) -> None:
        s = self.study
        port = free_port()
        cmd = serve_command(model, port, self.point.engine_args.cli(), s.model.served_name,
                            load_dummy=dummy, extra=s.server.extra_cli_args)
        self.summary["command"] = cmd
        self.server = VllmServer(cmd, port, self.dir / LOG, env=s.server.env,
                                 startup_timeout_s=s.server.startup_timeout_s)
        atexit.register(self.server.stop)  # a kernel that dies mid-point stops its server
        try:
            self.server.start()
            reason = None
        except ServerStartError as e:
            reason = e.reason
        self.summary["effective"]["vllm_non_default_args"] = _non_default_args(
            (self.dir / LOG).read_text(errors="replace"))
        if reason:
            self._fail(f"server did not start: {reason}")
            return
        self.summary["server_pgid"] = self.server.proc.pid
        self.summary["startup_s"] = self.server.startup_s
        self.url, self.model_name = self.server.url, s.model.served_name
        snap = counters.scrape(self.server.url)
        self.summary["effective"]["cache_config"] = counters.cache_config(snap)
        if s.workload.kind == "shared_prefix":
            block = int(self.summary["effective"]["cache_config"].get("block_size", 16))
            # what a cache that never evicts would hit: compare with the measured rate
            self.summary["workload"]["expected_prefix_hit_rate"] = self.workload.expected_hit_rate(
                s.workload.requests_per_round, block)
        client.check_endpoint(self.server.url, s.model.served_name)
        self._write_summary()

    def _send(self, requests) -> list[dict]:
        """Closed loop: `concurrency` requests in flight."""
        w = self.study.workload
        res = client.run_sync(client.run_closed_loop(
            self.url, self.model_name, w.api, requests, w.concurrency,
            timeout_s=w.request_timeout_s, api_key=self.api_key))
        return [r.to_dict() for r in res]

    def _send_round(self) -> list[dict]:
        """One round's requests under the study's load model."""
        w = self.study.workload
        n, load = w.requests_per_round, w.load
        if w.kind == "multi_turn":
            res = client.run_sync(client.run_conversations(
                self.url, self.model_name, self.workload, n // w.turns, w.concurrency, w.think_time_s,
                timeout_s=w.request_timeout_s, api_key=self.api_key))
            return [r.to_dict() for r in res]
        requests = self.workload.requests(n)
        if load.kind == "closed":
            return self._send(requests)
        if load.kind == "poisson":
            times = loads.arrivals(n, load.rate, load.burstiness, w.seed)
        else:
            times, step = loads.ladder(n, load.rates, load.burstiness, w.seed)
            requests = [replace(r, tags={**r.tags, "step": rate}) for r, rate in zip(requests, step)]
        res = client.run_sync(client.run_open_loop(
            self.url, self.model_name, w.api, requests, times, timeout_s=w.request_timeout_s,
            api_key=self.api_key, max_concurrency=load.max_concurrency))
        return [r.to_dict() for r in res]

    @_step
    def warmup(self) -> None:
        """Requests from a separate stream, excluded from every statistic."""
        if not self.study.workload.warmup_requests:
            return
        res = self._send(self.workload.requests(self.study.workload.warmup_requests, "warmup"))
        self.summary["warmup_errors"] = sum(1 for r in res if r["error"])
        self._write_summary()

    @_step
    def run_round(self, index: int) -> dict | None:
        url = self.url
        key = self.api_key
        if self.has_metrics:
            counters.reset_prefix_cache(url, key)  # every round starts from the same (cold) cache
            before = counters.scrape(url, key)
        sampler = counters.RoundSampler(url if self.has_metrics else None, self.nvml, api_key=key)
        with sampler:
            t0 = time.perf_counter()
            results = self._send_round()
            duration = time.perf_counter() - t0
        row = {"round": index, **stats.round_stats(results, duration, self.study.slo.ttft_ms,
                                                   self.study.slo.tpot_ms), **stats.group_stats(results)}
        if self.server and not self.server.alive():
            row["status"] = "failed"
            self._append_round(row, results)
            self._fail(f"server died during round {index}: {_log_reason(self.dir / LOG)}")
            return row
        if self.has_metrics:
            row |= counters.round_deltas(before, counters.scrape(url, key))
        row |= sampler.result()
        row["status"] = "ok" if row["completed"] else "failed"
        self._append_round(row, results)
        return row

    def _append_round(self, row: dict, results: list[dict]) -> None:
        self.rounds.append(row)
        with open(self.dir / ROUNDS, "a") as f:
            f.write(json.dumps(row) + "\n")
        with gzip.open(self.dir / REQUESTS, "at") as f:
            for r in results:
                r = {**r, "round": row["round"],
                     "itl_s": [round(x, 6) for x in r["itl_s"]]}
                f.write(json.dumps(r) + "\n")

    def run_rounds(self, progress=None) -> None:
        for i in range(self.study.rounds):
            if self.failed:
                break
            self.run_round(i)
            if progress:
                progress(i)

    def finish(self) -> dict:
        if self.server:
            self.server.stop()
        ok = [r for r in self.rounds if r.get("status") == "ok"]
        self.summary["rounds_ok"] = len(ok)
        if ok:
            self.summary["medians"] = stats.point_medians(ok)
        if not self.failed:
            if len(ok) < self.study.rounds:
                self._fail(f"only {len(ok)} of {self.study.rounds} rounds completed a request")
            else:
                self.summary["status"] = "ok"
        self._write_summary()
        return self.summary


def _log_reason(log: Path) -> str:
    return failure_reason(log.read_text(errors="replace")) if log.exists() else "no log"
