"""What NCCL would refuse, checked without a GPU: evaluation keeps its sum on the training
device, and a host tensor handed to a collective on an NCCL group is named clearly."""

from __future__ import annotations

import pytest
import torch

import parallel3d.distributed as distributed
import parallel3d.train.trainer as trainer_module
from parallel3d.config import config_from_dict
from parallel3d.topology import Topology
from parallel3d.train.trainer import Trainer

from helpers import tiny_job


def test_evaluation_reduces_a_tensor_on_the_training_device(corpus_dir, tmp_path, monkeypatch):
    """Trainer.evaluate's dp all-reduce gets a tensor on the trainer's device. The device
    here is "meta", which no code path can reach by accident: a ``.cpu()`` on the way (the
    bug NCCL met at dp > 1: "No backend type associated with device type cpu") fails to
    copy out of it, and a host tensor shows as "cpu" in the recorded devices."""
    job = tiny_job(corpus_dir, str(tmp_path), eval={"interval": 1, "batches": 3}, data={"val_fraction": 0.1})
    trainer = Trainer(config_from_dict(job), Topology.single())
    seen = []

    def fake_all_reduce(t, group, *args):
        seen.append(t.device.type)
        return torch.full((), 6.0)  # any host value: float() of a meta tensor has none

    monkeypatch.setattr(trainer_module, "all_reduce", fake_all_reduce)
    trainer.device = torch.device("meta")
    trainer.schedule.forward_only = lambda micro_batches: torch.ones((), device="meta")
    trainer.data.val_micro_batches = lambda b: []
    assert trainer.evaluate() == 6.0
    assert seen == ["meta"]
    trainer.data.loader.close()


def test_a_host_tensor_on_an_nccl_group_is_named(monkeypatch):
    monkeypatch.setattr(distributed.dist, "get_backend", lambda group=None: "nccl")
    with pytest.raises(RuntimeError, match="a cpu tensor \\(3,\\) was handed to a collective on an NCCL group"):
        distributed.check_device(torch.zeros(3), object())
    monkeypatch.setattr(distributed.dist, "get_backend", lambda group=None: "gloo")
    distributed.check_device(torch.zeros(3), object())  # gloo takes host tensors
