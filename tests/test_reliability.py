"""Reliability: non-finite steps (skip / stop), loss spikes, a stalled rank and a killed
rank (every survivor leaves within a bound, naming the operation, group and lost rank)."""

from __future__ import annotations

import math
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

from parallel3d.config import config_from_dict
from parallel3d.reliability import CommFailure, CommWatch, LossSpikeDetector, TrainingStopped
from parallel3d.reliability.watch import _process_gone, comm_failures_reported
from parallel3d.testing import ProcessGroupPool
from parallel3d.topology import Topology
from parallel3d.train.trainer import Trainer

from helpers import POOL_START, spawned_children, stall_rank_at, tiny_job


# -- non-finite gradients -------------------------------------------------------------------

def _params(trainer) -> list[torch.Tensor]:
    if hasattr(trainer.optimizer, "wait_for_params"):  # ZeRO: the post-step all-gather
        trainer.optimizer.wait_for_params()
    return [p.detach().clone() for p in trainer.model.parameters()]


def _poisoned_run(job: dict, tp: int, pp: int, dp: int, bad_rank: int, bad_step: int) -> dict:
    """Train, multiplying one parameter's gradient by NaN on ``bad_rank`` at ``bad_step``."""
    cfg = config_from_dict(job)
    topo = Topology(tp, pp, dp)
    trainer = Trainer(cfg, topo)
    saved = []
    trainer.on_stop = lambda t: saved.append(t.step)
    param = next(p for p in trainer.model.parameters() if p.requires_grad)
    poison = lambda g: g * math.nan if trainer.step + 1 == bad_step and topo.rank == bad_rank else g  # noqa: E731
    param.register_hook(poison)
    history, unchanged = [], None
    try:
        while trainer.step < cfg.train.steps:
            before = _params(trainer)
            history.append(trainer.train_step())
            if trainer.step == bad_step:
                unchanged = all(torch.equal(a, b) for a, b in zip(before, _params(trainer)))
    except TrainingStopped as e:
        return {"history": history, "stopped": str(e), "saved": saved}
    return {"history": history, "unchanged": unchanged, "state_steps": _adam_steps(trainer)}


def _adam_steps(trainer) -> int:
    return trainer.optimizer.step_count


def test_nan_gradient_on_one_rank_is_skipped_everywhere(pools, corpus_dir, tmp_path):
    # pp=2 x dp=2 with ZeRO-1: the NaN sits in one rank's gradient; the dp reduce-scatter
    # and the norm's all-reduces must carry it to all four.
    job = tiny_job(corpus_dir, str(tmp_path), parallel={"pp": 2, "dp": 2, "zero": 1},
                   train={"steps": 5})
    results = pools(4).run(_poisoned_run, job, 1, 2, 2, 1, 3)
    for rank, res in enumerate(results):
        skipped = [r["step"] for r in res["history"] if r["skipped"]]
        assert skipped == [3], (rank, skipped)
        assert not math.isfinite(res["history"][2]["grad_norm"])
        assert res["unchanged"], f"rank {rank} changed its weights on the skipped step"
        assert res["history"][-1]["skipped_steps"] == 1
        assert res["state_steps"] == 4, "the skipped step advanced the optimizer state"
        others = [r for r in res["history"] if r["step"] != 3]
        assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in others)
        # training goes on from the last good weights: the loss keeps falling
        assert res["history"][-1]["loss"] < res["history"][0]["loss"]


def test_nan_gradient_with_stop_saves_and_stops(pools, corpus_dir, tmp_path):
    job = tiny_job(corpus_dir, str(tmp_path), parallel={"tp": 2, "dp": 2},
                   train={"steps": 5}, reliability={"on_nonfinite": "stop"})
    results = pools(4).run(_poisoned_run, job, 2, 1, 2, 3, 2)
    for res in results:
        assert len(res["history"]) == 1  # step 1 ran, step 2 stopped
        assert res["saved"] == [2]  # the hook ran once, on every rank
        assert "step 2: non-finite grad norm nan" in res["stopped"]
        assert "weights after step 1" in res["stopped"] and "on_nonfinite=skip" in res["stopped"]


def test_loss_spike_detector():
    det = LossSpikeDetector(factor=3.0, window=4)
    assert [det.update(x) for x in (2.0, 2.0, 2.0)] == [None] * 3  # window not yet full
    assert det.update(2.0) is None
    assert det.update(7.0) == pytest.approx(2.0)  # 7 > 3 x mean(2, 2, 2, 2)
    assert det.update(math.nan) is None  # non-finite steps are the skip path's business
    assert det.update(5.0) is None  # 5 < 3 x mean(2, 2, 2, 7)
    assert LossSpikeDetector(factor=0.0, window=4).update(1e9) is None


# -- a stalled rank -------------------------------------------------------------------------

def _stalled_run(job: dict, stall_rank: int, stall_step: int, stall_s: float):
    """Train on pp=2 x dp=2; ``stall_rank`` sleeps inside ``stall_step`` before its
    forward. Returns the report and the seconds from the stall step's start to it."""
    cfg = config_from_dict(job)
    rel = cfg.reliability
    topo = Topology(1, 2, 2, timeout_s=rel.comm_timeout_s)
    watch = CommWatch.for_process_group(topo, rel.comm_timeout_s, rel.heartbeat_s)
    trainer = Trainer(cfg, topo, watch=watch)
    stall_rank_at(trainer, stall_rank, stall_step, stall_s)
    t0 = time.monotonic()
    try:
        with comm_failures_reported(watch):
            while trainer.step < cfg.train.steps:
                if trainer.step + 1 == stall_step:
                    t0 = time.monotonic()
                trainer.train_step()
    except CommFailure as e:
        return str(e), time.monotonic() - t0
    finally:
        watch.close()
    return None, time.monotonic() - t0


def test_stalled_rank_makes_the_others_exit_naming_op_and_group(corpus_dir, tmp_path):
    timeout = 6.0
    job = tiny_job(corpus_dir, str(tmp_path), parallel={"pp": 2, "dp": 2},
                   train={"steps": 4}, reliability={"comm_timeout_s": timeout, "heartbeat_s": 1.0})
    # its own pool: the stall leaves the groups broken
    pool = ProcessGroupPool(4, timeout=120, start_method=POOL_START)
    try:
        results = pool.run(_stalled_run, job, 3, 3, timeout + 8)
    finally:
        pool.close(kill=True)
    pattern = re.compile(r"rank (\d): (.+) on the (tp|pp|dp|mp|embed|world) group \[[\d, ]+\] failed at step 3")
    for rank in (0, 1, 2):
        message, seconds = results[rank]
        assert message is not None, f"rank {rank} did not notice the stall"
        assert seconds < timeout + 30, (rank, seconds)
        assert pattern.match(message), message
    # the stalled rank's direct partners name it: rank 1 (its first stage) waiting for what
    # rank 3 sends back (pp group [1, 3]), rank 2 in the gradient sync (dp group [2, 3])
    assert re.search(r"rank 1: pipeline send/recv \[[^]]*recv [^]]*\] on the pp group \[1, 3\]",
                     results[1][0]), results[1][0]
    assert "rank 2: gradient sync on the dp group [2, 3]" in results[2][0]
    for rank in (1, 2):
        assert "did not arrive: rank 3 at step 3 in forward/backward |" in results[rank][0], results[rank][0]
    # nobody is taken for dead: every process is alive, the stalled one included
    assert all("lost" not in results[r][0] for r in (0, 1, 2)), [results[r][0] for r in (0, 1, 2)]
    assert "who was where: 0: step 3" in results[0][0]


# -- a killed rank --------------------------------------------------------------------------

def test_sigkill_of_one_of_four_ranks_ends_every_process(corpus_dir, tmp_path):
    run = tmp_path / "run"
    args = [f"--{k}={v}" for k, v in {
        "launch.nproc": 4, "parallel.tp": 1, "parallel.dp": 2, "parallel.pp": 2, "train.steps": 100000,
        "train.seq_len": 32, "train.global_batch": 8, "train.micro_batch": 2,
        "train.log_interval": 100000, "model.n_layers": 2, "model.dim": 64, "model.n_heads": 4,
        "model.n_kv_heads": 2, "model.ffn_dim": 160, "model.vocab_size": 512,
        "data.max_bytes": 1000000, "data.vocab_size": 512, "data.cache_dir": corpus_dir,
        "eval.interval": 0, "run.dir": str(run), "reliability.heartbeat_s": 1.0}.items()]
    err = open(tmp_path / "stderr.txt", "w+")
    proc = subprocess.Popen([sys.executable, "-m", "parallel3d.cli", "train", *args],
                            stdout=subprocess.DEVNULL, stderr=err)
    try:
        metrics = run / "metrics.jsonl"
        deadline = time.monotonic() + 180
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
            assert proc.poll() is None and time.monotonic() < deadline, "training never started"
            time.sleep(0.5)
        workers = spawned_children(proc.pid)
        assert len(workers) == 4, workers
        victim = workers[2]
        t0 = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        proc.wait(timeout=60)
        while not all(_process_gone(p) for p in workers) and time.monotonic() - t0 < 60:
            time.sleep(0.2)
        seconds = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
    err.seek(0)
    stderr = err.read()
    assert seconds < 60 and all(_process_gone(p) for p in workers), (seconds, stderr)
    assert proc.returncode == 4, stderr
    assert "Traceback" not in stderr
    # Either the launcher saw the killed worker first and names it, or a survivor's
    # collective failed first and its report (and any other survivor's) names it.
    reports = [line for line in stderr.splitlines() if "did not arrive" in line]
    launcher_named = f"lost worker rank 2 (pid {victim}): it was killed by SIGKILL" in stderr
    assert launcher_named or reports, stderr
    for line in reports:
        assert f"rank 2 lost (process {victim} is gone)" in line, line
