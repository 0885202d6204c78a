"""Elastic runs: the data-parallel degree taken from the world the launcher gives, and a
record of each change of size.

Under ``torchrun --nnodes MIN:MAX --max-restarts N`` the agents restart their workers when
a host is lost (a worker fails) or one joins (a node waits at the rendezvous); the new
workers may see another ``WORLD_SIZE``. With ``parallel.dp = "auto"`` the layout follows:
``dp = world / (tp * pp * cp)``, tp / pp / cp fixed. The global batch is the config's, so
each dp rank accumulates ``global_batch / (micro_batch * dp)`` micro-batches: half the dp
ranks, twice the micro-batches, the same sum of per-token gradients, the same step. The
workers resume from the last checkpoint as any restart does (read by slices, so at the new
dp); the steps the lost world made after it are made again.

:class:`SizeChange` writes one ``{"event": "resize"}`` line into metrics.jsonl at the first
step after such a restart: the world before and after, and the time each part of the
recovery took, from the last step the previous world logged (the loss happened after it)
to the first forward pass of the new world.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path

from parallel3d.errors import UserError


def resolve_dp(cfg, world: int):
    """``cfg`` with ``parallel.dp = "auto"`` replaced by ``world / (tp * pp * cp)``; any
    other ``cfg`` unchanged."""
    par = cfg.parallel
    if par.dp != "auto":
        return cfg
    fixed = par.tp * par.pp * par.cp
    if world % fixed:
        raise UserError(f"parallel.dp = \"auto\": the world of {world} ranks is not a multiple of "
                        f"tp {par.tp} x pp {par.pp} x cp {par.cp} = {fixed}; start a multiple of {fixed} "
                        "processes or set parallel.dp")
    return dataclasses.replace(cfg, parallel=dataclasses.replace(par, dp=world // fixed))


def _process_start_time() -> float:
    """When this process started (Unix time), from /proc; now where that is not there."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        boot = next(float(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                    if line.startswith("btime"))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return time.time()


def _world_of(parallel: dict) -> int:
    return parallel["tp"] * parallel["pp"] * parallel.get("cp", 1) * parallel["dp"]


class SizeChange:
    """What a restarted worker knows about the world before it, read from the run
    directory before the new trainer overwrites ``config.json`` and truncates
    ``metrics.jsonl``. A resumed run whose world differs from the last one's logs the event
    (a relaunch by hand at another size too: its ``recovery_s`` is then the whole pause)."""

    def __init__(self, run_dir: str, world: int, restart: int):
        self.started = _process_start_time()
        self.world, self.restart = world, restart
        config, metrics = Path(run_dir) / "config.json", Path(run_dir) / "metrics.jsonl"
        self.previous = None
        # Any start that finds an earlier run's files: a host that rejoins may hold rank 0
        # and its agent's restart count is 0.
        if config.exists() and metrics.exists():
            try:
                self.previous = _world_of(json.loads(config.read_text())["parallel"])
            except (ValueError, KeyError, TypeError):
                self.previous = None
            # the previous world's last sign of life: its last step record
            self.last_logged = metrics.stat().st_mtime
        self.group_ready = self.loaded = None

    @classmethod
    def from_env(cls, run_dir: str) -> "SizeChange":
        return cls(run_dir, int(os.environ.get("WORLD_SIZE", "1")),
                   int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")))

    def mark_group_ready(self) -> None:
        self.group_ready = time.time()

    def watch(self, trainer) -> None:
        """Log the event at the new world's first forward pass, if the size changed."""
        self.loaded = time.time()
        if self.previous is None or self.previous == self.world or trainer.checkpointer.resumed_from is None:
            return

        def hook(t) -> None:
            t.step_hooks.remove(hook)
            t.log_event(self.event(t.step, time.time()))

        trainer.step_hooks.append(hook)

    def event(self, step: int, first_forward: float) -> dict:
        ready = self.group_ready or self.started
        return {"event": "resize", "step": step, "time": round(first_forward, 3), "restart": self.restart,
                "from_world": self.previous, "to_world": self.world,
                "recovery_s": round(first_forward - self.last_logged, 3),
                "phases_s": {"detect_restart_rendezvous": round(self.started - self.last_logged, 3),
                             "start_and_process_groups": round(ready - self.started, 3),
                             "build_and_load": round(self.loaded - ready, 3),
                             "first_forward": round(first_forward - self.loaded, 3)}}
