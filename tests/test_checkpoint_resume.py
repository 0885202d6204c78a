"""Exact resume and resharding through real training runs.

A run stopped at step 10 and resumed from its checkpoint must give the per-step losses of
a run never stopped: bit for bit at the same layout (the same operations on the same
numbers), and to fp32 reassociation at another layout (different reduction orders).
The model has an odd vocabulary (515: padded to 516 at tp=2 and tp=4) and 2 kv-heads
(replicated over 2 ranks at tp=4), so padding and shared shards take part.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from parallel3d.config import config_from_dict
from parallel3d.topology import Topology
from parallel3d.train.trainer import Trainer

from helpers import relative_diff, tiny_job

STEPS, STOP = 20, 10


pytestmark = pytest.mark.usefixtures("one_thread")


def _job(corpus_dir, run_dir, tp=1, dp=1, **checkpoint):
    return tiny_job(corpus_dir, str(run_dir), model={"vocab_size": 515},
                    parallel={"tp": tp, "dp": dp}, train={"steps": STEPS, "grad_clip": 0.5},
                    checkpoint={"interval": 5, **checkpoint})


def _losses(job: dict, stop_at: int | None = None) -> list[float]:
    par = job["parallel"]
    trainer = Trainer(config_from_dict(job), Topology(par["tp"], 1, par["dp"]))
    return [r["loss"] for r in trainer.fit(stop_at=stop_at)]


def test_resume_1x1x1_is_bit_exact(corpus_dir, tmp_path):
    straight = _losses(_job(corpus_dir, tmp_path / "straight"))
    job = _job(corpus_dir, tmp_path / "resumed", keep=2)
    resumed = _losses(job, stop_at=STOP) + _losses(job)  # checkpoint.resume = auto: step 10
    assert resumed == straight  # same layout: identical operations, identical bits
    # keep=2: only the two newest of steps 5, 10, 15, 20 remain; latest is the last
    root = tmp_path / "resumed" / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_00000015", "step_00000020"]
    assert (root / "latest").read_text().strip() == "step_00000020"
    # the resumed run continued metrics.jsonl: every step once, in order
    steps = [json.loads(line)["step"] for line in (tmp_path / "resumed" / "metrics.jsonl").open()]
    assert steps == list(range(1, STEPS + 1))


def test_a_crash_after_a_checkpoint_keeps_its_steps_in_metrics(corpus_dir, tmp_path):
    """A step's record reaches metrics.jsonl with the next step's collective; before a
    checkpoint the trainer completes it, so a process that dies right after saving step 5
    leaves records 1-5, and the resumed run continues from there without a gap."""
    job = _job(corpus_dir, tmp_path)
    trainer = Trainer(config_from_dict(job), Topology.single())
    save = trainer.checkpointer.maybe_save

    def save_then_die(t):
        saved = save(t)
        if saved and t.step == 5:
            raise KeyboardInterrupt  # the process dies here, before step 6
        return saved

    trainer.checkpointer.maybe_save = save_then_die
    with pytest.raises(KeyboardInterrupt):
        trainer.fit()
    trainer.checkpointer.writer.wait()
    trainer.data.loader.close()
    path = tmp_path / "metrics.jsonl"
    records = [json.loads(line) for line in path.open()]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
    assert all("max_step_time_s" in r for r in records)  # complete records, not partial ones
    _losses(job)  # resumes at step 5
    assert [json.loads(line)["step"] for line in path.open()] == list(range(1, STEPS + 1))


def test_tp2_dp2_resume_is_bit_exact_and_reshards(pools, corpus_dir, tmp_path):
    pool = pools(4)
    straight = pool.run(_losses, _job(corpus_dir, tmp_path / "straight", tp=2, dp=2))[0]
    job = _job(corpus_dir, tmp_path / "resumed", tp=2, dp=2, async_save=True, keep=0)
    first = pool.run(_losses, job, STOP)[0]
    again = pool.run(_losses, job)[0]
    assert first + again == straight  # async saves, same layout: bit for bit
    step10 = str(tmp_path / "resumed" / "checkpoints" / "step_00000010")
    for tp, dp in [(4, 1), (1, 4)]:
        other = _job(corpus_dir, tmp_path / f"tp{tp}dp{dp}", tp=tp, dp=dp, resume=step10)
        continued = pool.run(_losses, other)[0]
        # fp32: another split sums the same products in another order (a few ulps per op,
        # as between the layouts themselves in test_train_tp); 1e-5 relative is the bar.
        assert len(continued) == STEPS - STOP
        assert relative_diff(continued, straight[STOP:]) < 1e-5, (tp, dp)


def test_stop_on_a_non_finite_step_saves_through_the_hook(corpus_dir, tmp_path):
    """reliability.on_nonfinite=stop: the trainer's checkpoint hook saves the last good
    step (the stopped step changed no weight; its batch is given back), and a restart
    resumes there with the last good weights, to repeat the stopped step."""
    from parallel3d.reliability import TrainingStopped

    job = _job(corpus_dir, tmp_path / "run", interval=100)  # on, but no periodic save here
    job["reliability"] = {"on_nonfinite": "stop"}
    trainer = Trainer(config_from_dict(job), Topology.single())
    first = next(trainer.model.parameters())
    first.register_hook(lambda g: g * math.nan if trainer.step + 1 == 3 else g)
    trainer.train_step()
    trainer.train_step()
    good = [p.detach().clone() for p in trainer.model.parameters()]
    with pytest.raises(TrainingStopped, match="saved by the checkpoint hook"):
        trainer.train_step()
    resumed = Trainer(config_from_dict(job), Topology.single())
    assert resumed.step == 2  # the last good step; the stopped step's batch comes next
    assert resumed.sampler.consumed == 2 * job["train"]["global_batch"]
    assert all(torch.equal(a, b) for a, b in zip(good, resumed.model.parameters()))


def _hashes_on_resume(job: dict) -> list[str]:
    """dp 2 (ZeRO 1): train to step 2 (checkpointed), then resume, counting the files this
    rank hashes while loading."""
    from parallel3d.checkpoint import reader

    cfg = config_from_dict(job)
    Trainer(cfg, Topology(1, 1, 2)).fit(stop_at=2)
    hashed, sha256 = [], reader.file_sha256

    def counting(path, *args, **kwargs):
        hashed.append(path.name)
        return sha256(path, *args, **kwargs)

    reader.file_sha256 = counting
    try:
        trainer = Trainer(config_from_dict(job), Topology(1, 1, 2))
        files = sorted(trainer.checkpointer.reader.index.files)
        trainer.release()
    finally:
        reader.file_sha256 = sha256
    assert trainer.step == 2
    # a flipped byte in the file rank 1 checks: every rank refuses, with the same message
    import torch.distributed as dist

    from parallel3d.checkpoint.errors import CheckpointError

    folder = trainer.checkpointer.reader.folder
    if dist.get_rank() == 0:
        with open(folder / files[1], "r+b") as f:
            f.seek(-1, 2)
            last = f.read(1)
            f.seek(-1, 2)
            f.write(bytes([last[0] ^ 1]))
    dist.barrier()
    try:
        Trainer(config_from_dict(job), Topology(1, 1, 2))
        refused = None
    except CheckpointError as e:
        refused = str(e)
    return [hashed, files, refused]


def test_a_resume_hashes_each_file_once_among_the_ranks(corpus_dir, tmp_path):
    """Issue 30, point 5: every file's sha256 is checked by one rank, the findings agreed,
    before any is read (before, each rank hashed every file it read: the replicated ones
    and the rank JSON of rank 0 twice at dp 2, dp times at dp N)."""
    from parallel3d.testing import ProcessGroupPool

    from helpers import POOL_START

    job = tiny_job(corpus_dir, str(tmp_path), parallel={"dp": 2, "zero": 1}, train={"steps": 4},
                   checkpoint={"interval": 2})
    pool = ProcessGroupPool(2, timeout=180, start_method=POOL_START)
    try:
        (hashed0, files, refused0), (hashed1, _, refused1) = pool.run(_hashes_on_resume, job)
    finally:
        pool.close()
    assert sorted(hashed0 + hashed1) == files, (hashed0, hashed1, files)  # each once
    assert abs(len(hashed0) - len(hashed1)) <= 1  # split evenly
    assert refused0 == refused1 and f"{files[1]} does not match the sha256" in refused0, (refused0, refused1)
