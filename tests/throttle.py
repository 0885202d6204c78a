"""A CPU quota on chosen processes (cgroup v1's cpu controller, as root): a host or a
rank made slow the way a noisy neighbour or a throttled CPU makes it, for the straggler
tests and benchmarks/bench_straggler.py.

    with cpu_quota(0.5) as group:   # half a core (cpu_quota(None, shares=...): a weight only)
        join(group, pid)            # the process and its threads, and what it starts later
        ...
        leave(group, pid)           # back to the group it came from (or the root)

The group is removed on exit; processes still in it go back to the root group first.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path

CPU_ROOT = Path("/sys/fs/cgroup/cpu")
PERIOD_US = 10_000  # short: a step of tens of ms is held back evenly, not in 50 ms bursts


def can_throttle() -> str:
    """Why a quota cannot be set here ("" when it can)."""
    if os.geteuid() != 0:
        return "needs root (a cgroup of its own)"
    if not (CPU_ROOT / "cpu.cfs_quota_us").exists():
        return f"no cgroup v1 cpu controller at {CPU_ROOT}"
    return ""


# The weight of a "host" group against the machine's other processes (1024 each): on a
# shared 2-core machine a host of one process gets its core, as a host of its own would
# (the other agents' processes would otherwise give it half a core and a quota of half a
# core would not bind). The largest weight cgroup v1 takes: two such groups get 95% of two
# cores beside 30 busy processes.
HOST_SHARES = 262144


@contextmanager
def cpu_quota(cores: float | None, name: str = "p3d-throttle", shares: int = 1024):
    """A cgroup whose processes together get at most ``cores`` CPUs (CFS quota over a 10 ms
    period; None: no quota) and a weight of ``shares`` against other groups and processes."""
    group = CPU_ROOT / f"{name}-{os.getpid()}"
    group.mkdir()
    try:
        (group / "cpu.shares").write_text(str(shares))
        if cores is not None:
            (group / "cpu.cfs_period_us").write_text(str(PERIOD_US))
            (group / "cpu.cfs_quota_us").write_text(str(int(cores * PERIOD_US)))
        yield group
    finally:
        for pid in (group / "cgroup.procs").read_text().split():
            try:
                (CPU_ROOT / "cgroup.procs").write_text(pid)
            except OSError:  # it ended meanwhile
                pass
        group.rmdir()


def join(group: Path, pid: int | None = None) -> None:
    """Put process ``pid`` (default: this one) with all its threads into ``group``."""
    (group / "cgroup.procs").write_text(str(pid or os.getpid()))


def leave(group: Path, pid: int | None = None) -> None:
    """Put ``pid`` (default: this one) back into the root cpu group."""
    (CPU_ROOT / "cgroup.procs").write_text(str(pid or os.getpid()))


def throttled_seconds(group: Path) -> float:
    """Seconds the group's processes were held back by the quota (cpu.stat)."""
    stat = dict(line.split() for line in (group / "cpu.stat").read_text().splitlines())
    return int(stat.get("throttled_time", 0)) / 1e9
