"""An RMSNorm over a width split across the tensor-parallel ranks (OLMoE's q/k norms).

OLMoE normalises the whole q (and k) projection, all heads at once, before they split into
heads: ``y = x / sqrt(mean(x^2) + eps) * w`` over ``n_heads * head_dim`` columns. Under
tensor parallelism each rank holds the columns of its heads, so the mean's sum runs over
the ranks::

    s_r = sum_j x_rj^2             (fp32, this rank's columns)
    s   = sum_r s_r                (all-reduce over tp: _SumOverRanks)
    y_r = x_r / sqrt(s / width + eps) * w_r

The all-reduce is an autograd pair with itself: every rank's output depends on every
rank's ``s_r``, so the gradient of ``s_r`` is the sum over ranks of the gradients of ``s``
(an all-reduce of the gradient). ``w`` is split with the columns (``p3d_tp_dim = 0``):
each rank's gradient is its own slice, whole (no partial sums). k's columns split only
when tp divides the kv-heads (a replicated kv-head would be counted by several ranks).
"""

from __future__ import annotations

import torch
from torch import nn

from .comm import _all_reduce
from .layers import even_range, mark_sharded


class _SumOverRanks(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return _all_reduce(x.clone(), group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _all_reduce(grad.clone(), ctx.group), None


class ShardedRMSNorm(nn.Module):
    """This rank's columns ``[lo, hi)`` of an RMSNorm over ``full`` columns."""

    def __init__(self, weight: torch.Tensor, full: int, eps: float, group):
        super().__init__()
        self.weight = nn.Parameter(weight)
        self.full, self.eps, self.group = full, eps, group

    @classmethod
    def from_dense(cls, norm: nn.Module, group, tp: int, tp_rank: int) -> "ShardedRMSNorm":
        full = norm.weight.shape[0]
        lo, hi = even_range(full, tp_rank, tp)
        out = cls(norm.weight.detach()[lo:hi].clone(), full, norm.eps, group)
        mark_sharded(out.weight, 0, (lo, hi), full, tp_rank)
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        squares = _SumOverRanks.apply(xf.pow(2).sum(-1, keepdim=True), self.group)
        y = xf * torch.rsqrt(squares / self.full + self.eps)
        return self.weight * y.to(x.dtype)
