"""Fixed-cost pipeline chunks, for measuring schedules rather than models.

Each chunk's forward sleeps ``t_fwd`` seconds and its backward ``t_bwd``; the tensors
passed between stages are real (so the point-to-point path is the one training uses) but
tiny. Sleeping rather than computing keeps every stage's cost fixed when more processes
than cores share a machine, so the measured bubble reflects the schedule, not contention.
"""

from __future__ import annotations

import time

import torch
from torch import nn


class _Sleep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, t_fwd: float, t_bwd: float) -> torch.Tensor:
        time.sleep(t_fwd)
        ctx.t_bwd = t_bwd
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        time.sleep(ctx.t_bwd)
        return grad, None, None


class FixedCostChunk(nn.Module):
    """``(mb, S) tokens`` (first chunk) or ``(mb, S, dim)`` -> ``(mb, S, dim)``, sleeping
    ``t_fwd`` forward and ``t_bwd`` backward; one scalar weight so there is a gradient."""

    def __init__(self, t_fwd: float, t_bwd: float, dim: int, first: bool):
        super().__init__()
        self.t_fwd, self.t_bwd, self.dim, self.first = t_fwd, t_bwd, dim, first
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            x = x.float().unsqueeze(-1).expand(*x.shape, self.dim)
        return _Sleep.apply(x * self.scale, self.t_fwd, self.t_bwd)


def mean_loss(out: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return out.float().mean()
