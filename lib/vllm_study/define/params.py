"""Study definitions: the study file's models, every key validated before anything
starts (the file is read in study_file.py; a search's keys are search_space.py's; the
strict base and the engine arguments are schema.py's).

Validation is pydantic (extra keys forbidden) plus the vLLM-specific checks below;
errors name the key, what was wrong and how to fix it. Checks that vLLM would only
hit minutes into a start (max_num_seqs above the chunk size, a chunk smaller than
max_model_len with chunked prefill off) are errors here; choices that are legal but
costly (chunk not a multiple of the block size or of 128) are warnings.
"""
from __future__ import annotations

import math
import random
import sys
from pathlib import Path
from typing import Annotated, Literal

from pydantic import AfterValidator, BeforeValidator, Field, field_validator, model_validator

from ..capacity.bracket import halvings
from ..launch.server import engine_init_visible  # the kit's one reading of vLLM's logging variables
from .models import CARDS
from .traces import SHIPPED
from .schema import EngineArgs, Strict, did_you_mean
from ..launch.flags import Flags, option
from .search_space import Search
from . import predict_spec
from . import grid_spec


class ModelSpec(Strict):
    card: str | None = Field("tiny-qwen2", description="architecture card for dummy weights")
    path: str | None = Field(None, description="a model id or folder (overrides card)")
    dummy_weights: bool | None = Field(None, description="random weights from the config alone; "
                                       "default: yes for a card, no for a path")
    served_name: str = "model"

    @model_validator(mode="after")
    def _card_known(self):
        if self.path is None and self.card not in CARDS:
            raise ValueError(f"unknown card {self.card!r}; known: {', '.join(CARDS)} "
                             "(or set model.path to a model id or folder)")
        return self

    @property
    def dummy(self) -> bool:
        return self.path is None if self.dummy_weights is None else self.dummy_weights


class Uniform(Strict):
    uniform: tuple[int, int]

    @model_validator(mode="after")
    def _order(self):
        lo, hi = self.uniform
        if not 1 <= lo <= hi:
            raise ValueError(f"uniform range {list(self.uniform)} needs 1 <= low <= high")
        return self

    def longest(self) -> float:
        return self.uniform[1]

    def sample(self, rng: random.Random) -> int:
        lo, hi = self.uniform
        return rng.randint(lo, hi)


class _LogN(Strict):
    mean: float = Field(gt=0)
    sd: float = Field(ge=0)


class Lognormal(Strict):
    """mean and sd are those of the token count itself, not of its log."""
    lognormal: _LogN

    def longest(self) -> float:
        return self.lognormal.mean + 4 * self.lognormal.sd  # unbounded: 4 sd covers it in practice

    def sample(self, rng: random.Random) -> int:
        m, sd = self.lognormal.mean, self.lognormal.sd
        sigma2 = math.log(1 + (sd / m) ** 2)
        return max(1, round(rng.lognormvariate(math.log(m) - sigma2 / 2, math.sqrt(sigma2))))


# A token count: fixed (128), {uniform: [lo, hi]}, or {lognormal: {mean: 500, sd: 200}}.
# Each distribution knows its own longest value and how to draw one.
Length = Annotated[int, Field(ge=1)] | Uniform | Lognormal


def length_max(spec: Length) -> float:
    """The longest a length can be, for the max_model_len check."""
    return spec if isinstance(spec, int) else spec.longest()


def sample_length(spec: Length, rng: random.Random) -> int:
    """A token count drawn from a params length (a fixed int is itself)."""
    return spec if isinstance(spec, int) else spec.sample(rng)


class Load(Strict):
    """How requests arrive. closed: `workload.concurrency` in flight, the next sent as one
    ends. poisson: arrivals at `rate` req/s, gamma-distributed gaps (`burstiness` 1 is
    Poisson, below 1 burstier, as in vllm bench serve). ladder: poisson steps at each of
    `rates`, the round's requests split evenly; statistics per step."""
    kind: Literal["closed", "poisson", "ladder"] = "closed"
    rate: float | None = Field(None, gt=0)
    rates: list[Annotated[float, Field(gt=0)]] = []
    burstiness: float = Field(1.0, gt=0)
    max_concurrency: int | None = Field(None, ge=1)  # open loop: cap on requests in flight

    @model_validator(mode="after")
    def _needs(self):
        if self.kind == "poisson" and self.rate is None:
            raise ValueError("load.kind poisson needs load.rate (requests per second)")
        if self.kind == "ladder" and len(self.rates) < 2:
            raise ValueError("load.kind ladder needs load.rates with two or more rates, e.g. [10, 20, 30]")
        return self


TRACE_FORMATS = ("mooncake", "azure", "burstgpt", "jsonl")


class TraceSpec(Strict):
    """A replayed trace: which file, which window of it, how fast. `file` is a path or
    the name of a window the kit ships (traces.SHIPPED: mooncake_conversation,
    mooncake_synthetic, azure_conv, azure_code). The window is `requests` requests from
    `start_s` on, or all requests within `duration_s` of `start_s`. `speed` scales time:
    2 sends the window in half its real time (twice the rate). `windows: K` cuts K
    windows of that length from across the whole trace instead (workload/windows.py):
    measured round r replays window r % K."""
    file: str
    format: Literal[TRACE_FORMATS] | None = Field(None, description="mooncake | azure | burstgpt | jsonl; "
                                                  "may be left out for a shipped window")
    start_s: float = Field(0.0, ge=0)
    requests: int | None = Field(None, ge=1)
    duration_s: float | None = Field(None, gt=0)
    speed: float = Field(1.0, gt=0)
    block_tokens: int | None = Field(None, ge=1, description="tokens per prefix block id (jsonl `prefix`); "
                                     "Mooncake's are 512")
    max_output_tokens: int | None = Field(None, ge=1, description="caps each request's output at this many "
                                          "tokens (the trace's own where shorter): long outputs take minutes on a CPU")
    prime: Literal["none", "history"] | None = Field(
        None, description="history: before each measured round, send the traffic that preceded the window (as "
        "much as the server's prefix cache holds) unmeasured, prefill-only; none: a cold cache. Left out: "
        "history for a Mooncake trace replayed from past its first request (trace.windows, or start_s > 0), "
        "none otherwise (a head window has no history; Azure and BurstGPT rows have no prefix ids)")
    windows: int | None = Field(None, ge=1, description="K windows from across the whole trace (a shipped "
                                "name's full original, or the whole file), one per equal time stratum at a "
                                "position seeded by workload.seed, each `requests` or `duration_s` long; "
                                "measured round r replays window r % K. Absent: the one window from start_s")

    @model_validator(mode="after")
    def _window(self):
        if self.requests is not None and self.duration_s is not None:
            raise ValueError("trace: give the window as `requests` or as `duration_s`, not both")
        if self.windows is not None:
            if self.start_s > 0:
                raise ValueError(f"trace.windows cuts its windows from across the whole trace, so trace.start_s "
                                 f"({self.start_s:g}) has no meaning beside it: remove trace.start_s, or remove "
                                 "trace.windows to replay the one window from start_s")
            if self.requests is None and self.duration_s is None:
                raise ValueError("trace.windows needs each window's length: set trace.requests or "
                                 "trace.duration_s")
        if self.format is None:
            if self.file not in SHIPPED:
                raise ValueError(f"trace.format is needed for {self.file!r} (not a shipped window: "
                                 f"{', '.join(SHIPPED)}); one of {', '.join(TRACE_FORMATS)}")
            self.format = SHIPPED[self.file].format
        if self.prime is None:  # production traffic meets a warm cache: prime wherever there is history to send
            self.prime = "history" if self.format == "mooncake" and (self.windows or self.start_s > 0) else "none"
        if self.file not in SHIPPED:
            # the point notebook runs in another folder: a path relative to where the study was
            # loaded must still name the same file there
            self.file = str(Path(self.file).expanduser().resolve())
        return self


class Workload(Strict):
    # eviction: mixed traffic named for the Prefix Reuse Budget: shared-prefix chats (class
    # shared) among long distinct prompts (class cold, long_fraction of them) that evict them
    # trace: a replayed request trace (`trace`): its lengths, prefix blocks and arrival times
    kind: Literal["shared_prefix", "multi_turn", "mixed", "eviction", "random", "trace"] = "shared_prefix"
    trace: TraceSpec | None = None
    api: Literal["chat", "completions"] = "chat"
    system_prompt_tokens: int = Field(1600, ge=0)   # shared_prefix, mixed, multi_turn
    prefixes: int = Field(1, ge=1)                  # distinct shared prompts, round-robin
    question_tokens: Length = 32                    # per request; per turn in multi_turn
    output_tokens: Length = 64
    input_tokens: Length = 512                      # random: the whole prompt
    turns: int = Field(5, ge=1)                     # multi_turn
    think_time_s: float = Field(0.0, ge=0)          # multi_turn: pause before the next turn
    long_fraction: float = Field(0.1, ge=0, le=1)   # mixed: share of long documents
    long_prompt_tokens: Length = Uniform(uniform=(6000, 8000))  # mixed
    concurrency: int = Field(32, ge=1)              # closed loop (conversations for multi_turn)
    requests_per_round: int = Field(64, ge=1)
    warmup_requests: int = Field(4, ge=0)
    seed: int = 0
    request_timeout_s: float = Field(600, gt=0)
    load: Load = Load()

    @model_validator(mode="after")
    def _consistent(self):
        if self.kind == "multi_turn":
            if self.api != "chat":
                raise ValueError("multi_turn needs api: chat (the history is a list of messages)")
            if self.requests_per_round % self.turns:
                raise ValueError(f"multi_turn: requests_per_round ({self.requests_per_round}) must be a "
                                 f"multiple of turns ({self.turns}): each conversation sends every turn")
            if self.load.kind != "closed":
                raise ValueError("multi_turn runs closed loop: `concurrency` conversations at a time")
        if (self.kind == "trace") != (self.trace is not None):
            raise ValueError("workload.kind trace needs workload.trace (file, window, speed), and "
                             "workload.trace needs kind: trace")
        # (against the default, not model_fields_set: a run's manifest stores every key, defaults included)
        if self.kind == "trace" and self.output_tokens != type(self).model_fields["output_tokens"].default:
            raise ValueError("workload.output_tokens is not used by a trace (its outputs are the trace's own "
                             "lengths): remove it; to cap them, set workload.trace.max_output_tokens")
        if self.kind == "trace" and self.load.kind != "closed":
            raise ValueError("a trace brings its own arrival times: leave workload.load out (its speed is "
                             "trace.speed; load.max_concurrency is not used either)")
        if self.load.kind == "ladder" and self.requests_per_round < len(self.load.rates):
            raise ValueError("load ladder: requests_per_round must be at least one per rate")
        return self

    def longest_request(self) -> float:
        """Prompt + output tokens of the longest request this workload can send (the
        chat template's few tokens aside)."""
        out = length_max(self.output_tokens)
        if self.kind == "random":
            return length_max(self.input_tokens) + out
        short = self.system_prompt_tokens + length_max(self.question_tokens) + out
        if self.kind in ("mixed", "eviction"):
            return max(short, length_max(self.long_prompt_tokens) + out)
        if self.kind == "multi_turn":
            return self.system_prompt_tokens + self.turns * (length_max(self.question_tokens) + out)
        return short


# Flags the kit sets itself for every server it launches: a copy in extra_cli_args
# would silently win over the kit's (argparse keeps the last), so it is refused.
KIT_FLAGS = {"--port": "the kit picks a free port per server", "--host": "servers listen on 127.0.0.1",
             "--model": "set model.card or model.path", "--served-model-name": "set model.served_name",
             "--load-format": "set model.dummy_weights"}


# What keeps live knobs off by default on the GPU engine: the rule of
# benchmarks/live_knobs_equivalence.py (every metric within +-3%, or unresolved inside +-5%)
# failed there, on this metric.
LIVE_GPU_EVIDENCE = (": on one H200, TTFT P50 at chunk 2048 lowered from 8192 read 3.9% [1.8%, 6.0%] below fresh "
                     "starts at 2048, outside +-3% (results/live-knobs-equivalence/20261203-h200); on one H100, "
                     "with both on the kit's scheduler, 22 pairs leave it undecided: TTFT P50 -3.8% [-10.1%, "
                     "+3.0%], TTFT P90 -1.7% [-5.9%, +2.6%] "
                     "(results/live-knobs-equivalence/20261207-h100-live-knobs-verdict); "
                     "server.live_knobs: true turns them on")


class Server(Strict):
    engine: Literal["auto", "cpu", "gpu"] = "auto"  # auto: gpu when NVML sees one
    startup_timeout_s: float = Field(900, gt=0)  # not counting a start ahead's hold
    # Spawn a slot's next server while the previous one still measures and hold it,
    # frozen, at its engine's init until that one has stopped: its processes' start-up
    # and imports leave the slot's critical path (~45% of a 7B start's turn on an H200),
    # but run beside the previous server's first round. null (the default): on for the GPU
    # engine, where a neighbour importing beside a measured server changed no figure by a
    # resolved amount (docs/scale-out.md, "Start-ahead"); off on the CPU engine, where those
    # imports take the cores the measured server runs on.
    start_ahead: bool | None = None
    # One start serves every point of a group that differs only in the scheduler limits
    # vLLM reads at each step (max_num_batched_tokens, max_num_seqs,
    # long_prefill_token_threshold): launched at the group's largest values, lowered
    # between rounds through the kit's scheduler plugin (docs/live-knobs.md). null (the
    # default): on for the CPU engine; off for the GPU engine until the equivalence
    # benchmark on one H200 shows a lowered start measures as a fresh one does.
    live_knobs: bool | None = None
    # Each engine step recorded through the kit's scheduler plugin, kept per round in
    # steps/r<round>.npz (docs/measurement.md, "Step records"); false: vLLM's scheduler.
    step_records: bool = True
    env: dict[str, str] = {}
    extra_cli_args: list[str] = []  # any other vLLM flag, passed as is
    # The program a start runs in place of vLLM's serve entrypoint, as its argv words;
    # vLLM's command line follows them (--model M --host --port --served-model-name, the
    # engine flags). For the tests' fake engine: [python, tests/fake_engine.py]. `python`
    # is the interpreter running the kit; a word naming a relative path is resolved
    # against the working directory the study is loaded in (as trace.file: the point
    # notebook runs elsewhere). null (the default): vLLM. The start record
    # (launch.program) and the report's header say when a run served with another program.
    command: list[str] | None = None

    def program(self) -> tuple[str, ...] | None:
        """server.command as a start runs it (`python`: this interpreter); None: vLLM's own."""
        if self.command is None:
            return None
        head, *rest = self.command
        return (sys.executable if head == "python" else head, *rest)

    @field_validator("command")
    @classmethod
    def _command_words(cls, words: list[str] | None) -> list[str] | None:
        if words is None:
            return None
        example = "e.g. [python, tests/fake_engine.py]; remove the key to serve with vLLM"
        if not words or any(not w.strip() for w in words):
            raise ValueError(f"a program and its arguments, no empty word ({example})")
        if words[0].startswith("-"):
            raise ValueError(f"it starts with the flag {words[0]!r}: its first word is the program "
                             f"to run ({example}); vLLM's flags go in extra_cli_args")
        out = []
        for w in words:
            if "/" in w and not w.startswith("-") and "://" not in w and not Path(w).expanduser().is_absolute():
                path = Path(w).expanduser().resolve()
                if not path.exists():
                    raise ValueError(f"{w!r} names no file here (a relative path is resolved "
                                     f"against the working directory, {Path.cwd()}): give its absolute path, "
                                     "or run from the folder it is relative to")
                w = str(path)
            out.append(w)
        return out

    def live_on(self, engine: str) -> bool:
        """Whether points that differ only in live scheduler limits share a start on `engine`."""
        return engine == "cpu" if self.live_knobs is None else self.live_knobs

    def live_off_why(self, engine: str) -> str | None:
        """Why points that differ only in live limits do not share a start on `engine`
        (None: they may), with the evidence where it is the default."""
        if self.live_on(engine):
            return None
        if self.live_knobs is False:
            return "server.live_knobs: false"
        return f"off by default on the {engine} engine" + (LIVE_GPU_EVIDENCE if engine == "gpu" else "")

    def ahead_on(self, engine: str) -> bool:
        """Whether a slot's next start is spawned ahead on `engine` ("cpu" or "gpu")."""
        return engine == "gpu" if self.start_ahead is None else self.start_ahead

    @model_validator(mode="after")
    def _start_ahead_needs_info_lines(self):
        why = engine_init_visible(self.env) if self.start_ahead else None  # asked for: refused; by default: said
        if why:
            raise ValueError(f"server.start_ahead holds a server at its engine's INFO line, but server.env: {why}; "
                             "drop that variable or set start_ahead: false")
        return self

    @model_validator(mode="after")
    def _no_kit_flags(self):
        for f in Flags.parse(self.extra_cli_args):
            # vLLM's parser takes --served_model_name and unique abbreviations too
            given, flag = f.written, option(f.name)
            owned = next((k for k in KIT_FLAGS if len(flag) > 3 and k.startswith(flag)), None)
            if owned:
                alias = f" (as {owned})" if given != owned else ""
                raise ValueError(f"server.extra_cli_args: {given} is set by the kit{alias} ({KIT_FLAGS[owned]}); "
                                 "remove it from extra_cli_args")
        return self


def normalize_base_url(url: str) -> str:
    """'http://h:8000', 'http://h:8000/', 'http://h:8000/v1/' -> 'http://h:8000'
    (the client adds /v1/... itself)."""
    u = url.strip().rstrip("/")
    if u.endswith("/v1"):
        u = u[:-3]
    if not u.startswith(("http://", "https://")):
        raise ValueError(f"base_url {url!r} must start with http:// or https://")
    return u


class Target(Strict):
    """An OpenAI-compatible endpoint the kit measures but does not launch."""
    name: str = Field(pattern=r"^[A-Za-z0-9._-]+$")
    base_url: str
    model: str
    api_key_env: str | None = Field(None, description="name of the environment variable "
                                    "holding the API key (the key itself is never written)")
    proxy: str | None = Field(None, description="an HTTP proxy to reach this target through; "
                              "proxy variables in the environment are never used")

    @model_validator(mode="after")
    def _normalize(self):
        self.base_url = normalize_base_url(self.base_url)
        return self


SLO_STATS = ("mean", "p50", "p90", "p99")


def check_slo(bounds: dict[str, float]) -> dict[str, float]:
    """An SLO is a bound per latency metric at a statistic: ttft_p99_ms: 500 means the
    point's TTFT P99 must stay at or under 500 ms, and a request meets it when its own
    TTFT does (its own P99 gap, for ITL; its own longest gap, for stall_p90_ms)."""
    from ..vocab.metrics import slo_bound_names  # metrics imports pandas; the CLI reads a study before it needs it
    allowed = slo_bound_names(SLO_STATS)
    for key in bounds:
        if key not in allowed:
            raise ValueError(f"slo.{key}: not a latency bound the kit knows{did_you_mean(key, allowed)}; use <ttft|"
                             f"itl|tpot|e2e>_<{'|'.join(SLO_STATS)}>_ms, e.g. ttft_p99_ms: 500, or stall_p90_ms")
    return bounds


def _drop_unset(bounds):
    """Unset bounds (None) are no bounds: the kit's first layout wrote {ttft_ms: null, ...}."""
    return {k: v for k, v in bounds.items() if v is not None} if isinstance(bounds, dict) else bounds


SLO = Annotated[dict[str, Annotated[float, Field(gt=0)]], BeforeValidator(_drop_unset), AfterValidator(check_slo)]


class Scheduler(Strict):
    """The Prefix Reuse Budget scheduler (vllm_study.scheduler_plugin, loaded through vLLM's
    --scheduler-cls): a waiting request whose cached share of the prompt is below
    `min_reuse_ratio` waits, up to `max_defer_ms`, while requests that reuse the cache go
    first. A list of ratios is a grid axis ("off" = vLLM's own scheduler)."""
    min_reuse_ratio: list[Annotated[float, Field(ge=0, le=1)] | Literal["off"]] | \
        Annotated[float, Field(ge=0, le=1)] | Literal["off"] = "off"
    max_defer_ms: float = Field(500, ge=0)

    @property
    def ratios(self) -> list:
        r = self.min_reuse_ratio
        return list(r) if isinstance(r, list) else [r]


class Precision(Strict):
    """Keep adding server starts (one more block of the points that need it) until
    `metric`'s 95% interval is at most `relative_width` wide at every point (high/low
    ratio - 1, e.g. 0.2 = the high end within 20% of the low end), or `max_starts` is
    reached."""
    metric: str = "ttft_p90_ms"
    relative_width: float = Field(0.2, gt=0)
    max_starts: int = Field(4, ge=2)

    @model_validator(mode="after")
    def _known(self):
        from ..vocab.metrics import REGISTRY  # metrics imports pandas; the CLI reads a study before it needs it
        if self.metric not in REGISTRY:
            raise ValueError(f"precision.metric {self.metric!r} is not a metric the kit reports"
                             f"{did_you_mean(self.metric, REGISTRY)}")
        return self


class Confirm(Strict):
    """After the planned starts (a grid's replicates, a search's confirmation), start the
    best config, the runner-up and the baseline (the study's `baseline`; vLLM's defaults
    in a search) again, one fresh start each per shuffled block, until the best's gain
    over the baseline and over the runner-up are both resolved (the ratio's 95% interval,
    or its bound, excludes 1: capacity.estimate.gain) or each of the three has
    `max_starts` starts (sweep.confirm_until_resolved; records/confirmation.py). A grid
    study runs it; after a search's confirmation it is shown by --dry-run, not run yet.
    `half_width` (e.g. 0.10): once both are resolved, the best alone is started again until
    its capacity's 95% interval reaches no further than that fraction of its value on
    either side (within the same max_starts)."""
    until: Literal["resolved"] = "resolved"
    max_starts: int = Field(ge=2)
    half_width: float | None = Field(None, gt=0, lt=1)


class Capacity(Strict):
    """How much load each server start sustains within the SLO: a probe at `hi`, then a
    bisection (geometric: loads scale multiplicatively) until the bracket is at most
    `precision` wide (hi/lo - 1) or `max_steps` rounds have run; `lo` is measured only
    if every step above it missed (capacity/bracket.py). Where lo misses, the search
    halves the load down to `floor` (default lo / 8) before calling the start "below
    floor", and bisects between the first pass and the miss above it. Each step is
    one measured round on a fresh prefix cache; the capacity is the highest load whose
    round met every SLO bound with no failed request. `over`: speed (a trace's time
    scale), rate (Poisson req/s; for a trace, its speed is set to give that rate) or
    concurrency (closed loop, requests in flight)."""
    slo: SLO = {}   # the bounds a step must meet; empty: the study's `slo`
    over: Literal["speed", "rate", "concurrency"]
    lo: float = Field(gt=0)
    hi: float = Field(gt=0)
    precision: float = Field(0.05, gt=0)
    max_steps: int = Field(8, ge=2)
    floor: float | None = None   # the lowest load the search goes to where lo misses; None: lo / 8
    # where the search begins: hi (a pass ends it at once; low loads are the slow steps) or
    # lo (a miss ends it at once: for configs that may miss at every load)
    probe: Literal["hi", "lo"] = "hi"

    @model_validator(mode="after")
    def _bracket(self):
        if self.lo >= self.hi:
            raise ValueError(f"capacity: lo ({self.lo:g}) must be below hi ({self.hi:g})")
        if self.over == "concurrency" and not (float(self.lo).is_integer() and float(self.hi).is_integer()):
            raise ValueError("capacity over concurrency: lo and hi are requests in flight, whole numbers")
        if self.floor is None:  # concurrency: a whole number of requests, at least one
            self.floor = max(1.0, float(self.lo // 8)) if self.over == "concurrency" else self.lo / 8
        if not 0 < self.floor <= self.lo:
            raise ValueError(f"capacity: floor ({self.floor:g}) must be above 0 and at most lo ({self.lo:g}): "
                             "it is the lowest load the search halves down to where lo misses; "
                             "leave it out for lo / 8")
        if self.over == "concurrency" and not float(self.floor).is_integer():
            raise ValueError(f"capacity over concurrency: floor ({self.floor:g}) is requests in flight, "
                             "a whole number")
        return self


def live_knobs_unsupported(study) -> str | None:
    """Why a study's points cannot share server starts through live scheduler limits, or None."""
    if study.targets:
        return "a targets study measures servers the kit does not launch"
    if "scheduler-cls" in Flags.parse(study.server.extra_cli_args):
        return ("server.extra_cli_args sets --scheduler-cls: the limits change through the kit's own "
                "scheduler plugin, which that class replaces")
    return None


class Study(Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9._-]+$")
    description: str = ""
    model: ModelSpec = ModelSpec()
    engine_args: EngineArgs = EngineArgs()
    # axes crossed, or a list of points (grid_spec.py); a file that extends a grid study may
    # drop its grid with `grid: null` (e.g. to search instead)
    grid: Annotated[grid_spec.Grid, BeforeValidator(lambda v: {} if v is None else v)] = {}
    targets: list[Target] = []  # instead of a grid: measure running endpoints
    search: Search | None = None  # instead of a grid: search a space (config_search.py)
    workload: Workload = Workload()
    rounds: int = Field(3, ge=1)                # measured rounds per server start
    replicates: int = Field(1, ge=1)            # server starts per point, in randomized blocks
    precision: Precision | None = None          # optional: more starts until an interval is narrow enough
    scheduler: Scheduler = Scheduler()          # the Prefix Reuse Budget plugin; off by default
    order_seed: int = 0                         # seeds the shuffle of each block's run order
    server: Server = Server()
    slo: SLO = {}   # e.g. {ttft_p99_ms: 500, itl_p99_ms: 50}: goodput, attainment, the recommendation
    capacity: Capacity | None = None            # optional: search each start's capacity under the SLO
    gpu_hour_price: float | None = Field(None, gt=0, description="what one GPU-hour costs (any currency): "
                                         "the report gives each config's cost per million output tokens at capacity")
    baseline: str | None = Field(None, description="a point id (as --dry-run lists them) every point is "
                                 "compared with, e.g. vLLM's defaults")
    confirm: Confirm | None = None   # a capacity study: more starts of the best, runner-up and baseline
    predict: predict_spec.Predict | None = None   # predict every point from a few measured, then confirm the best

    @model_validator(mode="after")
    def _grid_axes(self):
        given = [k for k in ("grid", "targets", "search") if getattr(self, k)]
        if len(given) != 1:
            raise ValueError("give one of `grid` (the kit launches vLLM per point), `search` (the kit searches "
                             "a space of engine arguments) or `targets` (endpoints that already run); "
                             + (f"this study gives {' and '.join(given)}" if given else "this study gives none")
                             + (" (a study that extends a grid study drops its grid with `grid: null`)"
                                if "grid" in given and "search" in given else ""))
        if self.search:
            self._check_search()
        ratios = self.scheduler.ratios
        if len(set(map(repr, ratios))) != len(ratios):
            raise ValueError(f"scheduler.min_reuse_ratio repeats a value: {ratios}")
        if ratios != ["off"] and self.targets:
            raise ValueError("scheduler: the kit sets the scheduler of the servers it launches; a targets "
                             "study measures servers it does not launch")
        if ratios != ["off"] and self.engine_args.enable_prefix_caching is False:
            raise ValueError("scheduler.min_reuse_ratio needs prefix caching (the rule reads the cached share "
                             "of each prompt): remove enable_prefix_caching: false")
        if self.capacity:
            self._check_capacity()
        if self.confirm:
            self._check_confirm()
        if self.predict:
            predict_spec.check(self)
        if self.server.live_knobs:
            self._check_live_knobs()
        names = [t.name for t in self.targets]
        if len(set(names)) != len(names):
            raise ValueError(f"target names repeat: {names}")
        grid_spec.check(self.grid, self.engine_args)
        return self

    def _check_search(self) -> None:
        """What a search needs of the rest of the study."""
        s = self.search
        for name in s.space:
            if getattr(self.engine_args, name) is not None:
                raise ValueError(f"{name} is both in search.space and fixed in engine_args; remove one of them")
        if self.replicates != 1 or self.precision or self.baseline:
            raise ValueError("a search starts each trial once and replicates its top_k and vLLM's defaults "
                             "(search.confirm_starts); leave out replicates, precision and baseline")
        if len(self.scheduler.ratios) > 1:
            raise ValueError("a search does not sweep scheduler.min_reuse_ratio; give one value")
        if s.objective is None:
            if not self.capacity:
                raise ValueError("search.objective is needed outside a capacity study: a metric, e.g. goodput "
                                 "(with an slo) or output_throughput")
            s.objective = "capacity_rps"
        elif self.capacity and s.objective not in ("capacity_rps", "capacity_load"):
            raise ValueError(f"a capacity study's search optimises its capacity: leave search.objective out "
                             f"(it is capacity_rps), not {s.objective}")

    def _check_confirm(self) -> None:
        """What confirmation until resolved needs: capacities to resolve, a baseline to
        resolve them against, and more starts than the study plans already."""
        if not self.capacity:
            raise ValueError("confirm: resolves the best config's capacity against the baseline's: it needs "
                             "`capacity:` (a capacity study)")
        if self.grid and not self.baseline:
            raise ValueError("confirm: resolves the best against a baseline: name one with `baseline:` (a point "
                             "id as --dry-run lists them, e.g. vLLM's defaults)")
        planned = self.search.confirm_starts if self.search else self.replicates
        if self.confirm.max_starts <= planned:
            where = "search.confirm_starts" if self.search else "replicates"
            raise ValueError(f"confirm.max_starts ({self.confirm.max_starts}) must exceed the starts each point "
                             f"has already ({where}: {planned}); raise it, or leave confirm out")

    @property
    def confirm_plan(self) -> str | None:
        """--dry-run's line for `confirm:`."""
        if not self.confirm:
            return None
        planned = self.search.confirm_starts if self.search else self.replicates
        base = "vLLM's defaults" if self.search else self.baseline
        more = 3 * (self.confirm.max_starts - planned)
        return (f"confirm until resolved: then the best, the runner-up and {base} again, one fresh start each "
                f"per shuffled block, until the best's gain over {base} and over the runner-up are resolved "
                f"(95% interval excludes 1)"
                + (f" and the best's interval is within +-{self.confirm.half_width:.0%} of its value,"
                   if self.confirm.half_width else "")
                + f" or each has {self.confirm.max_starts} starts: at most {more} more "
                "starts (not in the estimate)" + (". Planned only: a search's sweep does not run it yet"
                                                   if self.search else ""))
    def _check_live_knobs(self) -> None:
        """server.live_knobs: true where the kit cannot keep it (null falls back to restarts there)."""
        why = live_knobs_unsupported(self)
        if why:
            raise ValueError(f"server.live_knobs: {why}; set server.live_knobs: false (or leave it out: "
                             "the kit then restarts the server for every point)")

    def _check_capacity(self) -> None:
        """What a capacity search needs of the study: an SLO, and a load it can turn."""
        c, w = self.capacity, self.workload
        if not c.slo and not self.slo:
            raise ValueError("capacity needs an SLO to search under: set capacity.slo (or the study's slo), "
                             "e.g. {ttft_p90_ms: 2000, itl_p99_ms: 150}")
        if not c.slo:
            c.slo = dict(self.slo)
        if c.over == "speed" and w.kind != "trace":
            raise ValueError("capacity over speed scales a trace's time: it needs workload.kind trace "
                             "(or search over rate with load.kind poisson, or over concurrency)")
        if c.over == "rate" and w.kind != "trace" and w.load.kind != "poisson":
            raise ValueError("capacity over rate sets a Poisson rate: it needs workload.load.kind poisson "
                             "(or a trace workload)")
        if c.over == "concurrency" and (w.kind in ("trace", "multi_turn") or w.load.kind != "closed"):
            raise ValueError("capacity over concurrency needs a closed-loop workload (load.kind closed, "
                             "not a trace or multi_turn)")

    @property
    def steps_per_start(self) -> int:
        """Measured rounds a start runs at most: the rounds, or the capacity search's steps
        (with trace.windows, K rounds a step: every window at the step's load). A start
        that serves several points (live knobs) runs this many for each of them."""
        if not self.capacity:
            return self.rounds
        c = self.capacity
        windows = (self.workload.trace.windows or 1) if self.workload.kind == "trace" else 1
        return (c.max_steps + halvings(c.lo, c.floor, c.over == "concurrency")) * windows
