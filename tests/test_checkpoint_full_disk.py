"""The command line on a filesystem that holds exactly ``checkpoint.keep`` checkpoints:
saving goes on (the oldest goes first, logged), a crashed save's leftover is removed, a
resume continues from the newest; on one too small for another checkpoint the run stops
with one line and the disk is as it was.

The filesystem is a real one: a tmpfs mounted with a size limit, which needs root
(CAP_SYS_ADMIN). Without it these tests skip; ``test_checkpoint_space.py`` covers the
same rules with a simulated short disk everywhere.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from parallel3d.checkpoint.reader import CheckpointReader, read_latest

from helpers import job_args, tiny_job


@pytest.fixture
def small_fs(tmp_path):
    """``small_fs(name, bytes)``: a folder under tmp_path with a tmpfs of that size on it."""
    mounted = []

    def make(name: str, size: int) -> Path:
        folder = tmp_path / name
        folder.mkdir()
        if os.geteuid() != 0:
            pytest.skip("mounting a size-limited tmpfs needs root")
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)],
                              capture_output=True, text=True)
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
        mounted.append(folder)
        return folder

    yield make
    for folder in mounted:
        subprocess.run(["umount", "-l", str(folder)], capture_output=True)


def _job(corpus_dir: str, run_dir: Path, ckpt_dir: Path, steps: int, keep: int, nproc: int = 1) -> dict:
    return tiny_job(corpus_dir, str(run_dir), parallel={"tp": 1, "pp": 1, "dp": nproc},
                    train={"steps": steps}, launch={"nproc": nproc}, observability={"progress": "off"},
                    checkpoint={"interval": 2, "keep": keep, "dir": str(ckpt_dir)})


def _train(corpus_dir: str, run_dir: Path, ckpt_dir: Path, steps: int, keep: int,
           nproc: int = 1) -> subprocess.CompletedProcess:
    job = _job(corpus_dir, run_dir, ckpt_dir, steps, keep, nproc)
    return subprocess.run([sys.executable, "-m", "parallel3d.cli", "train", *job_args(job)],
                          capture_output=True, text=True, timeout=600)


def _du(folder: Path) -> int:
    return sum(-(-p.stat().st_size // 4096) * 4096 for p in folder.rglob("*") if p.is_file())


@pytest.fixture(scope="module")
def one(corpus_dir, tmp_path_factory) -> int:
    """Bytes of one checkpoint of this job (with ``latest``), measured on an ordinary disk.
    Written by the trainer in this process, as the command line's one process writes it
    (the command line costs a process start: 13 s of this module on a loaded machine)."""
    from parallel3d.config import config_from_dict
    from parallel3d.topology import Topology
    from parallel3d.train.trainer import Trainer

    tmp = tmp_path_factory.mktemp("probe")
    Trainer(config_from_dict(_job(corpus_dir, tmp / "run", tmp / "ckpt", steps=2, keep=0)),
            Topology.single(), log=False).fit()
    return _du(tmp / "ckpt")


def test_a_disk_for_keep_checkpoints_keeps_saving_and_resumes(corpus_dir, tmp_path, small_fs, one):
    ckpt = small_fs("ckpt", 2 * one + one // 2)  # 2 checkpoints fit, 3 do not
    run = tmp_path / "run"
    first = _train(corpus_dir, run, ckpt, steps=6, keep=2)  # saves steps 2, 4, 6
    assert first.returncode == 0, first.stderr
    assert "checkpoint: removed step_00000002 before saving step 6 (checkpoint.keep=2)" in first.stdout
    assert sorted(p.name for p in ckpt.iterdir()) == ["latest", "step_00000004", "step_00000006"]

    # a save that crashed (killed mid-write) in an earlier attempt left its folder behind
    stale = ckpt / "step_00000008.tmp-0badc0de"
    stale.mkdir()
    (stale / "rank_00000.safetensors").write_bytes(b"\0" * (one // 3))
    resumed = _train(corpus_dir, run, ckpt, steps=8, keep=2)
    assert resumed.returncode == 0, resumed.stderr
    assert f"resuming from {ckpt / 'step_00000006'} at step 6" in resumed.stdout
    assert "checkpoint: removed step_00000008.tmp-0badc0de, left by a save that did not finish" in resumed.stdout
    assert sorted(p.name for p in ckpt.iterdir()) == ["latest", "step_00000006", "step_00000008"]
    assert read_latest(ckpt).name == "step_00000008"
    with CheckpointReader(ckpt / "step_00000008") as reader:
        reader.verify_all()
        assert reader.index.trainer["step"] == 8
    steps = [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 9))


def test_a_disk_without_room_for_one_more_stops_with_one_line(corpus_dir, tmp_path, small_fs, one):
    ckpt = small_fs("ckpt", one + one // 2)
    # keep=1: step 2 is the only checkpoint and what latest names; step 4 needs room beside
    # it. Two ranks: both learn of the refusal and exit 2; rank 0 says it.
    proc = _train(corpus_dir, tmp_path / "run", ckpt, steps=4, keep=1, nproc=2)
    assert proc.returncode == 2, proc.stderr
    lines = [x for x in proc.stderr.splitlines() if x.strip()]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"parallel3d: error: no room for checkpoint step 4 in {ckpt}: it needs"), lines[0]
    assert sorted(p.name for p in ckpt.iterdir()) == ["latest", "step_00000002"]  # nothing partial
    assert read_latest(ckpt).name == "step_00000002"
    with CheckpointReader(ckpt / "step_00000002") as reader:
        reader.verify_all()
