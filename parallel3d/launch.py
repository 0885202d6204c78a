"""Starting the local worker processes when the user did not use torchrun.

``parallel3d train`` on a laptop: if the environment has no torchrun variables and
``launch.nproc > 1``, it starts ``launch.nproc`` workers through torch's own elastic
launcher (the machinery behind ``torchrun --standalone``: a c10d rendezvous on a free
localhost port). Under torchrun, SLURM or the DeepSpeed launcher the worker runs in the
calling process instead.
"""

from __future__ import annotations

import logging
import sys
import uuid

from parallel3d.errors import EXIT_USAGE


def launch_local(entrypoint, args: tuple, nproc: int) -> int:
    """Run ``entrypoint(*args)`` on ``nproc`` local ranks; return an exit status."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    # The elastic agent logs every rendezvous detail, and a traceback of its own for each
    # failed worker, which already printed its own reason: keep the console for ours.
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    logging.getLogger("torch.multiprocessing").setLevel(logging.ERROR)
    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=str(uuid.uuid4()),
        rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=0,
        monitor_interval=0.1, start_method="spawn",
    )
    try:
        elastic_launch(config, entrypoint)(*args)
    except ChildFailedError as e:
        codes = sorted({f.exitcode for f in e.failures.values()})
        if codes == [EXIT_USAGE]:
            return EXIT_USAGE  # the worker already printed the one-line reason
        first_rank, failure = min(e.failures.items())
        print(f"parallel3d: error: worker rank {first_rank} failed with exit code "
              f"{failure.exitcode} ({len(e.failures)} of {nproc} workers failed)",
              file=sys.stderr, flush=True)
        return 1
    return 0
