"""Executors local (one start after another on this machine, the default) and gpus (as
many at once as this host's GPUs allow, each on a disjoint set of tensor_parallel_size
GPUs, with its own port, log and torch.compile cache). Both run the point notebook here."""
from __future__ import annotations

from ..launch.machine import describe
from ..define.schema import StudyError
from ..launch.slots import gpu_slots, slot_lock_path
from ..measure.unit import run_unit
from . import Executor


class LocalExecutor(Executor):
    kind = "local"

    def __call__(self, unit, slot, bar, release=None):
        return run_unit(self.run, unit, gpus=slot, bar=bar, slot_lock=slot_lock_path(self.run.path, slot),
                        on_started=release)


class GpusExecutor(LocalExecutor):
    kind = "gpus"

    def __init__(self, run, study, engine, points, ray_address=None, parallel=None):
        super().__init__(run, study, engine, points)
        n = len(describe().gpus)
        if engine != "gpu" or n == 0:
            raise StudyError("executor gpus runs points on this host's GPUs, and NVML sees none here; "
                             "use --executor local (or ray for a cluster)")
        self.slots = gpu_slots(n, self.tp)[:parallel] if parallel else gpu_slots(n, self.tp)
