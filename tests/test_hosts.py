"""Jobs across hosts: network namespaces on this machine (tests/hosts.py), each host its own
address on one switch, a torchrun agent (or the SLURM script's srun step) on each. Every
run must give one process's losses at the same global batch, and the banner must count
the hosts."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest

from parallel3d.cli import default_recipe
from parallel3d.config import config_from_dict
from parallel3d.topology import Topology
from parallel3d.train.trainer import Trainer

from helpers import job_args, relative_diff, tiny_job_on
from hosts import IFNAME, hosts_or_skip

ROOT = Path(__file__).resolve().parents[1]
SBATCH = ROOT / "recipes" / "slurm" / "train.sbatch"
STEPS = 4
TIMEOUT_S = 180

pytestmark = pytest.mark.usefixtures("one_thread")


def _job(prepared_dir: str, run_dir: Path, tp: int, pp: int, dp: int) -> dict:
    # One thread per process: 4 workers and 2 agents share this machine's cores.
    return tiny_job_on(prepared_dir, str(run_dir), parallel={"tp": tp, "pp": pp, "dp": dp},
                       train={"steps": STEPS}, eval={"interval": 2, "batches": 1},
                       launch={"threads_per_proc": 1})


@pytest.fixture(scope="module")
def reference(prepared_dir, tmp_path_factory):
    """One process, the same global batch: (losses, validation losses)."""
    job = _job(prepared_dir, tmp_path_factory.mktemp("ref"), 1, 1, 1)
    history = Trainer(config_from_dict(job), Topology(1, 1, 1), log=False).fit()
    return [r["loss"] for r in history], [r["val_loss"] for r in history if "val_loss" in r]


def _port() -> int:
    # Each run has its own namespaces, so any port is free on the hosts' addresses.
    return random.randrange(20000, 60000)


def _wait_all(procs: list[subprocess.Popen], logs: list[Path]) -> None:
    try:
        codes = [p.wait(timeout=TIMEOUT_S) for p in procs]
    except subprocess.TimeoutExpired:
        codes = ["timeout"]
    if codes != [0] * len(procs):
        tails = "\n".join(f"--- {log.name}\n" + "\n".join(log.read_text().splitlines()[-20:]) for log in logs)
        pytest.fail(f"exit codes {codes}\n{tails}")


def _check_losses(run_dir: Path, reference) -> None:
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "event" not in r]
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    losses, val_losses = reference
    # fp32: the layouts add the same numbers in another order (micro-batches, all-reduce),
    # a few ulps per op; 1e-5 relative is the bar of every layout test.
    assert relative_diff([r["loss"] for r in steps], losses) < 1e-5
    assert relative_diff([r["val_loss"] for r in steps if "val_loss" in r], val_losses) < 1e-5


def test_job_nodes_reads_what_the_launcher_set(monkeypatch):
    from parallel3d.launch import job_nodes

    for key in ("RANK", "WORLD_SIZE", "GROUP_WORLD_SIZE", "LOCAL_WORLD_SIZE", "LOCAL_SIZE"):
        monkeypatch.delenv(key, raising=False)
    assert job_nodes(4, 3) == 3  # started by parallel3d itself: launch.nnodes
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "12")
    monkeypatch.setenv("LOCAL_SIZE", "4")  # DeepSpeed's launcher
    assert job_nodes(12, 1) == 3
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert job_nodes(12, 1) == 6
    monkeypatch.setenv("GROUP_WORLD_SIZE", "5")  # torchrun: its agents
    assert job_nodes(12, 1) == 5


def test_hosts_reach_each_other_on_their_link_only(tmp_path):
    """The helper itself: host 1 reaches host 0's address over the switch, and not while
    host 0's cable is out; this machine's own namespace has no such interface; the
    namespaces are gone after the block."""
    server = ("import socket; s = socket.socket(); s.bind(('{addr}', 5000)); s.listen(); "
              "print('up', flush=True)\nwhile True: s.accept()[0].sendall(b'hello')")
    client = ("import socket; s = socket.socket(); s.settimeout(2)\n"
              "try:\n    s.connect(('{addr}', 5000)); print(s.recv(5).decode())\n"
              "except OSError as e:\n    print('unreachable', type(e).__name__)")
    with hosts_or_skip(2) as hosts:
        names = list(hosts.names)
        hosts.popen(0, [sys.executable, "-c", server.format(addr=hosts.addr(0))], tmp_path / "srv.log")

        def ask() -> str:
            return subprocess.run(["ip", "netns", "exec", hosts.names[1], sys.executable, "-c",
                                   client.format(addr=hosts.addr(0))],
                                  capture_output=True, text=True, timeout=30).stdout.strip()

        for _ in range(100):  # until the server listens
            if "up" in (tmp_path / "srv.log").read_text():
                break
            time.sleep(0.1)
        assert ask() == "hello"
        hosts.set_link(0, up=False)
        assert ask() == "unreachable TimeoutError"  # the packets go nowhere: no answer at all
        hosts.set_link(0, up=True)
        assert ask() == "hello"
        assert IFNAME not in subprocess.run(["ip", "-br", "link"], capture_output=True, text=True).stdout
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(n in listed for n in names), listed


@pytest.mark.parametrize("layout", [pytest.param((2, 2, 1), id="tp2-in-host_pp2-across"),
                                    pytest.param((1, 1, 4), id="dp4-across")])
def test_torchrun_agents_on_two_hosts_train_as_one_process(layout, reference, prepared_dir, tmp_path):
    """2 hosts x 2 workers. tp 2 x pp 2: local ranks are contiguous and tp is innermost,
    so each tp pair is inside a host and the pipeline's two stages are on different hosts;
    pp 1 x dp 4: every all-reduce crosses the link."""
    tp, pp, dp = layout
    run = tmp_path / "run"
    args = job_args(_job(prepared_dir, run, tp, pp, dp))
    port = _port()
    logs = [tmp_path / "host0.log", tmp_path / "host1.log"]
    with hosts_or_skip(2) as hosts:
        procs = [hosts.popen(i, hosts.torchrun(i, 2, 2, port, f"p3d-{port}", args, log_dir=tmp_path / f"agent{i}"),
                             logs[i]) for i in range(2)]
        _wait_all(procs, logs)
    ran = json.loads((run / "config.json").read_text())["parallel"]
    assert (ran["tp"], ran["pp"], ran["dp"]) == layout
    _check_losses(run, reference)
    # the banner (rank 0, on whichever host the rendezvous made node 0) counts the hosts
    text = "".join(log.read_text() for log in logs)
    assert "4 ranks = tp" in text and "2 nodes x 2 processes" in text, text[-3000:]


FAKE_SRUN = """#!/usr/bin/env bash
# Stands in for srun: runs the command once per node of the allocation, all at once, node
# i on host i (its namespace) with SLURM_NODEID=i and a TMPDIR of its own (as SLURM's
# job-private /tmp: torchrun's agent puts its log folder there); fails if any node fails.
while [[ "$1" == --* ]]; do shift; done
pids=()
for ((i = 0; i < SLURM_JOB_NUM_NODES; i++)); do
    mkdir -p "$FAKE_OUT/tmp$i"
    SLURM_NODEID=$i TMPDIR="$FAKE_OUT/tmp$i" ip netns exec "$FAKE_HOST_PREFIX$i" "$@" > "$FAKE_OUT/node$i.log" 2>&1 &
    pids+=($!)
done
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=1; done
exit $rc
"""


def test_slurm_script_trains_across_two_hosts(reference, prepared_dir, tmp_path):
    """recipes/slurm/train.sbatch under a faked allocation of the two hosts: scontrol
    expands the node list to their addresses, srun starts each node's agent on its host.
    pp 2 x dp 2: the script's static node ranks put stage 0 on host 0, stage 1 on host 1."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(FAKE_SRUN)
    run = tmp_path / "run"
    args = job_args(_job(prepared_dir, run, 1, 2, 2))
    log = tmp_path / "sbatch.log"
    with hosts_or_skip(2) as hosts:
        (bin_dir / "scontrol").write_text(
            f'#!/bin/sh\n[ "$1 $2 $3" = "show hostnames hostns[0-1]" ] && '
            f'printf "{hosts.addr(0)}\\n{hosts.addr(1)}\\n"\n')
        for f in bin_dir.iterdir():
            f.chmod(0o755)
        env = hosts.env({"PATH": f"{bin_dir}:/usr/sbin:/usr/bin:/sbin:/bin", "SLURM_JOB_NODELIST": "hostns[0-1]",
                         "SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_ID": "77123", "SLURM_GPUS_PER_NODE": "2",
                         "MASTER_PORT": str(_port()), "PYTHON": sys.executable, "FAKE_OUT": str(tmp_path),
                         "FAKE_HOST_PREFIX": hosts.names[0][:-1]})
        proc = hosts.popen(None, ["bash", str(SBATCH), default_recipe(), *args], log, env)
        _wait_all([proc], [log, tmp_path / "node0.log", tmp_path / "node1.log"])
    _check_losses(run, reference)
    assert "2 nodes x 2 processes" in (tmp_path / "node0.log").read_text()
