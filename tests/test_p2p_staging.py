"""Pipeline sends and receives on a gloo group whose tensors live on a device: gloo's
send/recv read host memory only, so ``StageComm`` stages them through reused host
buffers, and ``parallel3d.distributed`` refuses a device tensor that is not staged. The
device here is ``fakegpu`` (tests/fake_device.py), which gloo cannot send from either."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import parallel3d.distributed as distributed
from parallel3d.distributed import gloo_p2p_needs_host
from parallel3d.pipeline.actions import Message
from parallel3d.pipeline.p2p import StageComm

import fake_device

SHAPE = (2, 3, 5)  # (micro_batch, seq, dim) of the messages


def test_only_a_device_tensor_on_gloo_is_staged():
    assert gloo_p2p_needs_host("gloo", torch.device("cuda", 0))
    assert gloo_p2p_needs_host("gloo", "meta")
    assert not gloo_p2p_needs_host("gloo", "cpu")
    assert not gloo_p2p_needs_host("nccl", "cuda:1")


def test_an_unstaged_device_tensor_on_a_gloo_send_is_refused(monkeypatch):
    monkeypatch.setattr(distributed.dist, "get_backend", lambda group=None: "gloo")
    with pytest.raises(RuntimeError, match="a meta tensor \\(2, 3\\) was handed to a send/receive on a gloo"):
        distributed.check_p2p_device(torch.empty(2, 3, device="meta"), object())
    distributed.check_p2p_device(torch.zeros(2, 3), object())
    monkeypatch.setattr(distributed.dist, "get_backend", lambda group=None: "nccl")
    with pytest.raises(RuntimeError, match="NCCL group"):
        distributed.check_p2p_device(torch.zeros(2, 3), object())


def _message(rank: int, k: int) -> torch.Tensor:
    return torch.arange(torch.Size(SHAPE).numel(), dtype=torch.float32).view(SHAPE) + 1000 * rank + k


def _exchange_on_fake_device(batches: int) -> dict:
    """Both ranks send to each other in every batch (as 1F1B's steady state does), each
    batch posted before the previous batch's sends were waited for."""
    device = torch.device(fake_device.install())
    rank, peer = dist.get_rank(), 1 - dist.get_rank()
    comm = StageComm(dist.group.WORLD, [0, 1], SHAPE, torch.float32, device)
    got, devices = [], set()
    for k in range(batches):
        out = _message(rank, k).to(device)
        (x,) = comm.post([(Message("act", 0, k, rank, peer), out)], [Message("act", 0, k, peer, rank)]).wait()
        devices.add(x.device.type)
        got.append(bool(torch.equal(x.cpu(), _message(peer, k))))
    comm.flush()
    allocated = comm.staging.allocated
    unstaged = ""
    comm.staging = None  # what StageComm did before: the device tensor straight to gloo
    try:
        comm.post([(Message("act", 0, 0, rank, peer), _message(rank, 0).to(device))], [])
    except RuntimeError as e:
        unstaged = str(e)
    return {"got": got, "devices": devices, "allocated": allocated, "unstaged": unstaged}


def test_a_gloo_pipeline_exchange_of_device_tensors_is_staged_through_reused_host_buffers(pools):
    batches = 5
    for rank, r in enumerate(pools(2).run(_exchange_on_fake_device, batches)):
        assert r["got"] == [True] * batches, (rank, r)
        assert r["devices"] == {"fakegpu"}, (rank, r)  # received onto the pipeline's device
        # one receive buffer, and the sends of two batches in flight at once: 3, whatever
        # the number of batches
        assert r["allocated"] == 3, (rank, r)
        assert "stage it through a host buffer" in r["unstaged"], (rank, r)
