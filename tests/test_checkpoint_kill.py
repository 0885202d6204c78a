"""A process killed in the middle of a save leaves the previous checkpoint loadable and
``latest`` pointing at it; the half-written folder is ignored, then cleaned up.

A child process saves step 2, then is stopped (SIGKILL) during its save of step 4, at
each point of the save protocol in turn: half-way through writing its tensors, after its
files are complete, after the index is written, and after the folder is renamed but
before ``latest`` moves. The child runs the writer the trainer uses (``CheckpointWriter``)
on a small synthetic state, so it starts in a second rather than building a trainer.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from parallel3d.checkpoint.reader import CheckpointReader, complete_checkpoints, find_checkpoint
from parallel3d.checkpoint.save import CheckpointWriter, RankPayload
from parallel3d.checkpoint.state import Placement, Slot

CHILD = r"""
import os, sys, time
import parallel3d.checkpoint.rank_files as rank_files
import parallel3d.checkpoint.save as save
sys.path.insert(0, sys.argv[3])
from test_checkpoint_kill import payload

phase, marker, root = sys.argv[1], sys.argv[2], sys.argv[4]
writer = save.CheckpointWriter(root, 0, 1, keep=0, token="child")
writer.save(payload(2))
seen = {"n": 0}

def stop_here(name):
    if name != phase:
        return
    seen["n"] += 1
    if name == "write_tensor" and seen["n"] < 4:  # some tensors written, not all
        return
    open(marker, "w").write(name)
    time.sleep(600)

save._phase = rank_files._phase = stop_here
writer.save(payload(4))
"""


def payload(step: int) -> RankPayload:
    """Eight 256x256 fp32 tensors (2 MiB) whose values depend on the step."""
    g = torch.Generator().manual_seed(step)
    slots = []
    for i in range(8):
        pl = Placement(f"w{i}", (256, 256), (0, 0), (256, 256), True)
        slots.append(Slot(f"model/w{i}", pl, torch.randn(256, 256, generator=g)))
    return RankPayload(step, 0, slots, {"rank": 0}, {"model": {"name": "synthetic"}, "trainer": {"step": step}})


PHASES = ["write_tensor", "rank_files_written", "index_written", "renamed"]


def _kill_children_during(phases: list[str], tmp_path: Path) -> None:
    """Start one child per phase (at once: each spends its time importing torch), and
    SIGKILL each as soon as it reports having stopped there."""
    children = {}
    for phase in phases:
        marker = tmp_path / phase / "stopped"
        marker.parent.mkdir()
        args = [sys.executable, "-c", CHILD, phase, str(marker), str(Path(__file__).parent),
                str(tmp_path / phase / "checkpoints")]
        children[phase] = (subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE), marker)
    deadline = time.monotonic() + 180
    try:
        while children:
            for phase, (child, marker) in list(children.items()):
                if marker.exists():
                    os.kill(child.pid, signal.SIGKILL)
                    child.wait()
                    child.stderr.close()
                    del children[phase]
                elif child.poll() is not None:
                    pytest.fail(f"child exited before reaching {phase}: "
                                f"{child.stderr.read().decode()[-2000:]}")
            assert time.monotonic() < deadline, f"children never reached {sorted(children)}"
            time.sleep(0.02)
    finally:
        for child, _ in children.values():
            child.kill()
            child.wait()


def test_kill_mid_save_keeps_the_previous_checkpoint(tmp_path):
    _kill_children_during(PHASES, tmp_path)
    for phase in PHASES:
        _check_after_kill(phase, tmp_path / phase / "checkpoints")


def _check_after_kill(phase: str, root: Path) -> None:
    assert (root / "latest").read_text().strip() == "step_00000002", phase
    assert find_checkpoint(root).name == "step_00000002", phase
    want = payload(2)
    with CheckpointReader(root / "step_00000002") as reader:
        reader.verify_all()  # every file intact
        assert reader.index.step == 2
        for slot in want.slots:
            assert torch.equal(reader.read(slot.name), slot.tensor), phase
    leftovers = [p.name for p in root.iterdir() if ".tmp-" in p.name]
    if phase == "renamed":  # step 4 is complete, but latest had not moved: it is not used
        assert [s for s, _ in complete_checkpoints(root)] == [2, 4] and not leftovers
    else:
        assert [s for s, _ in complete_checkpoints(root)] == [2], phase
        assert leftovers == ["step_00000004.tmp-child"], phase
    # The next save (a resumed run saving step 4 again) completes and removes the leftovers.
    CheckpointWriter(root, 0, 1, keep=0, token="resumed").save(payload(4))
    assert not [p for p in root.iterdir() if ".tmp-" in p.name or ".old-" in p.name], phase
    assert (root / "latest").read_text().strip() == "step_00000004"
    with CheckpointReader(root / "step_00000004") as reader:
        assert torch.equal(reader.read("model/w7"), payload(4).slots[7].tensor)
