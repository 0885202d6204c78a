"""An elastic job across two hosts (network namespaces, tests/hosts.py) that loses one and
gets it back: ``torchrun --nnodes 1:2 --max-restarts 3`` with ``parallel.dp = "auto"``. At
step ``KILL_AT`` every process of host 1 (its agent and its worker) is killed; the agent of
host 0 restarts its worker alone, which resumes from the last checkpoint at dp 1 with twice
the micro-batches. Host 1 then starts again; the job grows back to dp 2 from the last
checkpoint, and the run ends with the losses of one process that was never interrupted."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import time
from pathlib import Path

import pytest

from parallel3d.config import config_from_dict
from parallel3d.topology import Topology
from parallel3d.train.trainer import Trainer

from helpers import job_args, relative_diff, tiny_job_on
from hosts import hosts_or_skip

STEPS, INTERVAL, KILL_AT = 16, 2, 5
COMM_TIMEOUT_S = 30
TIMEOUT_S = 240
# torch 2.13's c10d rendezvous shares its TCP store with the workers; an agent that was rank
# 0 before keeps its store address from the first round and does not publish it in the
# next, so an agent that joins later waits for MASTER_ADDR until both time out (60 s): a
# host could not rejoin. With the sharing off every round publishes the address.
SHARED_STORE_OFF = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}

pytestmark = pytest.mark.usefixtures("one_thread")


def _job(prepared_dir: str, run_dir: Path, dp) -> dict:
    return tiny_job_on(prepared_dir, str(run_dir), parallel={"tp": 1, "pp": 1, "dp": dp},
                       train={"steps": STEPS}, checkpoint={"interval": INTERVAL, "keep": 0},
                       reliability={"comm_timeout_s": COMM_TIMEOUT_S}, launch={"threads_per_proc": 1})


def _records(path: Path) -> list[dict]:
    text = path.read_text() if path.exists() else ""
    return [json.loads(line) for line in text.split("\n")[:-1] if line]


def _wait_for(predicate, timeout: float, what: str, logs: list[Path]) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            tails = "\n".join(f"--- {log.name}\n" + "\n".join(log.read_text().splitlines()[-25:]) for log in logs)
            pytest.fail(f"timed out waiting for {what}\n{tails}")
        time.sleep(0.05)


def _worker_pid(hosts, i: int) -> int | None:
    """The pid of host ``i``'s worker (the process torchrun gave a RANK), if any."""
    for pid in subprocess.run(["ip", "netns", "pids", hosts.names[i]], capture_output=True,
                              text=True).stdout.split():
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(kv.startswith(b"RANK=") for kv in env):
            return int(pid)
    return None


def _term_pending_or_gone(pid: int) -> bool:
    """SIGTERM is pending on the (stopped) process, or it is gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return True
    pending = {line.split(":")[0]: int(line.split()[1], 16) for line in status.splitlines()
               if line.startswith(("SigPnd", "ShdPnd"))}
    return any(mask & (1 << (signal.SIGTERM - 1)) for mask in pending.values()) or "State:\tZ" in status


def test_a_lost_host_leaves_the_job_at_half_the_dp_and_rejoins(prepared_dir, tmp_path):
    """Host 1 killed at step KILL_AT: host 0 goes on alone at dp 1. Host 1 then starts again
    (a new agent, the same command): host 0's agent sees it wait at the rendezvous and
    restarts its worker, and the job ends at the full world. Host 0's worker is held
    (SIGSTOP) from its first step alone until the agent has told it to stop, so that the
    rejoin lands inside the run whatever this machine's speed."""
    reference = [r["loss"] for r in Trainer(config_from_dict(_job(prepared_dir, tmp_path / "one", 1)),
                                             Topology(1, 1, 1), log=False).fit()]
    run = tmp_path / "run"
    args = job_args(_job(prepared_dir, run, "auto"))
    port = random.randrange(20000, 60000)
    logs = [tmp_path / "host0.log", tmp_path / "host1.log", tmp_path / "host1-again.log"]
    extra = ["--max-restarts", "3", "--monitor-interval", "0.2"]
    # last_call_timeout: how long a rendezvous that has its minimum of agents waits for
    # more (torchrun's default 30 s, the largest part of the recovery: 43 s of 55 with it);
    # 10 s is still ample for the two agents of the first rendezvous to meet. keep_alive_*:
    # a dead agent is dropped from the rendezvous after interval x attempts (default 5 x 3).
    conf = "last_call_timeout=10,keep_alive_interval=1,keep_alive_max_attempt=3"
    metrics = run / "metrics.jsonl"

    def resizes() -> list[dict]:
        return [r for r in _records(metrics) if r.get("event") == "resize"]

    with hosts_or_skip(2) as hosts:
        command = [hosts.torchrun(i, "1:2", 1, port, f"p3d-{port}", args, extra, conf) for i in range(2)]
        agents = [hosts.popen(i, command[i], logs[i], SHARED_STORE_OFF) for i in range(2)]
        _wait_for(lambda: any(r.get("step", 0) >= KILL_AT and "loss" in r for r in _records(metrics)),
                  TIMEOUT_S, f"step {KILL_AT}", logs)
        killed_at = time.time()
        hosts.kill(1)
        _wait_for(lambda: resizes(), TIMEOUT_S, "the resize to one host", logs)
        alone = _worker_pid(hosts, 0)
        os.kill(alone, signal.SIGSTOP)
        agents.append(hosts.popen(1, command[1], logs[2], SHARED_STORE_OFF))
        try:
            _wait_for(lambda: _term_pending_or_gone(alone), TIMEOUT_S, "host 0's agent to stop its worker", logs)
        finally:
            os.kill(alone, signal.SIGCONT)
        codes = []
        for agent in (agents[0], agents[2]):
            try:
                codes.append(agent.wait(timeout=TIMEOUT_S))
            except subprocess.TimeoutExpired:
                codes.append("timeout")
        if codes != [0, 0]:
            _wait_for(lambda: False, 0, f"the agents to finish (exit codes {codes})", logs)
    records = _records(metrics)
    steps = [r for r in records if "event" not in r]
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    # fp32: dp 2 and dp 1 sum the same per-token gradients in another order (all-reduce,
    # micro-batch accumulation), a few ulps per op; 1e-5 relative is every layout test's bar.
    assert relative_diff([r["loss"] for r in steps], reference) < 1e-5
    events = resizes()
    print("resize events:", events)
    assert [(r["from_world"], r["to_world"]) for r in events] == [(2, 1), (1, 2)], events
    assert json.loads((run / "config.json").read_text())["parallel"]["dp"] == 2  # ended at the full world
    lost, back = events
    # resumed from the last checkpoint before the kill (a step past KILL_AT may have been
    # logged, and checkpointed, between the test's read of metrics.jsonl and the kill)
    assert lost["step"] % INTERVAL == 0 and KILL_AT - INTERVAL < lost["step"] <= KILL_AT + 1, lost
    assert back["step"] % INTERVAL == 0 and back["step"] >= lost["step"], back
    # the time from the loss to the first step after it: at most comm_timeout + 30 s (the
    # issue's bound on this machine), measured from the kill and from the last step logged
    since_kill = lost["time"] - killed_at
    assert 0 < since_kill <= COMM_TIMEOUT_S + 30, (since_kill, lost)
    assert lost["recovery_s"] <= COMM_TIMEOUT_S + 30, lost


def test_dp_auto_is_the_world_over_the_fixed_axes():
    from parallel3d.config import load_config
    from parallel3d.errors import UserError
    from parallel3d.reliability.elastic import resolve_dp

    cfg = load_config(None, ["--parallel.tp=2", "--parallel.pp=2", '--parallel.dp="auto"'])
    assert cfg.parallel.dp == "auto"
    assert resolve_dp(cfg, 8).parallel.dp == 2 and resolve_dp(cfg, 4).parallel.dp == 1
    assert resolve_dp(resolve_dp(cfg, 8), 4).parallel.dp == 2  # a number is kept
    with pytest.raises(UserError, match=r"world of 6 ranks is not a multiple of tp 2 x pp 2 x cp 1 = 4"):
        resolve_dp(cfg, 6)
    with pytest.raises(UserError, match="parallel.dp"):
        load_config(None, ['--parallel.dp="many"'])
