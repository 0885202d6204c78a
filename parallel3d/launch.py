"""Starting the local worker processes when the user did not use torchrun.

``parallel3d train`` on a laptop: if the environment has no torchrun variables and
``launch.nproc > 1``, it starts ``launch.nproc`` workers through torch's own elastic
launcher (the machinery behind ``torchrun --standalone``: a c10d rendezvous on a free
localhost port). Under torchrun, SLURM or the DeepSpeed launcher the worker runs in the
calling process instead.
"""

from __future__ import annotations

import logging
import os
import sys
import tempfile
import uuid

from parallel3d.errors import EXIT_COMM, EXIT_STOPPED, EXIT_USAGE


def job_nodes(world: int, configured: int) -> int:
    """The hosts a job runs on. Under a launcher, what it set: torchrun's
    ``GROUP_WORLD_SIZE`` (its agents, one per host), else ``WORLD_SIZE`` over the processes
    per host (``LOCAL_WORLD_SIZE``, DeepSpeed's ``LOCAL_SIZE``). Started by parallel3d
    itself (no ``RANK`` in the environment), ``configured`` (``launch.nnodes``)."""
    env = os.environ
    if "RANK" not in env or "WORLD_SIZE" not in env:
        return configured
    if env.get("GROUP_WORLD_SIZE", "").isdigit():
        return int(env["GROUP_WORLD_SIZE"])
    local = env.get("LOCAL_WORLD_SIZE", env.get("LOCAL_SIZE", ""))
    return max(1, world // int(local)) if local.isdigit() and int(local) > 0 else configured


def launch_local(entrypoint, args: tuple, nproc: int) -> int:
    """Run ``entrypoint(*args)`` on ``nproc`` local ranks; return an exit status."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    # The elastic agent logs every rendezvous detail, and a traceback of its own for each
    # failed worker, which already printed its own reason: keep the console for ours.
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    logging.getLogger("torch.multiprocessing").setLevel(logging.ERROR)
    # the agent's per-attempt folders (the workers' error files), removed after the run:
    # left to torch, each launch would leave a /tmp/torchelastic_* behind
    with tempfile.TemporaryDirectory(prefix="p3d-elastic-") as logs:
        config = LaunchConfig(
            min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=str(uuid.uuid4()),
            rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=0,
            monitor_interval=0.1, start_method="spawn", logs_specs=DefaultLogsSpecs(log_dir=logs),
        )
        try:
            elastic_launch(config, entrypoint)(*args)
        except ChildFailedError as e:
            return _report_failures(e.failures, nproc)
    return 0


def _report_failures(failures: dict, nproc: int) -> int:
    """One line naming the worker that failed first (a signal before an exit status:
    a killed worker makes its peers fail after it); the workers printed their reasons."""
    codes = {f.exitcode for f in failures.values()}
    if codes == {EXIT_USAGE}:
        return EXIT_USAGE  # the worker already printed the one-line reason
    if codes == {EXIT_STOPPED}:
        return EXIT_STOPPED  # rank 0 printed why (reliability.on_nonfinite = "stop")
    killed = {r: f for r, f in failures.items() if f.exitcode < 0}
    if not killed and codes == {EXIT_COMM}:
        # A worker that saw a collective fail exited first; its report (above) names the
        # operation, the group and the rank that was lost or late.
        print(f"parallel3d: error: communication failed ({len(failures)} of {nproc} workers "
              "reported it above); the launcher stopped the others", file=sys.stderr, flush=True)
        return EXIT_COMM
    rank, failure = min(killed.items()) if killed else min(failures.items())
    how = (f"was killed by {failure.signal_name()}" if failure.exitcode < 0
           else f"failed with exit code {failure.exitcode}")
    print(f"parallel3d: error: lost worker rank {rank} (pid {failure.pid}): it {how}; "
          f"{len(failures)} of {nproc} workers failed, the launcher stopped the others",
          file=sys.stderr, flush=True)
    return EXIT_COMM if killed or EXIT_COMM in codes else 1
