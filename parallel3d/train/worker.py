"""What each worker process runs: join the group, build the topology, train."""

from __future__ import annotations

import os
import sys

import torch.distributed as dist

from parallel3d.config import JobConfig, config_from_dict
from parallel3d.distributed import (device_for, init_from_env, pick_backend, set_cpu_threads,
                                    under_torchrun)
from parallel3d.errors import EXIT_USAGE, UserError
from parallel3d.topology import Topology
from parallel3d.train.trainer import Trainer


def run_training(cfg: JobConfig) -> list[dict]:
    """Train in this process: under torchrun (or our launch) as one rank of the world,
    otherwise as a world of one without any process group."""
    backend = pick_backend(cfg.launch.backend)
    set_cpu_threads(cfg.launch.threads_per_proc)
    if under_torchrun():
        init_from_env(backend)
        topo = Topology(cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.dp)
    else:
        topo = Topology(cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.dp, rank=0, world_size=1)
    try:
        return Trainer(cfg, topo, device_for(backend)).fit()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def worker_main(cfg_dict: dict) -> None:
    """Entry point of a launched worker (picklable: a module-level function)."""
    try:
        run_training(config_from_dict(cfg_dict))
    except UserError as e:
        # Config checks are deterministic, so every rank raises the same error: say it once.
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"parallel3d: error: {e}", file=sys.stderr, flush=True)
        sys.exit(EXIT_USAGE)
