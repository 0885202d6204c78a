"""Optimizer offload: the fp32 shard and its AdamW step on the CPU via DeepSpeed's CPU Adam.

The first run on a machine JIT-builds DeepSpeed's cpu_adam op (about a minute with g++
and ninja) into ~/.cache/parallel3d/torch_extensions; later runs load it in a second.
The ``cpu_adam_built`` fixture (conftest.py) has the build started in the background when
the session starts, and waits for it: built once, before any rank would race to build it.
"""

from __future__ import annotations

import pytest
import torch

from parallel3d.config import TrainConfig, config_from_dict
from parallel3d.topology import Topology
from parallel3d.train.trainer import Trainer

from helpers import relative_diff, tiny_job

pytest.importorskip("deepspeed")


def test_cpu_adam_matches_flat_adamw(cpu_adam_built):
    """The two AdamW implementations on the same flat shard, with decayed and undecayed
    pieces, agree closely: DeepSpeed keeps its bias corrections in float32 and uses fused
    multiply-adds, ours is torch's fused AdamW kernel (see adam.py)."""
    from parallel3d.zero.adam import CpuOffloadAdamW, FlatAdamW

    cfg = TrainConfig(lr=1e-2, weight_decay=0.1, beta1=0.9, beta2=0.95, eps=1e-8)
    gen = torch.Generator().manual_seed(0)
    init = torch.randn(1000, generator=gen)
    runs = [(0, 0, 300, True), (0, 300, 310, False), (0, 310, 1000, True)]
    shards = {}
    for name in ("ours", "deepspeed"):
        master = init.clone()
        grad = torch.zeros(1000)
        if name == "ours":
            adam = FlatAdamW([master], grad, [0], runs, cfg)
        else:
            adam = CpuOffloadAdamW([master], [grad], runs, cfg)
        g = torch.Generator().manual_seed(1)
        for t in range(1, 21):
            grad.copy_(torch.randn(1000, generator=g))
            adam.step(t, cfg.lr * (1 - t / 40))
        shards[name] = master
    assert not torch.equal(shards["ours"], init)
    # 20 steps of lr 1e-2 move each element by ~0.1; the two agree to ~1e-6 of that
    torch.testing.assert_close(shards["deepspeed"], shards["ours"], rtol=1e-5, atol=1e-6)
    undecayed = shards["ours"][300:310] - init[300:310]
    assert undecayed.abs().max() > 0


def _losses(job: dict) -> list[float]:
    return [r["loss"] for r in Trainer(config_from_dict(job), Topology(1, 1, 2)).fit()]


def test_offload_gives_the_losses_of_no_offload(cpu_adam_built, pools, corpus_dir, tmp_path):
    steps = 12
    runs = {}
    for offload in (False, True):
        job = tiny_job(corpus_dir, str(tmp_path / str(offload)),
                       parallel={"dp": 2, "zero": 2, "offload_optimizer": offload, "bucket_mb": 0.05},
                       train={"steps": steps, "grad_clip": 0.5})
        runs[offload] = pools(2).run(_losses, job)[0]
    # DeepSpeed's float32 bias corrections and fused multiply-adds differ from torch's
    # AdamW by ~1e-7 relative per update; over 12 steps the losses agree to well under 1e-5.
    assert relative_diff(runs[True], runs[False]) < 1e-5
    assert runs[True][-1] < runs[True][0]
