"""ZeRO in one process: the bucket layout (alignment, shards that partition each bucket,
reverse registration order), the options refused, and a stage-2 optimizer's state dict
resuming exactly. The multi-rank checks are tests/test_zero.py's."""

from __future__ import annotations

import copy

import pytest
import torch

from parallel3d.config import TrainConfig, config_from_dict
from parallel3d.errors import UserError
from parallel3d.topology import Topology
from parallel3d.train.setup import check_job, resolve_model_config
from parallel3d.zero import ZeroOptimizer
from parallel3d.zero.buckets import SHARD_ALIGN, BucketLayout

from test_zero import SMALL_BUCKET_MB, _tiny_model


def test_bucket_layout():
    numels = [7, 100, 3, 50, 1000, 1]
    for dp in (1, 2, 4, 3):
        layout = BucketLayout(numels, bucket_numel=120, dp=dp)
        seen = []
        for b in layout.buckets:
            assert b.numel % (dp * SHARD_ALIGN) == 0 and b.numel >= b.data_numel
            seen += [s.index for s in b.segments]
            covered = sum(hi - lo for r in range(dp) for _, lo, hi in b.shard_pieces(r))
            assert covered == b.data_numel  # the shards partition the bucket's data
        assert seen == list(reversed(range(len(numels))))  # reverse registration order
        assert [len(b.segments) for b in layout.buckets] == [1, 1, 2, 2]  # 1000 alone
        runs = layout.buckets[2].shard_runs(0, lambda i: i == 3)
        assert runs[0].lo == 0 and runs[-1].hi == layout.buckets[2].shard_numel


@pytest.mark.parametrize("overrides, message", [
    ({"parallel": {"zero": 4}}, "parallel.zero 4 is not supported: use 0, 1, 2, 3"),
    ({"parallel": {"zero": 3, "offload_optimizer": True}}, "not supported with parallel.zero=3"),
    ({"parallel": {"offload_optimizer": True}}, "set parallel.zero=1 or 2"),
    ({"parallel": {"zero": 1, "bucket_mb": 0}}, "parallel.bucket_mb must be positive"),
    ({"train": {"recompute": "some"}}, "train.recompute 'some' is not supported"),
])
def test_bad_options_are_refused(overrides, message):
    with pytest.raises(UserError, match=message):  # as the config loads, or by the job's checks
        cfg = config_from_dict(overrides)
        check_job(cfg, resolve_model_config(cfg.model), 1)


def test_state_dict_round_trip():
    """Resuming from (model weights, optimizer shard) continues exactly like not stopping;
    bf16 parameters so that the separate fp32 master weights travel in the state too."""
    def batch(step):
        return torch.randint(0, 509, (2, 16), generator=torch.Generator().manual_seed(step))

    def train(model, opt, steps):
        for step in steps:
            opt.zero_grad()
            x = batch(step)
            torch.nn.functional.cross_entropy(model(x).flatten(0, 1).float(), x.flatten()).backward()
            opt.step(1e-2)

    def fresh():
        model = _tiny_model().to(torch.bfloat16)
        return model, ZeroOptimizer(model.parameters(), TrainConfig(), Topology.single(), stage=2,
                                    bucket_mb=SMALL_BUCKET_MB, model=model)

    model, opt = fresh()
    train(model, opt, range(3))
    saved_model = {k: v.clone() for k, v in model.state_dict().items()}
    saved_opt = copy.deepcopy(opt.state_dict())  # like torch's, it holds live references
    train(model, opt, range(3, 5))
    resumed_model, resumed_opt = fresh()
    resumed_model.load_state_dict(saved_model)
    resumed_opt.load_state_dict(saved_opt)
    train(resumed_model, resumed_opt, range(3, 5))
    for (name, a), b in zip(model.state_dict().items(), resumed_model.state_dict().values()):
        assert torch.equal(a, b), name
    with pytest.raises(ValueError, match="saved for dp=1"):
        ZeroOptimizer(_tiny_model().parameters(), TrainConfig(), Topology.single(), stage=2,
                      bucket_mb=1.0).load_state_dict(saved_opt)
