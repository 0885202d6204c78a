"""What the trainer-memory benchmarks share (``bench_lora_memory``, ``bench_cp_memory``):
a job trained by ``Trainer(cfg, Topology.of(cfg.parallel)).fit()`` in fresh spawned
processes, each reporting its peak resident memory (``VmHWM`` of /proc/self/status, the
kernel's high-water mark of the process's RSS, start-up included)."""

from __future__ import annotations

import time
from pathlib import Path


def _status_bytes(key: str) -> int:
    """A kB field of /proc/self/status, in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{key}:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {key} in /proc/self/status")


def peak_rss() -> int:
    """This process's peak resident memory in bytes (VmHWM)."""
    return _status_bytes("VmHWM")


def rss() -> int:
    """This process's resident memory now in bytes (VmRSS)."""
    return _status_bytes("VmRSS")


def train(job: dict, prepare=None):
    """(trainer, per-step losses, seconds) of the trainer's run of ``job`` on this rank,
    with the host allocator ``launch.host_memory`` sets (as ``parallel3d train``'s workers
    do); ``prepare(cfg)`` runs before the trainer is built."""
    from parallel3d.config import config_from_dict
    from parallel3d.distributed import set_host_allocator
    from parallel3d.topology import Topology
    from parallel3d.train.trainer import Trainer

    set_host_allocator(job["launch"]["host_memory"])
    cfg = config_from_dict(job)
    if prepare is not None:
        prepare(cfg)
    t0 = time.perf_counter()
    trainer = Trainer(cfg, Topology.of(cfg.parallel), log=False)
    losses = [r["loss"] for r in trainer.fit()]
    return trainer, losses, time.perf_counter() - t0


def in_fresh_processes(fn, job: dict, world_size: int, timeout: float) -> list:
    """``fn(job)`` on each of ``world_size`` fresh spawned gloo processes: their results."""
    from parallel3d.testing import ProcessGroupPool

    pool = ProcessGroupPool(world_size, timeout=timeout, start_method="spawn")
    try:
        return pool.run(fn, job)
    finally:
        pool.close()
