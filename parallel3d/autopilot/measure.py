"""A layout's step as measured: medians over a window of completed step records.

Every rank completes the same records (their per-rank figures arrive in the step's one
closing collective, summed over the world), so every rank computes the same medians
without communicating.
"""

from __future__ import annotations

import os
import statistics

from parallel3d.planner.fitted import Measured
from parallel3d.planner.spec import Layout

FIELDS = ("step_time_s", "cpu_s", "cpu_fwd_bwd_s", "max_busy_s", "comm_exposed_s", "bubble_s")


def measure(records: list[dict], layout: Layout) -> Measured:
    """Medians of ``records`` (complete step records of ``layout``; skipped steps left out)."""
    rows = [r for r in records if not r.get("skipped") and all(k in r for k in FIELDS)]
    if not rows:
        raise ValueError("no complete step records to measure")
    med = {k: statistics.median(r[k] for r in rows) for k in FIELDS}
    return Measured(layout=layout, step_s=med["step_time_s"], cpu_s=med["cpu_s"],
                    cpu_fwd_bwd_s=med["cpu_fwd_bwd_s"], busy_max_s=med["max_busy_s"],
                    comm_exposed_s=med["comm_exposed_s"], bubble_s=med["bubble_s"], steps=len(rows))


def host_cores() -> int:
    """Cores this process may run on (its affinity mask; the machine's count without one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def ranks_per_host(world: int) -> int:
    """Ranks on this host: torchrun's (and our launcher's) LOCAL_WORLD_SIZE, else the world."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("LOCAL_SIZE", world)))
