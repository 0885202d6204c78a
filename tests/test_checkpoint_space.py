"""Saves clean up after themselves: a failed save leaves no temporary folder on any rank,
leftovers of dead saves are removed by the next save (and only those), and when the disk
is short ``checkpoint.keep`` applies before the write instead of after it.

The writer is driven directly here on a small synthetic state (2 ranks of gloo for the
collective parts); ``test_checkpoint_full_disk.py`` runs the command line on a real
size-limited filesystem.
"""

from __future__ import annotations

import errno
import os
import shutil
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import parallel3d.checkpoint.room as room
import parallel3d.checkpoint.save as save
from parallel3d.checkpoint.errors import CheckpointError
from parallel3d.checkpoint.reader import CheckpointReader, complete_checkpoints, read_latest
from parallel3d.checkpoint.safetensors_io import StreamingWriter
from parallel3d.checkpoint.save import CheckpointWriter, RankPayload
from parallel3d.checkpoint.state import Placement, Slot

ROWS = 64  # rows of the logical tensors each rank holds


def payload(step: int, rank: int = 0, world: int = 1, n: int = 4) -> RankPayload:
    """``n`` tensors of shape (ROWS * world, 64), rank r holding rows [r*ROWS, (r+1)*ROWS);
    values depend on the step (64 KiB a rank)."""
    g = torch.Generator().manual_seed(step * 100 + rank)
    slots = [Slot(f"model/w{i}", Placement(f"w{i}", (ROWS * world, 64), (ROWS * rank, 0), (ROWS, 64), True),
                  torch.randn(ROWS, 64, generator=g)) for i in range(n)]
    fields = {"model": {"name": "synthetic"}, "trainer": {"step": step}} if rank == 0 else {}
    return RankPayload(step, rank, slots, {"rank": rank}, fields)


def _listing(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir())


# -- a failed save ----------------------------------------------------------------------------

def _save_with_a_failing_rank(root: str, fail_rank: int) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    writer = CheckpointWriter(Path(root), rank, world, dist.group.WORLD, keep=0, token="run")
    writer.save(payload(2, rank, world))
    if rank == fail_rank:  # the disk fills after this rank's first tensor
        real = StreamingWriter.write
        calls = {"n": 0}

        def write(self, key, tensor):
            calls["n"] += 1
            if calls["n"] > 1:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            real(self, key, tensor)

        StreamingWriter.write = write
    try:
        writer.save(payload(4, rank, world))
        error = None
    except CheckpointError as e:
        error = str(e)
    finally:
        if rank == fail_rank:
            StreamingWriter.write = real
    dist.barrier()
    return {"error": error, "listing": _listing(Path(root))}


def test_a_failed_save_removes_its_folder_on_every_rank(pools, tmp_path):
    root = tmp_path / "ckpt"
    results = pools(2).run(_save_with_a_failing_rank, str(root), 1)
    for rank, res in enumerate(results):
        assert res["error"] is not None, f"rank {rank} did not see the failure"
        assert "checkpoint step 4" in res["error"] and "rank 1: OSError: [Errno 28]" in res["error"], res
        assert "\n" not in res["error"]
    assert _listing(root) == ["latest", "step_00000002"]  # no step_00000004.tmp-run
    assert read_latest(root).name == "step_00000002"
    with CheckpointReader(root / "step_00000002") as reader:
        reader.verify_all()
        assert torch.equal(reader.read_region("model/w3", (ROWS, 0), (ROWS, 64)), payload(2, 1, 2).slots[3].tensor)


# -- leftovers of dead saves --------------------------------------------------------------------

def _leftover(root: Path, name: str, age_s: float | None = None) -> Path:
    p = root / name
    p.mkdir()
    (p / "rank_00000.safetensors").write_bytes(b"\0" * 1000)
    if age_s is not None:
        past = time.time() - age_s
        os.utime(p / "rank_00000.safetensors", (past, past))
        os.utime(p, (past, past))
    return p


def test_only_certainly_dead_leftovers_are_removed(tmp_path):
    root = tmp_path / "ckpt"
    root.mkdir()
    CheckpointWriter(root, 0, 1, token="older").save(payload(2))
    _leftover(root, "step_00000010.tmp-crashed", age_s=60)  # a run that crashed before this one
    _leftover(root, "step_00000012.tmp-crashed2", age_s=60)
    _leftover(root, "step_00000002.old-crashed3", age_s=60)  # its replacement step_2 is complete
    _leftover(root, "step_00000008.old-crashed4", age_s=60)  # no step_8: the only copy, kept
    writer = CheckpointWriter(root, 0, 1, token="mine")  # this run starts now
    _leftover(root, "step_00000006.tmp-mine")  # this run's own failed save that could not clean up
    _leftover(root, "step_00000004.tmp-other")  # another job writing here right now
    logged = []
    writer.log = logged.append
    writer.save(payload(4))
    assert _listing(root) == ["latest", "step_00000002", "step_00000004", "step_00000004.tmp-other",
                              "step_00000008.old-crashed4"]
    assert sorted(line.split()[2].rstrip(",") for line in logged) == [
        "step_00000002.old-crashed3", "step_00000006.tmp-mine", "step_00000010.tmp-crashed",
        "step_00000012.tmp-crashed2"]


# -- keep, applied early on a short disk ---------------------------------------------------------

def _du(root: Path) -> int:
    """Bytes the files under ``root`` take, in 4 KiB blocks (tmpfs / ext4)."""
    total = 0
    for dirpath, _, files in os.walk(root):
        total += sum(-(-os.path.getsize(os.path.join(dirpath, f)) // 4096) * 4096 for f in files)
    return total


class ShortDisk:
    """A filesystem of ``capacity`` bytes under ``root``, as ``shutil.disk_usage`` and
    file writes see it: writing past it raises ENOSPC. Stands in for a small mount where
    this machine cannot make one (``test_checkpoint_full_disk.py`` uses a real one)."""

    def __init__(self, monkeypatch, root: Path, capacity: int):
        self.root, self.capacity = root, capacity
        real_usage = shutil.disk_usage
        monkeypatch.setattr(room.shutil, "disk_usage",
                            lambda p: real_usage(p)._replace(total=capacity, free=capacity - _du(root)))
        real_write = StreamingWriter.write

        def write(w, key, tensor):
            if _du(root) + tensor.numel() * tensor.element_size() > capacity:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            real_write(w, key, tensor)

        monkeypatch.setattr(StreamingWriter, "write", write)


def _one_checkpoint_bytes(tmp_path: Path) -> int:
    probe = tmp_path / "probe"
    CheckpointWriter(probe, 0, 1).save(payload(1))
    return _du(probe / "step_00000001")


def test_keep_makes_room_first_on_a_disk_that_holds_keep_checkpoints(tmp_path, monkeypatch):
    one = _one_checkpoint_bytes(tmp_path)
    root = tmp_path / "ckpt"
    root.mkdir()
    ShortDisk(monkeypatch, root, capacity=2 * one + one // 2)  # room for 2, not 3
    writer = CheckpointWriter(root, 0, 1, keep=2, token="run")
    logged = []
    writer.log = logged.append
    for step in (2, 4, 6, 8):
        writer.save(payload(step))
    assert _listing(root) == ["latest", "step_00000006", "step_00000008"]
    assert [line.split()[2] for line in logged] == ["step_00000002", "step_00000004"]
    assert "before saving step 6 (checkpoint.keep=2)" in logged[0]
    with CheckpointReader(root / "step_00000008") as reader:
        reader.verify_all()


def test_without_room_first_the_same_disk_fails_every_third_save(tmp_path, monkeypatch):
    """The guard: the same disk and saves with keep applied after the write (the old
    order) fail at step 6; what makes the test above pass is the early removal."""
    one = _one_checkpoint_bytes(tmp_path)
    root = tmp_path / "ckpt"
    root.mkdir()
    ShortDisk(monkeypatch, root, capacity=2 * one + one // 2)
    monkeypatch.setattr(save, "make_room", lambda *a, **k: None)
    writer = CheckpointWriter(root, 0, 1, keep=2, token="run")
    writer.save(payload(2))
    writer.save(payload(4))
    with pytest.raises(CheckpointError, match="No space left on device"):
        writer.save(payload(6))
    assert _listing(root) == ["latest", "step_00000002", "step_00000004"]  # nothing partial


@pytest.mark.parametrize("keep", [1, 0])
def test_a_save_that_cannot_fit_is_refused_before_writing(tmp_path, monkeypatch, keep):
    """keep=1: the only checkpoint is what latest names, never removed before its
    successor exists; keep=0 keeps all. Either way the save is refused in one line and
    the disk is as it was."""
    one = _one_checkpoint_bytes(tmp_path)
    root = tmp_path / "ckpt"
    root.mkdir()
    ShortDisk(monkeypatch, root, capacity=one + one // 2)
    writer = CheckpointWriter(root, 0, 1, keep=keep, token="run")
    writer.save(payload(2))
    before = {p.name: p.stat().st_mtime_ns for p in root.rglob("*")}
    with pytest.raises(CheckpointError) as e:
        writer.save(payload(4))
    message = str(e.value)
    assert "\n" not in message and message.startswith(f"no room for checkpoint step 4 in {root}")
    assert "kept: step_00000002" in message and "set checkpoint.dir to a larger filesystem" in message
    assert {p.name: p.stat().st_mtime_ns for p in root.rglob("*")} == before
    assert [s for s, _ in complete_checkpoints(root)] == [2] and read_latest(root).name == "step_00000002"
