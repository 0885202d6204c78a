"""Plain data parallelism: average gradients over the data-parallel group.

Gradients are flattened into buckets of at most ``bucket_bytes`` (one all-reduce each,
fewer and larger messages than one per parameter), averaged, and copied back. This is the
``parallel.zero = 0`` path; the sharded optimizer replaces it for zero >= 1.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors


def _buckets(tensors: list[torch.Tensor], bucket_bytes: int) -> list[list[torch.Tensor]]:
    out: list[list[torch.Tensor]] = []
    current: list[torch.Tensor] = []
    size = 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        if current and (size + nbytes > bucket_bytes or t.dtype != current[0].dtype):
            out.append(current)
            current, size = [], 0
        current.append(t)
        size += nbytes
    if current:
        out.append(current)
    return out


@torch.no_grad()
def all_reduce_gradients(params: list[torch.nn.Parameter], dp_group, dp: int,
                         bucket_bytes: int = 25 * 2**20) -> None:
    """``g <- mean over dp ranks of g`` for every parameter with a gradient."""
    if dp_group is None or dp == 1:
        return
    grads = [p.grad for p in params if p.grad is not None]
    for bucket in _buckets(grads, bucket_bytes):
        flat = _flatten_dense_tensors(bucket)
        dist.all_reduce(flat, group=dp_group)
        flat.div_(dp)
        for g, reduced in zip(bucket, _unflatten_dense_tensors(flat, bucket)):
            g.copy_(reduced)
