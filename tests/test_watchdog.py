"""The report of a stuck collective where the backend never raises (NCCL): the
heartbeat thread's watchdog, exercised on gloo with the groups' own timeout far away."""

from __future__ import annotations

import re
import time

import pytest

from parallel3d.config import config_from_dict
from parallel3d.reliability import CommWatch, backend_timeout_s, wants_watchdog
from parallel3d.testing import DistributedTestError, ProcessGroupPool
from parallel3d.topology import Topology
from parallel3d.train.trainer import Trainer

from helpers import POOL_START, stall_rank_at, tiny_job


def _stuck_run(job: dict, stall_rank: int, stall_step: int, stall_s: float) -> None:
    """pp=2 x dp=2 with the watchdog on; ``stall_rank`` sleeps in ``stall_step``, the
    others block in their collectives until the watchdog ends their process."""
    cfg = config_from_dict(job)
    rel = cfg.reliability
    topo = Topology(1, 2, 2, timeout_s=backend_timeout_s(True, rel.comm_timeout_s))
    watch = CommWatch.for_process_group(topo, rel.comm_timeout_s, rel.heartbeat_s,
                                        watchdog=True, dump_dir=cfg.run.dir)
    watch.exit_on_stall = False  # the test reads every rank's report, then ends the pool
    trainer = Trainer(cfg, topo, watch=watch)
    stall_rank_at(trainer, stall_rank, stall_step, stall_s)
    while trainer.step < cfg.train.steps:
        trainer.train_step()


def test_watchdog_reports_a_stuck_collective_before_the_backend_times_out(corpus_dir, tmp_path):
    timeout = 5.0
    job = tiny_job(corpus_dir, str(tmp_path), parallel={"pp": 2, "dp": 2}, train={"steps": 4},
                   reliability={"comm_timeout_s": timeout, "heartbeat_s": 1.0})
    # the groups' own timeout (what NCCL's watchdog would act on) is a minute away: only
    # our watchdog can end this within the test's time
    assert backend_timeout_s(True, timeout) >= timeout + 60
    pool = ProcessGroupPool(4, timeout=90, start_method=POOL_START)
    reports = [tmp_path / f"failure_rank{r}.txt" for r in range(4)]
    seen: list[float] = []

    def reported() -> bool:  # ranks 0-2 wrote their reports, and a second has passed
        if not seen and all(reports[r].exists() for r in (0, 1, 2)):
            seen.append(time.monotonic())
        return bool(seen) and time.monotonic() - seen[0] > 1.0

    try:
        # The ranks stay blocked (the watchdog only reports here): the pool ends them once
        # the reports are there. Start-up on a loaded machine can take tens of seconds;
        # the groups' own timeout, 65 s after step 3 began, would end the run otherwise
        # (as "failed", not "stopped").
        with pytest.raises(DistributedTestError, match="stopped"):
            pool.run(_stuck_run, job, 3, 3, 120.0, timeout=300, stop_when=reported)
    finally:
        pool.close(kill=True)
    assert all(reports[r].exists() for r in (0, 1, 2)), [r.name for r in reports if r.exists()]
    pattern = re.compile(r"rank (\d): (.+) on the (tp|pp|dp|mp|embed|world) group \[[\d, ]+\] failed "
                         r"at step 3 .*no progress for 5 s \(watchdog\)")
    for rank in (1, 2):  # the stalled rank's direct partners name it
        text = reports[rank].read_text()
        assert pattern.match(text), text
        assert "did not arrive: rank 3 at step 3 in forward/backward |" in text, text
    assert "rank 2: gradient sync on the dp group [2, 3]" in reports[2].read_text()


def test_the_watchdog_is_on_by_default_only_where_the_backend_cannot_report():
    assert wants_watchdog("auto", "nccl") and not wants_watchdog("auto", "gloo")
    assert wants_watchdog("on", "gloo") and not wants_watchdog("off", "nccl")
    assert backend_timeout_s(False, 300.0) == 300.0 and backend_timeout_s(True, 300.0) == 450.0


def test_the_watchdog_ends_a_stuck_process_with_status_4(tmp_path):
    """The exit path itself, in a process of its own (no process group needed): stuck in
    a collective for 1 s with no progress, the process ends with status 4 within seconds
    of getting stuck, long before its 600 s sleep would end."""
    import subprocess
    import sys

    code = ("import time\n"
            "from parallel3d.reliability import CommWatch\n"
            "from parallel3d.topology import Topology\n"
            f"w = CommWatch(Topology.single(), 1.0, 0.2, watchdog=True, dump_dir={str(tmp_path)!r})\n"
            "w.start(); w.step = 7; print(time.monotonic(), flush=True)\n"
            "w.enter('grad sync', 'dp'); time.sleep(600)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    ended = time.monotonic()  # CLOCK_MONOTONIC: one clock for every process of the machine
    assert done.returncode == 4, done.stderr
    # Timed from the moment it got stuck (the import of torch before it, seconds on a
    # loaded machine, is not the watchdog's): the 1 s limit, the 0.2 s heartbeat and the
    # time a loaded machine takes to wake the thread, report and exit.
    assert ended - float(done.stdout.split()[0]) < 10
    assert "rank 0: grad sync on the dp group [0] failed at step 7" in done.stderr
    assert (tmp_path / "failure_rank0.txt").read_text().startswith("rank 0: grad sync")
