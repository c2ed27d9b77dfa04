"""The kit's one codec for a configuration's vLLM flags: a point's argv, its `vllm serve
--config` mapping and every lookup of a flag come from here, and nothing else parses or
normalises a flag name.

A flag's name is held in one form, vLLM's: dashes, no leading `--`, no `no-` prefix
(`--max_num_batched_tokens`, `--max-num-batched-tokens=8` and `--max-num-batched-tokens 8`
are one flag, `max-num-batched-tokens`; `--no-enable-prefix-caching` is
`enable-prefix-caching` set to False). vLLM's parser reads them the same way
(FlexibleArgumentParser turns `_` into `-`; BooleanOptionalAction gives `--no-x`; no
flag of vLLM's own begins with `no-`). Tokens are kept as written, so a study's
extra_cli_args reach the server as the study wrote them.

Hand-written rather than vLLM's argparse: the kit reads flags it does not know and must
not import vLLM (10 s) to read a study file or a committed run.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Iterator, Mapping

# vLLM's store_true engine flags: set or absent, with no `--no-` form
STORE_TRUE = frozenset({"enforce-eager"})


def flag_name(key: str) -> str:
    """'--max_num_batched_tokens', 'max_num_batched_tokens', '--no-enable-prefix-caching'
    -> 'max-num-batched-tokens', ..., 'enable-prefix-caching': the one form of a name."""
    name = key.removeprefix("--").partition("=")[0].replace("_", "-")
    return name.removeprefix("no-")


def field_name(name: str) -> str:
    """A flag's name as a Python field (EngineArgs, a summary's engine_args): snake_case."""
    return flag_name(name).replace("-", "_")


def option(name: str) -> str:
    """'max_num_batched_tokens' -> '--max-num-batched-tokens'."""
    return "--" + flag_name(name)


@dataclass(frozen=True)
class Flag:
    """One flag with its value (a string as written, True for a bare flag, False for
    `--no-x`), or, with name None, a token that is no flag's (the command's head)."""
    name: str | None
    value: str | bool | int | float
    tokens: tuple[str, ...]

    @property
    def written(self) -> str:
        """The flag as the command wrote it, without its value: '--no_enable_mfu_metrics'."""
        return self.tokens[0].partition("=")[0] if self.tokens else option(self.name)


def _encode(name: str, value) -> tuple[str, ...]:
    if isinstance(value, bool):
        if name in STORE_TRUE:
            return (option(name),) if value else ()
        return (option(name) if value else "--no-" + name,)
    return option(name), str(value)


class Flags:
    """A command line's flags, in order: parsed from an argv (`parse`) or encoded from
    values (`of`); read back as an argv, a `serve --config` mapping, or by name."""

    def __init__(self, entries: Iterable[Flag] = ()):
        self.entries = tuple(entries)

    @classmethod
    def parse(cls, argv: Iterable[str]) -> "Flags":
        """['--a', '1', '--b_c=2', '--d', '--no-e', 'x'] -> a=1, b-c=2, d=True, e=False
        and 'x' kept as a token of no flag: a flag takes the next token as its value unless
        that one begins with `--` (or the flag is `--no-x` or gave `=`)."""
        argv, out, i = list(argv), [], 0
        while i < len(argv):
            tok = argv[i]
            if not tok.startswith("--") or tok == "--":
                out.append(Flag(None, tok, (tok,)))
                i += 1
                continue
            key, eq, value = tok[2:].partition("=")
            negated = key.replace("_", "-").startswith("no-")
            if eq:
                out.append(Flag(flag_name(key), value, (tok,)))
            elif not negated and i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                out.append(Flag(flag_name(key), argv[i + 1], (tok, argv[i + 1])))
                i += 1
            else:
                out.append(Flag(flag_name(key), not negated, (tok,)))
            i += 1
        return cls(out)

    @classmethod
    def of(cls, values: Mapping[str, object]) -> "Flags":
        """Flags from named values (EngineArgs' fields, a summary's engine_args, a serve
        config); None is left out: vLLM's default."""
        return cls(Flag(flag_name(k), v, _encode(flag_name(k), v)) for k, v in values.items() if v is not None)

    def __iter__(self) -> Iterator[Flag]:
        return (e for e in self.entries if e.name is not None)

    def __add__(self, other: "Flags") -> "Flags":
        return Flags(self.entries + other.entries)

    def __contains__(self, name: str) -> bool:
        return flag_name(name) in self.names()

    def __eq__(self, other) -> bool:
        return isinstance(other, Flags) and self.entries == other.entries

    def __hash__(self) -> int:
        return hash(self.entries)

    def __repr__(self) -> str:
        return f"Flags({self.argv()!r})"

    def names(self) -> set[str]:
        return {f.name for f in self}

    def get(self, name: str, default=None):
        """The value of the last `name` given (vLLM's parser keeps the last), else default."""
        name = flag_name(name)
        return next((f.value for f in reversed(list(self)) if f.name == name), default)

    def without(self, names: Iterable[str]) -> "Flags":
        drop = {flag_name(n) for n in names}
        return Flags(e for e in self.entries if e.name is None or e.name not in drop)

    def argv(self) -> list[str]:
        return [t for e in self.entries for t in e.tokens]

    def config(self) -> dict:
        """The `vllm serve --config` mapping: each flag's name without its dashes, the last
        value given winning; False is `--no-x` there too (vLLM's load_config_file)."""
        return {f.name: f.value for f in self}
