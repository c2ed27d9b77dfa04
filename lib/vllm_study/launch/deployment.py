"""What a start launches: a deployment, described by value, and the handle starting it
gives back. The rest of a start (its workload, rounds, counters, records) sees only the
handle, so a new kind of engine is one class here and nothing elsewhere changes.

Kinds:
- `VllmServe`: one vLLM OpenAI server the kit starts (model, served name, dummy load,
  engine flags, the study's extra flags, the kit's measurement flags, environment).
- `Endpoint`: an OpenAI-compatible server the kit measures but does not start (a
  study's `targets`).
A fake engine for tests is a `VllmServe` with another `program` (tests/fake_engine.py
takes vLLM's command line; a study sets it with server.command). Where the next kinds go
(one class each, here): a simulated engine
(predict/: no process, a handle whose URL serves virtual time), a prefill/decode pair (two
`VllmServe`s with a KV connector, and a proxy: one handle whose base URL is the proxy's
and whose stop() stops all three).

A configuration's flags are read and written by one codec (flags.Flags): the argv, the
`serve --config` mapping (export) and every lookup come from it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Protocol

from .flags import Flags
from .server import ServerStartError, VllmServer, free_port, serve_command, vllm_program

# Flags the kit adds so the server counts what the report needs (counters.budget_buckets,
# machine.py): measurement, not serving settings; an exported config leaves them out.
MEASUREMENT_ONLY = frozenset({"custom-histogram-buckets", "enable-mfu-metrics"})
# Flags a start's command sets for this start alone: its loopback address and free port.
PER_START = frozenset({"host", "port"})
PORT_TRIES = 2  # a start whose port was taken before vLLM bound it is started once more


class Handle(Protocol):
    """A started deployment, as the rest of a start uses it."""
    base_url: str                # the OpenAI API's root (the client adds /v1/...)
    metrics_url: str | None      # Prometheus text; None where the server has none
    pgid: int | None             # the process group the kit started; None for one it did not
    log_path: Path | None        # the server's log; None for one the kit did not start
    notes: list[str]             # what the start did that its record should say

    def stop(self) -> None: ...

    def alive(self) -> bool: ...

    def exited(self, wait_s: float = 0) -> bool: ...


class Deployment(Protocol):
    """What a start launches; `start` gives its handle or raises ServerStartError."""
    served_name: str  # the model name requests carry

    def start(self, log_path: Path | None = None, hold: Callable[[], object] | None = None,
              spawned: Callable[[Handle], object] | None = None) -> Handle: ...


@dataclass
class EndpointHandle:
    """A server the kit did not start: nothing to stop, never seen to exit."""
    base_url: str
    metrics_url: str | None = None
    pgid: int | None = None
    log_path: Path | None = None
    notes: list[str] = field(default_factory=list)

    def stop(self) -> None:
        pass

    def alive(self) -> bool:
        return True

    def exited(self, wait_s: float = 0) -> bool:
        return False


@dataclass(frozen=True)
class Endpoint:
    """An OpenAI-compatible endpoint the kit measures but does not start; whether it
    answers, and what its /metrics holds, the caller checks (measure/launcher.py)."""
    name: str
    base_url: str
    model: str
    api_key_env: str | None = None
    proxy: str | None = None

    @property
    def served_name(self) -> str:
        return self.model

    def start(self, log_path: Path | None = None, hold: Callable[[], object] | None = None,
              spawned: Callable[[Handle], object] | None = None) -> EndpointHandle:
        """Nothing to spawn or hold: the handle of a server already up (or not: the caller
        asks it)."""
        return EndpointHandle(self.base_url, self.base_url + "/metrics")

    def record(self) -> dict:
        """What a start records of it: the key's variable name, never the key."""
        return {"name": self.name, "base_url": self.base_url, "model": self.model,
                "api_key_env": self.api_key_env, "proxy": self.proxy}


@dataclass(frozen=True)
class VllmServe:
    """One vLLM server the kit starts. Its configuration is `engine` (the point's engine
    arguments) and `extra` (the study's server.extra_cli_args, as written); `measuring` is
    what the kit adds to count (measurement_flags), `env` the variables it runs with.
    `program` is what runs, vLLM's command line after it (server.serve_command): vLLM's
    serve entrypoint by default, another program taking vLLM's flags where a study's
    server.command names one (the tests' fake engine)."""
    model: str                       # a folder or hub id
    served_name: str
    load_dummy: bool
    engine: Flags = field(default_factory=Flags)
    extra: Flags = field(default_factory=Flags)
    measuring: Flags = field(default_factory=Flags)
    env: dict[str, str] = field(default_factory=dict)
    startup_timeout_s: float = 900
    program: tuple[str, ...] = field(default_factory=vllm_program)

    @property
    def flags(self) -> Flags:
        """The configuration served: engine arguments, then the study's extra flags (a flag
        given twice: the last wins, as in vLLM's parser)."""
        return self.engine + self.extra

    def command(self, port: int) -> list[str]:
        return serve_command(self.model, port, self.engine.argv(), self.served_name, self.load_dummy,
                             self.extra.argv() + self.measuring.argv(), self.program)

    def serve_config(self) -> dict:
        """The configuration as a `vllm serve --config` mapping: the kit's measurement-only
        flags, the per-start address and the model left out (the command line holds it)."""
        cfg = self.flags.without(MEASUREMENT_ONLY | PER_START).config()
        return {**cfg, "served-model-name": self.served_name}

    def start(self, log_path: Path, hold: Callable[[], object] | None = None,
              spawned: Callable[[VllmServer], object] | None = None) -> VllmServer:
        """Spawn the server on a free port and wait until it is healthy. `spawned(server)`
        is called once its command is fixed, before it runs (the caller records it);
        `hold`: see VllmServer.start. A port taken between its pick and vLLM's bind (another
        process's ephemeral socket; nothing was measured) is picked again, once. Raises
        ServerStartError with `.server` the last one spawned, whose start facts still count."""
        notes: list[str] = []
        for attempt in range(PORT_TRIES):
            port = free_port()
            server = VllmServer(self.command(port), port, log_path, env=self.env,
                                startup_timeout_s=self.startup_timeout_s)
            server.notes = notes
            if spawned:
                spawned(server)
            try:
                return server.start(hold=hold)
            except ServerStartError as e:
                e.server = server
                if not e.reason.startswith("port in use") or attempt == PORT_TRIES - 1:
                    raise
            notes.append(f"port {port} was taken before the server bound it: started again on another port")
        raise AssertionError("unreachable: the last try returns or raises")
