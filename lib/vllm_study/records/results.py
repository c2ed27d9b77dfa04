"""The results layout, as typed records: one module owns every file name, writes
atomically and loads what it wrote (as GuideLLM keeps its reports as pydantic models,
the schema and the files are one thing).

    results/<UTC>-<study>-<sha7>/
      manifest.json   Manifest: code, versions, machine, params, run order, resumes
      study.yaml      the exact study the points ran (what --resume reads)
      summary.csv     tidy: one row per point x start x round x group
      report.ipynb  report.html (not committed)  figures/*.png   FINDINGS.md (written by hand)
      points/<point id>/
        point.json    PointPlan: the resolved point the notebook runs
        summary.json  PointSummary: status over all starts, estimates with intervals
        s<k>/         one server start (replicate k):
          point.ipynb  start.json (StartRecord)  rounds.jsonl (RoundRecord per line)
          requests.jsonl.gz  server.log.gz
"""
from __future__ import annotations

import datetime as dt
import gzip
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Literal

import pandas as pd
from pydantic import BaseModel, field_validator

from ..vocab import metrics
from ..capacity.bracket import CapacityRecord
from ..define.grid import Effective, PointPlan, Unit
from ..launch.machine import GpuInfo, Machine, Versions, describe, versions

MANIFEST, STUDY, SUMMARY_CSV, POINTS = "manifest.json", "study.yaml", "summary.csv", "points"
POINT_PLAN, POINT_SUMMARY = "point.json", "summary.json"
START, ROUNDS, REQUESTS, NOTEBOOK = "start.json", "rounds.jsonl", "requests.jsonl.gz", "point.ipynb"
LOG, LOG_GZ = "server.log", "server.log.gz"
# the rounds frame's leading columns, which say which round a row is (the point's axis values and the metrics follow)
ROUND_KEYS = ["point", "point_status", "start", "block", "round", "round_status", "group", "group_value"]


def now_utc() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


def write_atomic(path: Path, text: str) -> None:
    """A reader (another process, a crash) never sees half a file."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


class _Record(BaseModel):
    def save(self, path: Path) -> None:
        write_atomic(path, self.model_dump_json(indent=2))

    @classmethod
    def load(cls, path: Path):
        return cls.model_validate_json(Path(path).read_text())

    @classmethod
    def load_if(cls, path: Path):
        return cls.load(path) if Path(path).exists() else None


def _known_metrics(values: dict) -> dict:
    values = {metrics.RENAMED.get(k, k): v for k, v in values.items() if k not in metrics.RETIRED}
    unknown = set(values) - set(metrics.REGISTRY)
    if unknown:
        raise ValueError(f"not in the metric registry: {sorted(unknown)}")
    return values


# -- one round --------------------------------------------------------------
class GroupRecord(BaseModel):
    """A round's figures for one request class, turn or rate step."""
    key: Literal["class", "turn", "step", "prefix"]
    value: str
    metrics: dict[str, float | None]

    _check = field_validator("metrics")(_known_metrics)


class RoundRecord(BaseModel):
    point: str
    start: int
    round: int                     # 0-based within its start
    block: int | None = None
    status: Literal["ok", "failed"]
    utc: str
    errors: dict[str, int] = {}    # error kind -> requests
    metrics: dict[str, float | None]
    groups: list[GroupRecord] = []
    # a capacity search's step: the load it ran at (capacity.over's unit) and its verdict
    load: float | None = None
    slo_met: bool | None = None
    slo_why: str | None = None
    # trace.windows: the window the round replayed (1-based) and its first and last request
    # as 0-based indices into the whole trace (inclusive)
    window: int | None = None
    window_first: int | None = None
    window_last: int | None = None
    # a start that served several points (live knobs): the limits the engine ran this
    # round under, as it reported them (measure/live_knobs.py limits_used)
    limits: dict[str, int] | None = None

    _check = field_validator("metrics")(_known_metrics)


# -- one server start ------------------------------------------------------
class Launch(BaseModel):
    """What was started (or which endpoint was measured) and what vLLM made of it."""
    command: list[str] | None = None
    program: list[str] | None = None            # served by this program, not vLLM (server.command)
    startup_s: float | None = None
    server_pgid: int | None = None
    cache_config: dict[str, str] = {}           # labels of vllm:cache_config_info
    vllm_non_default_args: dict[str, Any] | None = None
    target: dict[str, Any] | None = None        # endpoint studies: name, base_url, model, api_key_env
    has_metrics: bool = True                    # /metrics answered
    cache_reset: bool = True                    # /reset_prefix_cache answered: rounds start cold
    hardware_source: str | None = None          # where MFU and bandwidth use came from (launch/machine.py)
    slot_wait_s: float | None = None            # waiting for the slot's previous server to stop
    started_ahead: bool = False                 # spawned before its slot was free, held at its engine's init
    ahead_cpus: list[int] | None = None         # started ahead: the cores it imported on, at nice 19
    ahead_priority_restored: bool | None = None  # its normal priority back once released (needs CAP_SYS_NICE)
    kit_env: dict[str, str] = {}                # variables the kit set for vLLM (not server.env's)


# a start's steps in order: vLLM spawned, /health answered, warm-up sent, rounds ended,
# SIGTERM sent, the server's process group gone. Beside them: "slot" (the start had its
# GPU slot) and, for a server started ahead, "held" (frozen at its engine's init, until
# "slot"); on_gpu() says where its life on the GPU began.
TIMELINE = ("spawn", "ready", "warmup", "measured", "stop", "stopped")


def on_gpu(timeline: dict[str, float]) -> float | None:
    """When a start's server began to use its slot: its spawn, or, started ahead, the
    moment it was let go at its engine's init."""
    if "held" in timeline and "slot" in timeline:
        return timeline["slot"]
    return timeline.get("spawn")


class StartRecord(_Record):
    point: str
    start: int
    block: int | None = None
    status: Literal["running", "ok", "failed"] = "running"
    reason: str | None = None
    started_utc: str
    finished_utc: str | None = None
    host: str
    gpus: list[GpuInfo] = []
    no_gpu_reason: str | None = None
    launch: Launch = Launch()
    warmup_errors: int | None = None
    rounds_planned: int
    rounds_ok: int = 0
    expected_prefix_hit_rate: float | None = None
    capacity: CapacityRecord | None = None      # the capacity search, where the study asks for one
    trace: dict[str, Any] | None = None         # a replayed trace: source, window, requests kept and dropped
    warnings: list[str] = []
    # live knobs: the start that launched the server lists every point it served (itself
    # first); each other point's record names that start (points/<id>/s<k>), where its
    # launch, start-up time, timeline and server log are, recorded once
    serves: list[str] = []
    served_by: str | None = None
    # Unix times of this start's steps (TIMELINE): what the kit spends between them is
    # its own overhead (benchmarks/point_overhead.py); spawn..stopped is the server's life.
    timeline: dict[str, float] = {}


# -- one point over all its starts ------------------------------------------
class Estimate(BaseModel):
    """A point's figure for one metric over its measured rounds: the median, the range,
    and each server start's median (intervals need the whole run: analysis.py)."""
    median: float
    min: float
    max: float
    rounds: int
    starts: int
    start_medians: list[float]


PointStatus = Literal["running", "ok", "partial", "failed"]


class PointSummary(_Record):
    point: str
    values: dict[str, Any]
    status: PointStatus    # ok: every planned round of every start; partial: some rounds; failed: none
    reasons: list[str] = []
    starts_planned: int
    starts_done: int
    rounds_planned: int    # over all planned starts
    rounds_ok: int
    engine: str
    engine_args: dict[str, Any]
    effective: Effective | None = None
    launch: Launch | None = None           # of the first start that came up
    warnings: list[str] = []
    estimates: dict[str, Estimate] = {}
    groups: dict[str, dict[str, Estimate]] = {}   # "class=long" -> metric -> estimate
    # a capacity study's starts that missed the SLO even at their lowest load: per start, the
    # bound its capacity lies below ({"start": 1, "capacity_load": 0.25, "capacity_rps": 0.77});
    # they have no capacity estimate (never a 0)
    capacity_below: list[dict[str, float | None]] = []


# -- the run -----------------------------------------------------------------
class GitState(BaseModel):
    sha: str | None
    dirty: bool | None
    source: Literal["git", "VLLM_STUDY_GIT_SHA", "stamp file", "none", "recorded after the run"] = "git"


class Resume(BaseModel):
    utc: str
    git: GitState
    versions: Versions
    machine: Machine
    units_left: list[str]


class Manifest(_Record):
    study: str
    created_utc: str
    git: GitState
    versions: Versions
    engine: str
    machine: Machine
    cpu_dtype: dict[str, str] | None = None     # engine cpu: {dtype, reason} where the study left it open
    points: list[str]
    order: list[Unit]
    warnings: dict[str, list[str]] = {}
    params: dict[str, Any]
    resumes: list[Resume] = []
    executor: str = "local"                  # who ran the starts (executors/: EXECUTORS)
    overlaps: list[dict[str, Any]] = []      # starts that ran at the same time, with hosts and GPUs
    notes: list[str] = []   # provenance the fields above cannot hold (e.g. a converted run)

    def sweep_of(self, when: float) -> int:
        """Which sweep over this run (0: the first, k: the k-th --resume) was under way at
        `when` (epoch seconds): a run made in slices is timed slice by slice."""
        begins = [dt.datetime.fromisoformat(u).timestamp() for u in [self.created_utc, *(r.utc for r in self.resumes)]]
        return max(sum(b <= when for b in begins) - 1, 0)


def git_output(*args: str, cwd: Path) -> str | None:
    try:
        return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


# A copy of the checkout without .git (one shipped to a GPU machine) names its commit in
# this file at the repository's root, written in the checkout before the copy leaves it
# (tools/stamp_commit.py; git ignores it, so it is carried, never committed): "<sha> dirty"
# or "<sha> clean".
COMMIT_FILE = ".vllm-study-commit"


def git_state(repo: Path) -> GitState:
    """The commit the kit's code is at. A copy of the checkout shipped to another machine
    names it in VLLM_STUDY_GIT_SHA (and VLLM_STUDY_GIT_DIRTY=1 if that tree had
    uncommitted changes); otherwise git answers; in a copy without .git, the COMMIT_FILE
    the copy carries."""
    env = os.environ.get("VLLM_STUDY_GIT_SHA")
    if env:  # named by whoever shipped the tree: it wins over a .git that may have come along stale
        dirty = os.environ.get("VLLM_STUDY_GIT_DIRTY")
        return GitState(sha=env, dirty=None if dirty is None else dirty == "1", source="VLLM_STUDY_GIT_SHA")
    # only the checkout's own .git: a copy without one may lie inside another repository
    # (a test's folder under the checkout), whose commit is not the kit's
    sha = git_output("rev-parse", "HEAD", cwd=repo) if (Path(repo) / ".git").exists() else None
    if sha is None:
        stamp = Path(repo) / COMMIT_FILE
        words = stamp.read_text().split() if stamp.is_file() else []
        if words:
            dirty = words[1] if len(words) > 1 else None
            return GitState(sha=words[0], dirty=None if dirty not in ("dirty", "clean") else dirty == "dirty",
                            source="stamp file")
        return GitState(sha=None, dirty=None, source="none")
    status = git_output("status", "--porcelain", "--untracked-files=no", cwd=repo)
    return GitState(sha=sha, dirty=bool(status) if status is not None else None)


NO_COMMIT = (f"this copy of the kit has no .git and names no commit, so the run will record none: in the "
             f"checkout it came from, run `python tools/stamp_commit.py` and carry {COMMIT_FILE} with the copy, "
             "or set VLLM_STUDY_GIT_SHA=<commit> here")


class RunFolder:
    """Paths and records of one run folder."""

    def __init__(self, path: str | Path):
        self.path = Path(path)

    def __repr__(self) -> str:
        return f"RunFolder({str(self.path)!r})"

    @classmethod
    def create(cls, results: Path, study_name: str, git: GitState) -> "RunFolder":
        stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
        run = cls(Path(results) / f"{stamp}-{study_name}-{(git.sha or 'nogit')[:7]}")
        (run.path / POINTS).mkdir(parents=True)
        return run

    # paths
    @property
    def manifest_path(self) -> Path:
        return self.path / MANIFEST

    @property
    def study_path(self) -> Path:
        return self.path / STUDY

    @property
    def summary_csv(self) -> Path:
        return self.path / SUMMARY_CSV

    @property
    def figures(self) -> Path:
        d = self.path / "figures"
        d.mkdir(exist_ok=True)
        return d

    def point(self, point_id: str) -> "PointFolder":
        return PointFolder(self.path / POINTS / point_id)

    # records
    def manifest(self) -> Manifest:
        if not self.manifest_path.exists():
            raise FileNotFoundError(f"{self.path} has no {MANIFEST}: not a run folder")
        return Manifest.load(self.manifest_path)

    def point_ids(self) -> list[str]:
        """The manifest's order (the grid's), then anything else found on disk."""
        listed = self.manifest().points if self.manifest_path.exists() else []
        on_disk = sorted(d.name for d in (self.path / POINTS).iterdir() if d.is_dir()) \
            if (self.path / POINTS).exists() else []
        return listed + [p for p in on_disk if p not in listed]

    def summaries(self) -> list[PointSummary]:
        out = []
        for pid in self.point_ids():
            s = self.point(pid).summary()
            if s is not None:
                out.append(s)
        return out

    def record_resume(self, repo: Path, units_left: list[str]) -> None:
        """A resumed run may span days, commits and machines: each resume appends which
        code, versions and machine ran which units."""
        m = self.manifest()
        m.resumes.append(Resume(utc=now_utc(), git=git_state(repo), versions=versions(),
                                machine=describe(), units_left=units_left))
        m.save(self.manifest_path)

    def rounds_table(self, start_capacity=None) -> pd.DataFrame:
        """Tidy: one row per point x start x round x group (group 'all' is the whole
        round), with the point's axis values and its status beside each row. A run with
        no round has the columns and no row. `start_capacity(start record, its folder)`:
        a capacity study's figures on the round at each start's capacity
        (records.point_capacity.start_figures); without it, the search's record's
        (capacity_figures: the highest load that met)."""
        rows = []
        for s in self.summaries():
            base = {"point": s.point, **s.values, "point_status": s.status}
            folder = self.point(s.point)
            starts = folder.starts()
            # a start that failed mid-search has no capacity: it is a failed start
            searches = {st.start: st.capacity for st in starts if st.capacity and st.status == "ok"}
            by_start = {st.start: st for st in starts}
            capacity_study = any(st.capacity for st in starts)
            for r in folder.rounds():
                head = {**base, "start": r.start, "block": r.block, "round": r.round, "round_status": r.status}
                extra = {}
                if capacity_study:  # a capacity study: each step's load, and the capacity on the round measured at it
                    cap = searches.get(r.start)
                    at = cap is not None and cap.at_round == r.round
                    head |= {"load": r.load, "slo_met": r.slo_met, "at_capacity": at}
                    extra = {} if not at else start_capacity(by_start[r.start], folder.start_dir(r.start)) \
                        if start_capacity else capacity_figures(cap)
                if r.window is not None:  # trace.windows (a column only where a run has them)
                    head |= {"window": r.window}
                rows.append({**head, "group": "all", "group_value": "", **r.metrics, **extra})
                rows += [{**head, "group": g.key, "group_value": g.value, **g.metrics} for g in r.groups]
        return pd.DataFrame(rows) if rows else pd.DataFrame(columns=ROUND_KEYS)

    def write_summary_csv(self, start_capacity=None) -> pd.DataFrame:
        """summary.csv; a capacity study's is written by records.point_capacity.write_summary_csv
        (each start's fitted capacity)."""
        df = self.rounds_table(start_capacity)
        write_atomic(self.summary_csv, df.to_csv(index=False))
        return df


def capacity_figures(cap: CapacityRecord) -> dict[str, float | None]:
    """A start's capacity as metrics: none where even the search's lowest load missed (its
    capacity is a bound below that load, never 0: capacity.estimate states it)."""
    return {"capacity_rps": cap.requests_per_s if cap.load is not None else None,
            "capacity_load": cap.load}


class PointFolder:
    def __init__(self, path: Path):
        self.path = Path(path)
        self.id = self.path.name

    @property
    def plan_path(self) -> Path:
        return self.path / POINT_PLAN

    @property
    def summary_path(self) -> Path:
        return self.path / POINT_SUMMARY

    def start_dir(self, start: int) -> Path:
        return self.path / f"s{start}"

    def plan(self) -> PointPlan:
        return PointPlan.model_validate_json(self.plan_path.read_text())

    def save_plan(self, plan: PointPlan) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        write_atomic(self.plan_path, plan.model_dump_json(indent=2))

    def summary(self) -> PointSummary | None:
        return PointSummary.load_if(self.summary_path)

    def _start_dirs(self) -> list[tuple[StartRecord, Path]]:
        """Every subfolder holding a start record (s<k>/ as the sweep names them, or a
        folder a notebook run by hand was given), in start order."""
        found = [(StartRecord.load_if(f), f.parent) for f in self.path.glob(f"*/{START}")]
        return sorted(((r, d) for r, d in found if r), key=lambda rd: rd[0].start)

    def starts(self) -> list[StartRecord]:
        return [r for r, _ in self._start_dirs()]

    def start(self, k: int) -> StartRecord | None:
        return StartRecord.load_if(self.start_dir(k) / START)

    def rounds(self) -> list[RoundRecord]:
        return [rec for _, d in self._start_dirs() for rec in read_rounds(d / ROUNDS)]


def read_rounds(path: Path) -> list[RoundRecord]:
    """rounds.jsonl; a last line still being written (another process) is skipped."""
    if not Path(path).exists():
        return []
    out = []
    for line in Path(path).read_text().splitlines():
        try:
            out.append(RoundRecord.model_validate_json(line))
        except ValueError:
            continue
    return out


# The per-request times (RequestResult's *_time and *_s fields, all in seconds) are kept
# to the microsecond: perf_counter's last digits are noise far below what a streamed
# chunk's arrival can resolve, and they tripled the gzipped file (most of a run's size).
TIME_DECIMALS = 6


def _to_microseconds(key: str, value):
    if not (key.endswith("_time") or key.endswith("_s")):
        return value
    if isinstance(value, float):
        return round(value, TIME_DECIMALS)
    if isinstance(value, list):
        return [round(v, TIME_DECIMALS) if isinstance(v, float) else v for v in value]
    return value


def request_line(request: dict, start: int, round_: int) -> str:
    """One line of requests.jsonl.gz: the request's record, its times to the microsecond."""
    rec = {k: _to_microseconds(k, v) for k, v in request.items()}
    return json.dumps({**rec, "start": start, "round": round_}) + "\n"


def append_round(start_dir: Path, record: RoundRecord, requests: list[dict]) -> None:
    """A finished round is on disk the moment it ends: its record and its requests."""
    with open(Path(start_dir) / ROUNDS, "a") as f:
        f.write(record.model_dump_json() + "\n")
    with gzip.open(Path(start_dir) / REQUESTS, "at") as f:
        for r in requests:
            f.write(request_line(r, record.start, record.round))


def read_requests(start_dir: Path) -> dict[int, list[dict]] | None:
    """A start's requests.jsonl.gz by round (each request as request_line wrote it), or
    None where the start kept no requests file (a lean run, or one that never served)."""
    path = Path(start_dir) / REQUESTS
    if not path.exists():
        return None
    by_round: dict[int, list[dict]] = {}
    with gzip.open(path, "rt") as f:
        for line in f:
            if line.strip():
                r = json.loads(line)
                by_round.setdefault(r["round"], []).append(r)
    return by_round


def compress_log(start_dir: Path) -> None:
    """server.log -> server.log.gz once the server has stopped (logs are most of a run's size)."""
    log = Path(start_dir) / LOG
    if log.exists():
        with open(log, "rb") as src, gzip.open(Path(start_dir) / LOG_GZ, "wb") as dst:
            shutil.copyfileobj(src, dst)
        log.unlink()


def read_log(start_dir: Path) -> str:
    d = Path(start_dir)
    if (d / LOG).exists():
        return (d / LOG).read_text(errors="replace")
    if (d / LOG_GZ).exists():
        with gzip.open(d / LOG_GZ, "rt", errors="replace") as f:
            return f.read()
    return ""


def resume_hint(run: RunFolder) -> str:
    """The command that finishes a stopped run."""
    return f"{sys.executable} -m vllm_study sweep --resume {run.path}"
