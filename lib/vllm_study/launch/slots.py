"""GPU slots and the lock that lets one server at a time use a slot. Imports nothing of
the package, so the point notebook (point.py) and the executors can share it without
importing each other."""
from __future__ import annotations

import fcntl
import os
from pathlib import Path


def gpu_slots(n_gpus: int, tp: int) -> list[list[int]]:
    """Disjoint GPU sets of `tp` GPUs each (GPUs left over stay idle)."""
    if tp < 1:
        raise ValueError(f"tensor_parallel_size must be at least 1, got {tp}")
    if n_gpus < tp:
        raise ValueError(f"a point needs {tp} GPU(s) (tensor_parallel_size) but this host has {n_gpus}")
    return [list(range(i, i + tp)) for i in range(0, n_gpus - tp + 1, tp)]


def compile_cache_env(slot: list[int] | None) -> dict[str, str]:
    """Its own torch.compile cache per GPU slot: concurrent servers never write one
    cache at once, and a slot's later starts still reuse what its earlier ones built."""
    if slot is None:
        return {}
    root = Path(os.environ.get("VLLM_CACHE_ROOT", Path.home() / ".cache" / "vllm"))
    return {"VLLM_CACHE_ROOT": str(root / f"gpus-{'-'.join(map(str, slot))}")}


class SlotLock:
    """One server at a time on a slot, across processes. The sweep starts a start's
    notebook (papermill, kernel, imports, plan) while the slot's previous start is still
    running; the notebook takes this lock before its server touches the GPU (before it
    spawns it, or, started ahead, while the server is held at its engine's init), and
    the previous one gives it back once its own server has stopped. An flock: the OS
    releases it if its holder dies."""

    def __init__(self, path: str | Path):
        self.path, self.fd = Path(path), None

    def acquire(self, wait: bool = True) -> bool:
        """Takes the slot, blocking until it is free; wait=False: only if it is free now.
        Returns whether it is held (if not, nothing is)."""
        fd = os.open(self.path, os.O_CREAT | os.O_RDWR, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        self.fd = fd
        return True

    @property
    def held(self) -> bool:
        return self.fd is not None

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing the descriptor releases the flock
            self.fd = None


SLOT_LOCKS = ".slot-*.lock"  # in the run folder while a sweep runs (and in .gitignore)


def slot_lock_path(run_dir: Path, slot: list[int] | None) -> Path:
    return Path(run_dir) / SLOT_LOCKS.replace("*", "gpus-" + "-".join(map(str, slot)) if slot else "local")
