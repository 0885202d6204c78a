"""A run stopped by a non-finite step (``reliability.on_nonfinite = "stop"``) leaves the
checkpoint of its last good step, through the command line (the path a user takes: CLI,
launcher, worker, trainer), and resuming from it continues with the losses the run would
have had.

The non-finite step is injected, so that it falls on a chosen step and changes nothing
before it: a ``sitecustomize`` module on the children's ``PYTHONPATH`` (the launched
workers inherit it) makes the trainer's step sums see a NaN loss at step ``BAD``. The
loss is really NaN: the optimizer skips the step and the trainer stops, as on a real
overflow. A second test reproduces the issue's own trigger (``--train.lr=1e6``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from parallel3d.checkpoint.format import Index
from parallel3d.checkpoint.reader import find_checkpoint

from helpers import job_args, tiny_job

STEPS, BAD, GLOBAL = 5, 3, 8

POISON = f"""
from parallel3d.train.trainer import Trainer

_step_sums = Trainer._step_sums  # fails loudly if the trainer no longer has it


def _poisoned(self, norm_share, loss_part, *rest):
    if self.step + 1 == {BAD}:
        loss_part = loss_part * float("nan")
    return _step_sums(self, norm_share, loss_part, *rest)


Trainer._step_sums = _poisoned
"""


def _cli(job: dict, tmp_path: Path, poison: bool, *extra: str) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    if poison:
        site = tmp_path / "poison"
        site.mkdir(exist_ok=True)
        (site / "sitecustomize.py").write_text(POISON)
        env["PYTHONPATH"] = os.pathsep.join([str(site), env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-m", "parallel3d.cli", "train", *job_args(job), *extra],
                          capture_output=True, text=True, timeout=600, env=env)


def _losses(run_dir: Path) -> dict[int, float]:
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records}


def test_a_stop_saves_the_last_good_step_and_a_resume_continues_its_losses(corpus_dir, tmp_path):
    def job(run_dir: Path) -> dict:
        # one process: the CLI's in-process path is run_worker -> run_training, the code
        # that lost the hook (the collective save on several ranks: test_reliability.py)
        return tiny_job(corpus_dir, str(run_dir), parallel={"tp": 1, "pp": 1, "dp": 1},
                        train={"steps": STEPS, "global_batch": GLOBAL},
                        launch={"nproc": 1}, observability={"progress": "off"},
                        reliability={"on_nonfinite": "stop"},
                        checkpoint={"interval": 1000})  # no regular save before the stop

    reference = _cli(job(tmp_path / "reference"), tmp_path, poison=False)
    assert reference.returncode == 0, reference.stderr
    want = _losses(tmp_path / "reference")
    assert sorted(want) == list(range(1, STEPS + 1))

    run = tmp_path / "run"
    stopped = _cli(job(run), tmp_path, poison=True)
    assert stopped.returncode == 3, stopped.stderr
    lines = [x for x in stopped.stderr.splitlines() if x.startswith("parallel3d:")]
    assert len(lines) == 1, stopped.stderr
    assert f"step {BAD}: non-finite loss nan" in lines[0], lines[0]
    assert f"weights after step {BAD - 1} (saved by the checkpoint hook)" in lines[0], lines[0]
    folder = find_checkpoint(run / "checkpoints")
    assert folder is not None and folder.name == f"step_{BAD - 1:08d}", stopped.stderr
    trainer_state = Index.read(folder).trainer
    assert trainer_state["step"] == BAD - 1
    # the data position before the stopped step's batch: a resume repeats that batch
    assert trainer_state["sampler"]["consumed_samples"] == (BAD - 1) * GLOBAL
    assert _losses(run) == {s: want[s] for s in range(1, BAD)}

    resumed = _cli(job(run), tmp_path, poison=False)  # checkpoint.resume = "auto"
    assert resumed.returncode == 0, resumed.stderr
    assert f"resuming from {folder} at step {BAD - 1}" in resumed.stdout
    # the same layout and seed: the same losses, bit for bit, the stopped step included
    assert _losses(run) == want


def test_the_issues_huge_learning_rate_stop_leaves_a_checkpoint(corpus_dir, tmp_path):
    """``--train.lr=1e6 --reliability.on_nonfinite=stop --checkpoint.interval=1000``: step
    1 is finite, its update is not survivable; the stop saves step 1 (one process)."""
    run = tmp_path / "run"
    job = tiny_job(corpus_dir, str(run), train={"steps": 5, "lr": 1e6, "warmup_steps": 0},
                   launch={"nproc": 1}, parallel={"tp": 1, "pp": 1, "dp": 1}, observability={"progress": "off"},
                   reliability={"on_nonfinite": "stop"}, checkpoint={"interval": 1000})
    proc = _cli(job, tmp_path, poison=False)
    assert proc.returncode == 3, proc.stderr
    line = proc.stderr.strip().splitlines()[-1]
    assert "(saved by the checkpoint hook)" in line, proc.stderr
    stopped_at = int(line.split("parallel3d: stopped: step ", 1)[1].split(":")[0])
    folder = find_checkpoint(run / "checkpoints")
    assert folder is not None and folder.name == f"step_{stopped_at - 1:08d}", proc.stderr
