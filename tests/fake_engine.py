"""A fake vLLM OpenAI server for testing the kit's control flow: it starts in about a
second and behaves like vLLM where the kit looks, without a model.

    python tests/fake_engine.py --model M --port N --served-model-name S [vLLM flags...]

What it models, as vLLM 0.32's v1 engine does it:
- a step loop in an engine thread: each step schedules the running requests first (a
  decode token each, or their next prefill chunk), then admits waiting ones FCFS while
  the token budget (--max-num-batched-tokens, chunked prefill, the long-prefill cap)
  and --max-num-seqs allow; a step takes FAKE_ENGINE_STEP_S + FAKE_ENGINE_TOKEN_S per
  scheduled token, so a load has a real knee;
- a KV block pool (--num-gpu-blocks-override, else --kv-cache-memory-bytes over the
  model's config.json, else FAKE_ENGINE_KV_TOKENS) with vLLM's prefix cache: chained
  hashes of full prompt blocks, hits capped one token short of the prompt, freed blocks
  evicted least recently used (a request's tail first); a request that finds no block
  preempts the last running one (recomputed later, as vLLM does);
- prompt tokens counted with the model folder's own tokenizer.json and chat template
  (what the kit sizes prompts with), else one token per UTF-8 byte; every request
  generates max_tokens tokens (ignore_eos as the kit sends it; the text is " the");
- /v1/completions and /v1/chat/completions (SSE with include_usage, or one JSON body),
  /v1/models, /health, /reset_prefix_cache (with VLLM_SERVER_DEV_MODE=1, as vLLM),
  /metrics with vLLM's metric names, labels and histogram buckets (vLLM's own
  buckets.py, loaded by path: importing vLLM takes ~15-30 s);
- the log lines the kit waits for or reads (non-default args, the engine-init line,
  the KV cache size, the serving line), hidden as vLLM hides them
  (VLLM_CONFIGURE_LOGGING=0, VLLM_LOGGING_LEVEL);
- live limits: with --scheduler-cls ...LiveLimitsScheduler the scheduler runs the kit's
  own vllm_study.scheduler_plugin.live_limits.LiveLimitsMixin, so the control file and its answer
  in the counters file are the plugin's code, not a copy.
vLLM flags it does not model are accepted and ignored (they appear in the non-default
args line). What it does not model: sampling, EOS, output-token blocks in the prefix
cache, the Prefix Reuse Budget rule (that scheduler is refused at start).
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import importlib.util
import json
import logging
import math
import os
import queue
import sys
import threading
import time
import uuid
from pathlib import Path
from types import SimpleNamespace

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "lib"))  # the kit's live-limits plugin
from vllm_study.scheduler_plugin.live_limits import LiveLimitsMixin  # noqa: E402

VERSION = "0.32.0"  # the vLLM release whose behaviour this follows
LIVE_SCHEDULERS = ("vllm_study.scheduler_plugin.LiveLimitsScheduler",
                   "vllm_study.scheduler_plugin.scheduler.LiveLimitsScheduler")
STEP_S = float(os.environ.get("FAKE_ENGINE_STEP_S", "0.004"))     # a step's fixed cost
TOKEN_S = float(os.environ.get("FAKE_ENGINE_TOKEN_S", "0.00002"))  # and per scheduled token
INIT_S = float(os.environ.get("FAKE_ENGINE_INIT_S", "0.3"))  # engine-init line to healthy, at least
# a file: the engine's init lasts until it exists (a test's gate: a stop lands while the
# server starts, and a later start of the same study starts at once)
INIT_UNTIL = os.environ.get("FAKE_ENGINE_INIT_UNTIL")
KV_TOKENS = int(os.environ.get("FAKE_ENGINE_KV_TOKENS", "65536"))  # no KV size given
OUTPUT_TEXT = " the"


# -- flags --------------------------------------------------------------------------------
def _flag_argv(argv: list[str]) -> list[str]:
    """vLLM takes --a_b for --a-b."""
    out = []
    for a in argv:
        if a.startswith("--"):
            name, eq, val = a[2:].partition("=")
            a = "--" + name.replace("_", "-") + eq + val
        out.append(a)
    return out


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, dict]:
    """The flags it models, and vLLM's non-default-args dict of every flag given."""
    p = argparse.ArgumentParser(prog="fake_engine", allow_abbrev=False)
    p.add_argument("--model", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", nargs="+")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)  # vLLM CPU's defaults
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--max-model-len", type=int)
    p.add_argument("--block-size", type=int, default=128)  # vLLM CPU's default
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--long-prefill-token-threshold", type=int, default=0)
    p.add_argument("--num-gpu-blocks-override", type=int)
    p.add_argument("--kv-cache-memory-bytes", type=int)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--custom-histogram-buckets", type=json.loads)
    p.add_argument("--scheduler-cls")
    p.add_argument("--additional-config", type=json.loads, default={})
    args, _ignored = p.parse_known_args(_flag_argv(argv))
    return args, _given(_flag_argv(argv), args)


def _given(argv: list[str], args: argparse.Namespace) -> dict:
    given, i = {}, 0
    while i < len(argv):
        a = argv[i]
        i += 1
        if not a.startswith("--"):
            continue
        name, eq, val = a[2:].partition("=")
        if not eq and i < len(argv) and not argv[i].startswith("--"):
            val, eq = argv[i], "="
            i += 1
        key = name.replace("-", "_")
        given[key] = getattr(args, key) if hasattr(args, key) else (val if eq else True)
    for neg in [k for k in given if k.startswith("no_")]:
        given[neg[3:]] = False
        del given[neg]
    return given


# -- vLLM's own pieces, without importing vLLM ---------------------------------------------
def vllm_buckets():
    """vLLM's histogram_buckets (vllm/v1/metrics/buckets.py imports only the standard library)."""
    spec = importlib.util.find_spec("vllm")  # locates the package without running it
    path = Path(spec.submodule_search_locations[0]) / "v1" / "metrics" / "buckets.py"
    mod_spec = importlib.util.spec_from_file_location("_vllm_buckets", path)
    mod = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(mod)
    return mod.histogram_buckets


def kv_bytes_per_token(model: str, dtype: str) -> int | None:
    """K and V of every layer for one token, from the model folder's config.json."""
    try:
        c = json.loads((Path(model) / "config.json").read_text())
        heads = c["num_attention_heads"]
    except (OSError, ValueError, KeyError):
        return None
    size = 4 if dtype in ("float32", "float") else 2
    head_dim = c.get("head_dim", c["hidden_size"] // heads)
    return 2 * c["num_hidden_layers"] * c.get("num_key_value_heads", heads) * head_dim * size


def max_positions(model: str) -> int:
    try:
        return int(json.loads((Path(model) / "config.json").read_text())["max_position_embeddings"])
    except (OSError, ValueError, KeyError):
        return 4096


class Tokens:
    """Prompt token ids as vLLM's server makes them: completions encoded with special
    tokens, chat messages rendered with the model's template and encoded without."""

    def __init__(self, model: str):
        folder = Path(model)
        self.tok, self.template = None, None
        if (folder / "tokenizer.json").is_file():
            from tokenizers import Tokenizer
            self.tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
        source = None
        if (folder / "chat_template.jinja").is_file():
            source = (folder / "chat_template.jinja").read_text()
        elif (folder / "tokenizer_config.json").is_file():
            source = json.loads((folder / "tokenizer_config.json").read_text()).get("chat_template")
        if source:
            from jinja2.sandbox import ImmutableSandboxedEnvironment
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)  # as transformers
            self.template = env.from_string(source)

    def encode(self, text: str, special: bool) -> list[int]:
        if self.tok is None:  # no tokenizer: one token a byte
            return list(text.encode())
        return self.tok.encode(text, add_special_tokens=special).ids

    def prompt(self, body: dict, chat: bool) -> list[int]:
        if chat:
            messages = body["messages"]
            if self.template is None:
                text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
            else:
                text = self.template.render(messages=messages, add_generation_prompt=True)
            return self.encode(text, special=False)
        prompt = body["prompt"]
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            prompt = prompt[0]  # one prompt of a batch: the kit sends one
        if isinstance(prompt, list):
            return [int(t) for t in prompt]
        return self.encode(prompt, special=True)


# -- the KV block pool and prefix cache ----------------------------------------------------
def block_hashes(ids: list[int], block_size: int) -> list[int]:
    """Chained hashes of the full blocks (each block's hash covers the prefix before it)."""
    out, parent = [], None
    for i in range(len(ids) // block_size):
        parent = hash((parent, tuple(ids[i * block_size:(i + 1) * block_size])))
        out.append(parent)
    return out


class BlockPool:
    """vLLM's block pool in small: a free queue in eviction order (least recently used
    first), reference counts, and the hash -> block map of the prefix cache."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.free = collections.OrderedDict((b, None) for b in range(num_blocks))
        self.ref = [0] * num_blocks
        self.hash_of: dict[int, int] = {}
        self.cached: dict[int, int] = {}

    def hits(self, hashes: list[int]) -> list[int]:
        out = []
        for h in hashes:
            b = self.cached.get(h)
            if b is None:
                break
            out.append(b)
        return out

    def take(self, blocks: list[int]) -> None:
        for b in blocks:
            if self.ref[b] == 0:
                self.free.pop(b, None)
            self.ref[b] += 1

    def allocate(self, n: int) -> list[int] | None:
        if n > len(self.free):
            return None
        out = []
        for _ in range(n):
            b, _ = self.free.popitem(last=False)
            h = self.hash_of.pop(b, None)
            if h is not None:
                del self.cached[h]  # evicted
            self.ref[b] = 1
            out.append(b)
        return out

    def release(self, blocks: list[int]) -> None:
        for b in reversed(blocks):  # a request's tail blocks go first when evicting
            self.ref[b] -= 1
            if self.ref[b] == 0:
                self.free[b] = None

    def cache(self, block: int, h: int) -> None:
        if h not in self.cached and block not in self.hash_of:
            self.cached[h], self.hash_of[block] = block, h

    def reset(self) -> bool:
        """vLLM resets only when no block is in use."""
        if len(self.free) != self.num_blocks:
            return False
        self.cached.clear()
        self.hash_of.clear()
        return True

    @property
    def usage(self) -> float:
        return 1.0 - len(self.free) / self.num_blocks


# -- requests and the scheduler ----------------------------------------------------------
class Req:
    def __init__(self, prompt: list[int], max_tokens: int, block_size: int, deliver):
        self.id = uuid.uuid4().hex
        self.prompt, self.max_tokens, self.deliver = prompt, max_tokens, deliver
        self.hashes = block_hashes(prompt, block_size)
        self.computed, self.output, self.blocks, self.n_cached_blocks = 0, 0, [], 0
        self.cached_tokens, self.preempted, self.preemptions = 0, False, 0
        self.arrival, self.scheduled_at, self.first_at, self.last_at = time.monotonic(), None, None, None
        self.created = int(time.time())

    @property
    def tokens(self) -> int:  # what the KV cache holds once computed: the prompt and the output so far
        return len(self.prompt) + self.output


class FakeScheduler:
    """The scheduler: the attributes vLLM's scheduler has where LiveLimitsMixin changes
    them (scheduler_config, max_num_running_reqs, max_num_scheduled_tokens, requests,
    running), read afresh at every step as vLLM's schedule() does."""

    def __init__(self, args: argparse.Namespace, pool: BlockPool, metrics: "Metrics"):
        self.scheduler_config = SimpleNamespace(
            max_num_batched_tokens=args.max_num_batched_tokens, async_scheduling=False,
            long_prefill_token_threshold=args.long_prefill_token_threshold,
            enable_chunked_prefill=args.enable_chunked_prefill)
        self.vllm_config = SimpleNamespace(additional_config=args.additional_config, parallel_config=None)
        self.max_num_running_reqs = args.max_num_seqs
        self.max_num_scheduled_tokens = args.max_num_batched_tokens
        self.block_size, self.caching = args.block_size, args.enable_prefix_caching
        self.pool, self.metrics = pool, metrics
        self.requests: dict[str, Req] = {}
        self.running: list[Req] = []
        self.waiting: collections.deque[Req] = collections.deque()

    def add(self, r: Req) -> None:
        self.requests[r.id] = r
        self.waiting.append(r)

    def abort(self, rid: str) -> None:
        r = self.requests.pop(rid, None)
        if r is None:
            return
        if r in self.running:
            self.running.remove(r)
        elif r in self.waiting:
            self.waiting.remove(r)
        self.pool.release(r.blocks)
        r.blocks = []

    def _blocks_for(self, r: Req, n: int) -> int:
        return max(0, math.ceil((r.computed + n) / self.block_size) - len(r.blocks))

    def _chunk(self, r: Req, budget: int) -> int:
        n = r.tokens - r.computed
        if n > 1 and self.scheduler_config.long_prefill_token_threshold:
            n = min(n, self.scheduler_config.long_prefill_token_threshold)
        return min(n, budget)

    def _preempt(self, victim: Req) -> None:
        self.running.remove(victim)
        self.pool.release(victim.blocks)
        victim.blocks, victim.computed, victim.n_cached_blocks = [], 0, 0
        victim.preempted, victim.preemptions = True, victim.preemptions + 1
        self.waiting.appendleft(victim)
        self.metrics.preemptions.inc()

    def schedule(self) -> SimpleNamespace:
        budget = self.max_num_scheduled_tokens
        plan: list[tuple[Req, int]] = []
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            r = self.running[i]
            n = self._chunk(r, budget)
            new = self.pool.allocate(self._blocks_for(r, n))
            while new is None:  # no free block: the last running request makes room
                victim = self.running[-1]
                self._preempt(victim)
                preempted = True
                if victim is r:
                    break
                new = self.pool.allocate(self._blocks_for(r, n))
            if new is None:
                break
            r.blocks += new
            plan.append((r, n))
            budget -= n
            i += 1
        while (self.waiting and budget > 0 and not preempted
               and len(self.running) < self.max_num_running_reqs):
            if not self._admit(self.waiting[0], budget, plan):
                break
            budget -= plan[-1][1]
            self.running.append(self.waiting.popleft())
        return SimpleNamespace(plan=plan, total_num_scheduled_tokens=sum(n for _, n in plan))

    def _admit(self, r: Req, budget: int, plan: list) -> bool:
        hit = []
        if self.caching:  # at least the prompt's last token is computed, as vLLM does
            hit = self.pool.hits(r.hashes[:(r.tokens - 1) // self.block_size])
            if not r.preempted:
                self.metrics.queries.inc(len(r.prompt))
                self.metrics.hits.inc(len(hit) * self.block_size)
        r.computed = len(hit) * self.block_size
        n = r.tokens - r.computed
        if not self.scheduler_config.enable_chunked_prefill and n > budget:
            r.computed = 0
            return False
        n = self._chunk(r, budget)
        self.pool.take(hit)
        new = self.pool.allocate(self._blocks_for(r, n))
        if new is None:
            self.pool.release(hit)
            r.computed = 0
            return False
        if r.scheduled_at is None:
            r.scheduled_at = time.monotonic()
            r.cached_tokens = r.computed
        r.blocks, r.n_cached_blocks = hit + new, len(hit)
        plan.append((r, n))
        return True

    def update(self, out: SimpleNamespace) -> tuple[list, int, int]:
        """After the step ran: advance each request; returns (tokens to deliver, prompt
        tokens computed by prefills that finished, output tokens)."""
        events, prefill_done, generated = [], 0, 0
        now = time.monotonic()
        for r, n in out.plan:
            if r.id not in self.requests:
                continue  # aborted during the step
            r.computed += n
            if self.caching:
                full = min(r.computed, len(r.prompt)) // self.block_size
                for j in range(r.n_cached_blocks, full):
                    self.pool.cache(r.blocks[j], r.hashes[j])
                r.n_cached_blocks = max(r.n_cached_blocks, full)
            if r.computed < r.tokens:
                continue  # a prefill chunk
            if r.output == 0 or r.preempted:
                prefill_done += len(r.prompt) - r.cached_tokens if not r.preempted else 0
                r.preempted = False
            r.output += 1
            generated += 1
            self.metrics.token(r, now)
            done = r.output >= r.max_tokens
            events.append((r, done))
            if done:
                self.running.remove(r)
                del self.requests[r.id]
                self.pool.release(r.blocks)
                r.blocks = []
                self.metrics.finished(r, now)
        return events, prefill_done, generated

    def shutdown(self) -> None:
        pass


class LiveLimitsScheduler(LiveLimitsMixin, FakeScheduler):
    """The kit's live-limits plugin over the fake scheduler, as over vLLM's."""


# -- metrics ----------------------------------------------------------------------------
class Metrics:
    """vLLM's /metrics names, labels (model_name, engine) and buckets."""

    def __init__(self, served: str, max_model_len: int, custom: dict | None):
        buckets = vllm_buckets()
        disable_created_metrics()  # as vLLM does: no *_created samples
        self.registry = r = CollectorRegistry()
        lab = {"model_name": served, "engine": "0"}
        names = list(lab)

        def counter(name, doc):
            return Counter(name, doc, names, registry=r).labels(**lab)

        def gauge(name, doc):
            return Gauge(name, doc, names, registry=r).labels(**lab)

        def hist(name, family, doc):
            b = buckets(family, max_model_len=max_model_len, overrides=custom)
            return Histogram(name, doc, names, buckets=b, registry=r).labels(**lab)

        self.queries = counter("vllm:prefix_cache_queries",
                               "Prefix cache queries, in terms of number of queried tokens.")
        self.hits = counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.")
        self.preemptions = counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        self.success = Counter("vllm:request_success", "Count of successfully processed requests.",
                               names + ["finished_reason"], registry=r).labels(**lab, finished_reason="length")
        self.running = gauge("vllm:num_requests_running", "Number of requests in model execution batches.")
        self.waiting = gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        self.kv = gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.iteration = hist("vllm:iteration_tokens_total", "iteration_tokens",
                              "Histogram of number of tokens per engine_step.")
        self.ttft = hist("vllm:time_to_first_token_seconds", "time_to_first_token",
                         "Histogram of time to first token in seconds.")
        self.itl = hist("vllm:inter_token_latency_seconds", "inter_token_latency",
                        "Histogram of inter-token latency in seconds.")
        self.e2e = hist("vllm:e2e_request_latency_seconds", "request_latency",
                        "Histogram of e2e request latency in seconds.")
        self.queue = hist("vllm:request_queue_time_seconds", "request_latency",
                          "Histogram of time spent in WAITING phase for request.")
        self.req_prompt = hist("vllm:request_prompt_tokens", "request_tokens", "Number of prefill tokens processed.")
        self.req_generation = hist("vllm:request_generation_tokens", "request_tokens",
                                   "Number of generation tokens processed.")
        self.prefill_kv = hist("vllm:request_prefill_kv_computed_tokens", "request_tokens",
                               "Histogram of new KV tokens computed during prefill (excluding cached tokens).")
        info = ["block_size", "enable_prefix_caching", "gpu_memory_utilization",
                                 "kv_cache_memory_bytes", "kv_cache_size_tokens", "kv_cache_max_concurrency",
                                 "num_gpu_blocks", "num_gpu_blocks_override", "engine"]
        self.cache_info = Gauge("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                                info, registry=r)

    def cache_config(self, args, blocks: int, max_model_len: int) -> None:
        """vLLM's CacheConfig fields as string labels (CacheConfig.metrics_info)."""
        tokens = blocks * args.block_size
        labels = {"block_size": args.block_size, "enable_prefix_caching": args.enable_prefix_caching,
                  "gpu_memory_utilization": args.gpu_memory_utilization,
                  "kv_cache_memory_bytes": args.kv_cache_memory_bytes, "kv_cache_size_tokens": tokens,
                  "kv_cache_max_concurrency": tokens / max_model_len, "num_gpu_blocks": blocks,
                  "num_gpu_blocks_override": args.num_gpu_blocks_override, "engine": 0}
        self.cache_info.labels(**{k: str(v) for k, v in labels.items()}).set(1)

    def token(self, r: Req, now: float) -> None:
        if r.first_at is None:
            r.first_at = now
            self.ttft.observe(now - r.arrival)
        else:
            self.itl.observe(now - r.last_at)
        r.last_at = now

    def finished(self, r: Req, now: float) -> None:
        self.success.inc()
        self.e2e.observe(now - r.arrival)
        self.queue.observe((r.scheduled_at or now) - r.arrival)
        self.req_prompt.observe(len(r.prompt))
        self.req_generation.observe(r.output)
        self.prefill_kv.observe(len(r.prompt) - r.cached_tokens)

    def step(self, s: FakeScheduler, prefill_done: int, generated: int) -> None:
        if generated:  # vLLM observes the histogram only on steps with output
            self.iteration.observe(prefill_done + generated)
            self.prompt_tokens.inc(prefill_done)
            self.generation_tokens.inc(generated)
        self.gauges(s)

    def gauges(self, s: FakeScheduler) -> None:
        self.running.set(len(s.running))
        self.waiting.set(len(s.waiting))
        self.kv.set(s.pool.usage)


# -- the engine thread -------------------------------------------------------------------
class Engine:
    """The engine core: takes requests, aborts and cache resets from a queue between
    steps (as vLLM's busy loop does) and runs steps while it holds requests."""

    def __init__(self, sched: FakeScheduler):
        self.sched = sched
        self.inbox: queue.Queue = queue.Queue()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="engine-core", daemon=True)

    def _drain(self, block: bool) -> None:
        try:
            item = self.inbox.get(timeout=0.05) if block else self.inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            kind, arg = item
            if kind == "add":
                self.sched.add(arg)
            elif kind == "abort":
                self.sched.abort(arg)
            elif kind == "reset":
                arg.set_result(self.sched.pool.reset())
            try:
                item = self.inbox.get_nowait()
            except queue.Empty:
                break
        self.sched.metrics.gauges(self.sched)

    def _loop(self) -> None:
        try:
            self._steps()
        except Exception:  # as vLLM's server does when its engine core dies: the process ends
            import traceback
            log("EngineCore", "core.py:1", "EngineCore encountered a fatal error.\n" + traceback.format_exc(), "ERROR")
            os._exit(1)

    def _steps(self) -> None:
        while not self.stop.is_set():
            self._drain(block=not self.sched.requests)
            if not self.sched.requests:
                continue
            out = self.sched.schedule()
            if not out.total_num_scheduled_tokens:  # nothing fits: wait for an abort
                time.sleep(STEP_S)
                continue
            time.sleep(STEP_S + TOKEN_S * out.total_num_scheduled_tokens)
            events, prefill_done, generated = self.sched.update(out)
            self.sched.metrics.step(self.sched, prefill_done, generated)
            by_loop = collections.defaultdict(list)
            for r, done in events:
                by_loop[r.deliver[0]].append((r.deliver[1], done))
            for loop, items in by_loop.items():
                loop.call_soon_threadsafe(_deliver, items)


def _deliver(items) -> None:
    for q, done in items:
        q.put_nowait(done)


# -- logging as vLLM does ----------------------------------------------------------------
def info_visible() -> bool:
    level = os.environ.get("VLLM_LOGGING_LEVEL", "INFO").upper()
    return os.environ.get("VLLM_CONFIGURE_LOGGING", "1") != "0" and level in ("DEBUG", "INFO")


class _VllmFormat(logging.Formatter):
    """The plugin's own log lines (live_limits.py logs through `logging`) in vLLM's format."""

    def format(self, record: logging.LogRecord) -> str:
        stamp = time.strftime("%m-%d %H:%M:%S", time.localtime(record.created))
        return (f"(EngineCore pid={os.getpid()}) {record.levelname} {stamp} "
                f"[{record.filename}:{record.lineno}] {record.getMessage()}")


def configure_logging() -> None:
    if os.environ.get("VLLM_CONFIGURE_LOGGING", "1") == "0":
        return
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(_VllmFormat())
    root = logging.getLogger("vllm")
    root.addHandler(handler)
    root.setLevel(os.environ.get("VLLM_LOGGING_LEVEL", "INFO").upper())


def log(proc: str, where: str, msg: str, level: str = "INFO") -> None:
    if level == "INFO" and not info_visible():
        return
    stamp = time.strftime("%m-%d %H:%M:%S")
    print(f"({proc} pid={os.getpid()}) {level} {stamp} [{where}] {msg}", flush=True)


# -- the HTTP server ---------------------------------------------------------------------
class Server:
    def __init__(self, args, served: str, tokens: Tokens, engine: Engine, max_model_len: int):
        self.args, self.served, self.tokens, self.engine = args, served, tokens, engine
        self.names = set(args.served_model_name or [args.model])
        self.max_model_len = max_model_len

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_get("/health", lambda _: web.Response())
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_post("/v1/completions", lambda q: self.generate(q, chat=False))
        app.router.add_post("/v1/chat/completions", lambda q: self.generate(q, chat=True))
        if os.environ.get("VLLM_SERVER_DEV_MODE") == "1":  # vLLM registers it only then
            app.router.add_post("/reset_prefix_cache", self.reset)
        return app

    async def models(self, _):
        return web.json_response({"object": "list", "data": [
            {"id": self.served, "object": "model", "created": int(time.time()), "owned_by": "vllm",
             "root": self.args.model, "parent": None, "max_model_len": self.max_model_len}]})

    async def metrics(self, _):
        return web.Response(body=generate_latest(self.engine.sched.metrics.registry),
                            headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def reset(self, _):
        done = asyncio.get_running_loop().create_future()
        fut = _ThreadFuture(done)
        self.engine.inbox.put(("reset", fut))
        if not await done:
            log("APIServer", "api_server.py:1", "Failed to reset prefix cache because some blocks are not "
                "freed yet", "WARNING")
        return web.Response()

    @staticmethod
    def error(status: int, kind: str, message: str) -> web.Response:
        return web.json_response({"error": {"message": message, "type": kind, "param": None,
                                            "code": status}}, status=status)

    async def generate(self, request: web.Request, chat: bool):
        try:
            body = await request.json()
            prompt = self.tokens.prompt(body, chat)
        except (ValueError, KeyError, TypeError) as e:
            return self.error(400, "BadRequestError", f"invalid request: {e}")
        if body.get("model") not in self.names:
            return self.error(404, "NotFoundError", f"The model `{body.get('model')}` does not exist.")
        room = self.max_model_len - len(prompt)
        max_tokens = body.get("max_completion_tokens") or body.get("max_tokens") or room
        if len(prompt) + max_tokens > self.max_model_len:
            return self.error(400, "BadRequestError", (
                f"This model's maximum context length is {self.max_model_len} tokens. However, your request "
                f"has {len(prompt)} input tokens and requests {max_tokens} output tokens. Please reduce the "
                "length of the input prompt or the number of requested output tokens."))
        q: asyncio.Queue = asyncio.Queue()
        r = Req(prompt, max_tokens, self.args.block_size, (asyncio.get_running_loop(), q))
        self.engine.inbox.put(("add", r))
        stream = bool(body.get("stream"))
        try:
            if stream:
                return await self._stream(request, r, q, chat, body)
            while not await q.get():
                pass
            return web.json_response(self._whole(r, chat))
        except (asyncio.CancelledError, ConnectionResetError):
            self.engine.inbox.put(("abort", r.id))
            raise

    def _usage(self, r: Req) -> dict:
        return {"prompt_tokens": len(r.prompt), "completion_tokens": r.output,
                "total_tokens": len(r.prompt) + r.output}

    def _head(self, r: Req, chat: bool) -> dict:
        return {"id": ("chatcmpl-" if chat else "cmpl-") + r.id, "created": r.created,
                "object": "chat.completion.chunk" if chat else "text_completion", "model": self.served}

    def _whole(self, r: Req, chat: bool) -> dict:
        text = OUTPUT_TEXT * r.output
        choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length"}
                  if chat else {"index": 0, "text": text, "logprobs": None, "finish_reason": "length"})
        return {**self._head(r, chat), "object": "chat.completion" if chat else "text_completion",
                "choices": [choice], "usage": self._usage(r)}

    async def _stream(self, request, r: Req, q: asyncio.Queue, chat: bool, body: dict):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8",
                                           "Cache-Control": "no-cache"})
        await resp.prepare(request)
        head = self._head(r, chat)

        def chunk(choices, usage=None) -> bytes:
            return b"data: " + json.dumps({**head, "choices": choices, "usage": usage}).encode() + b"\n\n"

        if chat:  # vLLM's first chat chunk carries the role alone
            await resp.write(chunk([{"index": 0, "delta": {"role": "assistant", "content": ""},
                                     "finish_reason": None}]))
        done = False
        while not done:
            done = await q.get()
            parts = [done]
            while not q.empty():  # tokens that arrived together go in one write
                parts.append(q.get_nowait())
            data = b""
            for d in parts:
                why = "length" if d else None
                data += chunk([{"index": 0, "delta": {"content": OUTPUT_TEXT}, "finish_reason": why}] if chat
                              else [{"index": 0, "text": OUTPUT_TEXT, "logprobs": None, "finish_reason": why}])
            done = parts[-1]
            await resp.write(data)
        if (body.get("stream_options") or {}).get("include_usage"):
            await resp.write(chunk([], self._usage(r)))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


class _ThreadFuture:
    """An asyncio future the engine thread may resolve."""

    def __init__(self, fut: asyncio.Future):
        self.fut, self.loop = fut, fut.get_loop()

    def set_result(self, value) -> None:
        self.loop.call_soon_threadsafe(self.fut.set_result, value)


# -- start-up ----------------------------------------------------------------------------
def kv_blocks(args, max_model_len: int) -> int:
    if args.num_gpu_blocks_override:
        return args.num_gpu_blocks_override
    per_token = kv_bytes_per_token(args.model, args.dtype)
    tokens = args.kv_cache_memory_bytes // per_token if args.kv_cache_memory_bytes and per_token else KV_TOKENS
    return tokens // args.block_size


def check(args, max_model_len: int, blocks: int) -> None:
    """vLLM's start-up refusals the kit reads a reason from (launch/server.py)."""
    if args.max_num_batched_tokens < args.max_num_seqs:
        raise ValueError(f"max_num_batched_tokens ({args.max_num_batched_tokens}) must be greater than or equal "
                         f"to max_num_seqs ({args.max_num_seqs}).")
    if blocks * args.block_size < max_model_len:
        raise ValueError(f"To serve at least one request with the models's max seq len ({max_model_len}), "
                         f"{max_model_len} tokens of KV cache are needed, which is larger than the available "
                         f"KV cache ({blocks * args.block_size} tokens). Try increasing the KV cache memory or "
                         "decreasing `max_model_len` when initializing the engine.")
    if args.scheduler_cls and args.scheduler_cls not in LIVE_SCHEDULERS:
        raise ValueError(f"the fake engine does not model --scheduler-cls {args.scheduler_cls}: it runs the "
                         f"live-limits plugin ({LIVE_SCHEDULERS[0]}) only; test that scheduler on vLLM")


def main(argv: list[str]) -> None:
    t0 = time.monotonic()
    configure_logging()
    args, given = parse_args(argv)
    served = (args.served_model_name or [args.model])[0]
    log("APIServer", "api_utils.py:286", f"non-default args: {given!r}")
    max_model_len = args.max_model_len or max_positions(args.model)
    blocks = kv_blocks(args, max_model_len)
    try:
        check(args, max_model_len, blocks)
    except ValueError as e:
        print(f"(EngineCore pid={os.getpid()}) ValueError: {e}", flush=True)
        sys.exit(1)
    log("EngineCore", "core.py:133", f"Initializing a V1 LLM engine (v{VERSION}, fake) with config: "
        f"model={args.model!r}, max_seq_len={max_model_len}, enable_prefix_caching={args.enable_prefix_caching}")
    init = time.monotonic()
    tokens = Tokens(args.model)
    log("EngineCore", "base_loader.py:82", f"Initializing model took {time.monotonic() - init:.6f} seconds")
    log("EngineCore", "kv_cache_utils.py:2327", f"CPU KV cache size: {blocks * args.block_size:,} tokens, Maximum "
        f"concurrency for {max_model_len:,} tokens per request: {blocks * args.block_size / max_model_len:.2f}x")
    metrics = Metrics(served, max_model_len, args.custom_histogram_buckets)
    metrics.cache_config(args, blocks, max_model_len)
    cls = LiveLimitsScheduler if args.scheduler_cls else FakeScheduler
    try:
        sched = cls(args, BlockPool(blocks), metrics)
    except ValueError as e:  # the plugin's own refusal (no counters file)
        print(f"(EngineCore pid={os.getpid()}) ValueError: {e}", flush=True)
        sys.exit(1)
    metrics.gauges(sched)
    engine = Engine(sched)
    engine.thread.start()
    time.sleep(max(0.0, INIT_S - (time.monotonic() - init)))  # a start ahead can be frozen here
    while INIT_UNTIL and not os.path.exists(INIT_UNTIL):
        time.sleep(0.1)
    log("EngineCore", "core.py:402", f"init engine (profile, create kv cache, warmup model) took "
        f"{time.monotonic() - init:.2f} s")
    server = Server(args, served, tokens, engine, max_model_len)

    async def started(_app):
        log("APIServer", "entry.py:140", f"Starting vLLM server on http://{args.host}:{args.port}")
        log("APIServer", "entry.py:141", f"fake engine up in {time.monotonic() - t0:.2f} s")

    async def stopped(_app):
        engine.stop.set()
        engine.thread.join(timeout=2)
        sched.shutdown()

    app = server.app()
    app.on_startup.append(started)
    app.on_cleanup.append(stopped)
    try:
        web.run_app(app, host=args.host, port=args.port, print=None, access_log=None, shutdown_timeout=0.1)
    except OSError as e:
        if e.errno == 98:
            print("ERROR: [Errno 98] Address already in use", flush=True)  # uvicorn's words, which the kit reads
        else:
            print(f"OSError: {e}", flush=True)
        sys.exit(1)
    # Stopped and cleaned up (the counters file flushed): freeing the tokenizer at the
    # interpreter's exit would take seconds more.
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1:])
