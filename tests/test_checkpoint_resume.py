"""Exact resume and resharding through real training runs.

A run stopped at step 10 and resumed from its checkpoint must give the per-step losses of
a run never stopped: bit for bit at the same layout (the same operations on the same
numbers), and to fp32 reassociation at another layout (different reduction orders).
"""

from __future__ import annotations

import json
from pathlib import Path

from parallel3d.config import config_from_dict
from parallel3d.topology import Topology
from parallel3d.train.trainer import Trainer

from helpers import relative_diff, tiny_job

STEPS, STOP = 20, 10


def _job(corpus_dir, run_dir, dp=1, **checkpoint):
    return tiny_job(corpus_dir, str(run_dir), parallel={"dp": dp},
                    train={"steps": STEPS, "grad_clip": 0.5},
                    checkpoint={"interval": 5, "keep": 2, **checkpoint})


def _losses(job: dict, dp: int = 1, stop_at: int | None = None) -> list[float]:
    trainer = Trainer(config_from_dict(job), Topology(1, 1, dp))
    return [r["loss"] for r in trainer.fit(stop_at=stop_at)]


def _stop_and_resume(job: dict, dp: int) -> list[float]:
    first = _losses(job, dp, stop_at=STOP)
    return first + _losses(job, dp)  # checkpoint.resume = auto finds step 10


def test_resume_1x1x1_is_bit_exact(corpus_dir, tmp_path):
    straight = _losses(_job(corpus_dir, tmp_path / "straight"))
    job = _job(corpus_dir, tmp_path / "resumed")
    resumed = _stop_and_resume(job, 1)
    assert resumed == straight  # same layout: identical operations, identical bits
    # keep=2: only the two newest of steps 5, 10, 15, 20 remain; latest is the last
    root = tmp_path / "resumed" / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_00000015", "step_00000020"]
    assert (root / "latest").read_text().strip() == "step_00000020"
    # the resumed run continued metrics.jsonl: every step once, in order
    steps = [json.loads(line)["step"] for line in (tmp_path / "resumed" / "metrics.jsonl").open()]
    assert steps == list(range(1, STEPS + 1))


def test_resume_dp2_async_is_bit_exact_and_reshards_to_dp1(pools, corpus_dir, tmp_path):
    pool = pools(2)
    straight = pool.run(_losses, _job(corpus_dir, tmp_path / "straight", dp=2), 2)[0]
    job = _job(corpus_dir, tmp_path / "resumed", dp=2, async_save=True)
    first = pool.run(_losses, job, 2, STOP)[0]
    # Resume the dp=2 checkpoint of step 10 at dp=2 ...
    again = pool.run(_losses, job, 2)[0]
    assert first + again == straight
    # ... and at dp=1, from the same step-10 checkpoint (copied: the run above moved on).
    src = Path(tmp_path / "resumed" / "checkpoints" / "step_00000010")
    assert not src.exists()  # keep=2 pruned it; use step 15 instead, written at dp=2 too
    step15 = tmp_path / "resumed" / "checkpoints" / "step_00000015"
    single = _losses(_job(corpus_dir, tmp_path / "dp1", resume=str(step15)))
    # fp32, dp=1 sums the micro-batches in another order than dp=2's all-reduce: a few ulps
    # per op over 5 steps; 1e-5 relative is the bar used for the layouts themselves.
    assert len(single) == STEPS - 15
    assert relative_diff(single, straight[15:]) < 1e-5
