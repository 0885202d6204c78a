"""What each worker process runs: join the group, build the topology, train.

Failures a worker reports itself, with its exit status (``parallel3d.errors``): a bad
config (2, rank 0 prints it), a non-finite step under ``on_nonfinite = "stop"`` (3,
rank 0), a collective that timed out or lost a peer (4, every rank that sees it prints
:meth:`~parallel3d.reliability.CommWatch.report` and leaves without touching the broken
process group).
"""

from __future__ import annotations

import os
import sys

import torch.distributed as dist

from parallel3d.config import JobConfig, config_from_dict
from parallel3d.distributed import (device_for, init_from_env, pick_backend, set_cpu_threads, set_host_allocator,
                                    under_torchrun)
from parallel3d.errors import EXIT_COMM, EXIT_STOPPED, EXIT_USAGE, UserError
from parallel3d.reliability import (CommFailure, CommWatch, TrainingStopped, backend_timeout_s,
                                    comm_failures_reported, enable_flight_recorder, wants_watchdog)
from parallel3d.reliability.elastic import SizeChange
from parallel3d.topology import Topology
from parallel3d.train.pilot import fit_with_autopilot, timed_trainer
from parallel3d.train.trainer import Trainer


def run_training(cfg: JobConfig) -> list[dict]:
    """Train in this process: under torchrun (or our launch) as one rank of the world,
    otherwise as a world of one without any process group. A stop on a non-finite step
    saves through the trainer's own checkpoint hook (``Trainer.on_stop``).

    A failed collective raises :class:`CommFailure` whose message is the full report."""
    backend = pick_backend(cfg.launch.backend)
    set_cpu_threads(cfg.launch.threads_per_proc)
    if backend == "gloo":
        set_host_allocator(cfg.launch.host_memory)  # what freed buffers cost (launch.host_memory)
    rel = cfg.reliability
    watchdog = wants_watchdog(rel.watchdog, backend)
    sizes = None
    if under_torchrun():
        sizes = SizeChange.from_env(cfg.run.dir)  # before the trainer rewrites the run dir
        enable_flight_recorder(backend)
        timeout_s = backend_timeout_s(watchdog, rel.comm_timeout_s)
        init_from_env(backend, timeout_s)
        sizes.mark_group_ready()
        topo = Topology.of(cfg.parallel, timeout_s=timeout_s)
    else:
        topo = Topology.of(cfg.parallel, rank=0, world_size=1)
    watch = CommWatch.for_process_group(topo, rel.comm_timeout_s, rel.heartbeat_s,
                                        watchdog=watchdog and topo.world_size > 1, dump_dir=cfg.run.dir)
    device = device_for(backend)

    def make_trainer(job: JobConfig, grid: Topology) -> Trainer:
        return Trainer(job, grid, device, watch=watch)

    group_sound = False  # the group is torn down only after an orderly end (see below)
    try:
        with comm_failures_reported(watch, passthrough=(UserError, TrainingStopped)):
            trainer, build_s = timed_trainer(lambda: make_trainer(cfg, topo))
            if sizes is not None:
                sizes.watch(trainer)  # a "resize" event at the first step after a change of world
            if cfg.train.autopilot:
                history = fit_with_autopilot(trainer, make_trainer, build_s)
            else:
                history = trainer.fit()
        group_sound = True
    except (UserError, TrainingStopped):
        group_sound = True  # every rank reaches the same verdict: nothing is left in flight
        raise
    finally:
        watch.close()
        # A gloo group left to the interpreter's exit can abort the process (its worker
        # threads outlive the interpreter: SIGABRT, exit 4 instead of 2); a failed
        # collective's group is left alone (run_worker exits at once).
        if group_sound and dist.is_initialized():
            dist.destroy_process_group()
    return history


def run_worker(cfg_dict: dict) -> int:
    """Train as this process's rank; return the exit status, having printed the reason of
    any failure (see the module docstring)."""
    # Config checks and the non-finite decision are the same on every rank: say it once.
    rank0 = int(os.environ.get("RANK", "0")) == 0
    try:
        run_training(config_from_dict(cfg_dict))
    except UserError as e:
        if rank0:
            print(f"parallel3d: error: {e}", file=sys.stderr, flush=True)
        return EXIT_USAGE
    except TrainingStopped as e:
        if rank0:
            print(f"parallel3d: stopped: {e}", file=sys.stderr, flush=True)
        return EXIT_STOPPED
    except CommFailure as e:
        print(f"parallel3d: error: {e}", file=sys.stderr, flush=True)
        # The process group is broken: tearing it down can block (NCCL) or fail, and the
        # peers are gone or leaving; exit now.
        sys.stdout.flush()
        os._exit(EXIT_COMM)
    return 0


def worker_main(cfg_dict: dict) -> None:
    """Entry point of a launched worker (picklable: a module-level function)."""
    code = run_worker(cfg_dict)
    if code:
        sys.exit(code)
