"""Restart without loss: a worker killed under ``torchrun --max-restarts=1`` between two
checkpoints; the restarted workers resume from the last complete checkpoint and give,
step for step, the losses of a run that was never interrupted.

Nothing in the trainer knows about this test. The test watches rank 0's
``metrics.jsonl`` and the ``latest`` pointer of the checkpoints folder; as soon as a step
past the last complete checkpoint is logged, it freezes both workers (SIGSTOP), reads the
state they are frozen in, and, if at least two finished steps are not yet in a checkpoint
(e.g. step 6 logged, step 4 the last checkpoint), kills rank 0 (SIGKILL). (Frozen closer
to a checkpoint, it lets them go on and tries at the next step.) Rank 0 is the one killed because it alone completes a checkpoint (index, rename,
``latest``) and writes the metrics: what the test read while both were frozen is then
final. The workers are found as the torchrun agent's children, their ranks read from
their environment (``RANK``, ``TORCHELASTIC_RESTART_COUNT``), as torchrun set them.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import job_args, tiny_job

ROOT = Path(__file__).resolve().parents[1]
STEPS, INTERVAL = 24, 4
LOST = 2  # at least this many logged steps after the last checkpoint die with rank 0


def _job(corpus_dir: str, run_dir: Path) -> dict:
    # The default recipe's dp side (ZeRO-1 over 2 ranks) without tp/pp, so the resumed
    # state includes sharded optimizer state; one thread per worker on this 2-core machine.
    return tiny_job(corpus_dir, str(run_dir), parallel={"tp": 1, "pp": 1, "dp": 2},
                    train={"steps": STEPS}, checkpoint={"interval": INTERVAL, "keep": 0},
                    launch={"threads_per_proc": 1})


def _torchrun(job: dict, log: Path) -> subprocess.Popen:
    # nice: the workers yield the cores to this test's watcher, so it sees each step
    # while it is the newest rather than several steps late.
    cmd = ["nice", "-n", "15", sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc-per-node", "2", "--max-restarts=1", "--monitor-interval=0.2", "--log-dir", str(log.parent / "agent"),
           "-m", "parallel3d.cli", "train", *job_args(job)]
    with open(log, "w") as f:
        return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True)


def _workers(agent_pid: int) -> dict[int, int]:
    """rank -> pid of the agent's worker processes of the current attempt."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            if ppid != agent_pid:
                continue
            env = dict(kv.split("=", 1) for kv in
                       Path(f"/proc/{entry}/environ").read_bytes().decode().split("\0") if "=" in kv)
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile
        if "RANK" in env:
            found[int(env["RANK"])] = int(entry)
    return found


def _records(path: Path) -> list[dict]:
    """The complete lines of a metrics file (a line being written is left out)."""
    text = path.read_text() if path.exists() else ""
    return [json.loads(line) for line in text.split("\n")[:-1] if line]


def _latest_step(root: Path) -> int:
    try:
        return int((root / "latest").read_text().strip().removeprefix("step_"))
    except (OSError, ValueError):
        return 0


def _kill_between_checkpoints(agent: subprocess.Popen, run_dir: Path, timeout: float) -> dict:
    """Freeze the workers at the first logged step at least LOST steps past the last
    complete checkpoint (itself past the first one), then SIGKILL rank 0. Returns what
    it saw."""
    metrics, root = run_dir / "metrics.jsonl", run_dir / "checkpoints"
    deadline = time.monotonic() + timeout
    seen = 0
    while time.monotonic() < deadline:
        assert agent.poll() is None, "the run ended before a worker could be killed between checkpoints"
        records = _records(metrics)
        step = records[-1]["step"] if records else 0
        if step > seen and step >= INTERVAL + LOST and step - _latest_step(root) >= LOST:
            seen = step
            workers = _workers(agent.pid)
            if sorted(workers) != [0, 1]:
                continue
            for pid in workers.values():
                os.kill(pid, signal.SIGSTOP)
            # Frozen: nothing moves until we decide. Re-read what they left.
            logged = _records(metrics)[-1]["step"]
            last_ckpt = _latest_step(root)
            if INTERVAL <= last_ckpt <= logged - LOST:
                os.kill(workers[0], signal.SIGKILL)
                os.kill(workers[1], signal.SIGCONT)  # let it find its peer gone
                return {"logged": logged, "checkpoint": last_ckpt, "killed_pid": workers[0]}
            for pid in workers.values():  # stopped too close to a checkpoint: go on
                os.kill(pid, signal.SIGCONT)
        time.sleep(0.002)
    pytest.fail(f"no step past a checkpoint was seen within {timeout} s")


def _wait(proc: subprocess.Popen, log: Path, timeout: float) -> None:
    try:
        code = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        code = "timeout"
    if code != 0:
        pytest.fail(f"torchrun exited with {code}\n" + "\n".join(log.read_text().splitlines()[-30:]))


def test_killed_worker_restarts_from_the_last_checkpoint_with_the_same_losses(corpus_dir, tmp_path):
    straight_dir, killed_dir = tmp_path / "straight", tmp_path / "killed"
    straight = _torchrun(_job(corpus_dir, straight_dir), tmp_path / "straight.log")
    killed = _torchrun(_job(corpus_dir, killed_dir), tmp_path / "killed.log")
    try:
        seen = _kill_between_checkpoints(killed, killed_dir, timeout=90)
        _wait(killed, tmp_path / "killed.log", timeout=120)
        _wait(straight, tmp_path / "straight.log", timeout=120)
    finally:
        for proc in (straight, killed):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()

    log = (tmp_path / "killed.log").read_text()
    # torchrun restarted the workers once, and they resumed from the checkpoint that was
    # the last complete one when rank 0 died, not a later or an earlier one
    resumed = re.findall(r"resuming from (\S+) at step (\d+)", log)
    assert len(resumed) == 1, log[-3000:]
    assert Path(resumed[0][0]).name == f"step_{seen['checkpoint']:08d}"
    assert int(resumed[0][1]) == seen["checkpoint"] <= seen["logged"] - LOST, seen

    want = _records(straight_dir / "metrics.jsonl")
    assert [r["step"] for r in want] == list(range(1, STEPS + 1))
    # metrics.jsonl of the killed run: every step once, in order; the steps it made after
    # its last checkpoint (lost with rank 0, repeated after the restart) were moved aside
    got = _records(killed_dir / "metrics.jsonl")
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    moved = [r for p in sorted(killed_dir.glob("metrics.*.jsonl")) for r in _records(p)]
    assert [r["step"] for r in moved] == list(range(seen["checkpoint"] + 1, seen["logged"] + 1))
    # Same layout, same seed, same operations on the same numbers: the losses and
    # gradient norms are bit for bit those of the uninterrupted run -- before the kill,
    # the steps the first attempt made and lost, and the ones the restart re-ran.
    for key in ("loss", "grad_norm", "lr"):
        assert [r[key] for r in got] == [r[key] for r in want], key
        assert [r[key] for r in moved] == [r[key] for r in want[seen["checkpoint"]:seen["logged"]]], key


def test_fresh_namespace_ignores_what_an_earlier_attempt_left_in_the_store():
    """Three ranks agree on a prefix no earlier attempt used, although the store holds a
    previous attempt's asks, answers and namespace (as torchrun's shared store does)."""
    import threading

    import torch.distributed as dist

    from parallel3d.distributed import fresh_namespace

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)

    def attempt() -> list[str]:
        got = [None] * 3

        def rank(r):
            client = dist.TCPStore("127.0.0.1", server.port, is_master=False, wait_for_workers=False)
            got[r] = fresh_namespace(client, r, 3, timeout_s=30)

        # ranks 1 and 2 first: they must not take the earlier attempt's answers
        threads = [threading.Thread(target=rank, args=(r,)) for r in (2, 1, 0)]
        for t in threads:
            t.start()
            time.sleep(0.05)
        for t in threads:
            t.join(60)
        return got

    first = attempt()
    second = attempt()
    assert len(set(first)) == 1 and len(set(second)) == 1, (first, second)
    assert first[0] != second[0]
    assert server.check([f"{second[0]}/joined/1", f"{second[0]}/joined/2"])
