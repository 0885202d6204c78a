"""Fixed-cost pipeline chunks, for measuring schedules rather than models.

Each chunk's forward sleeps ``t_fwd`` seconds and its backward ``t_bwd`` (the input
gradient) plus ``t_w`` (the weight gradient: deferred to the schedule's W when the
schedule splits the backward, :mod:`parallel3d.kernels.deferred`); the tensors passed
between stages are real (so the point-to-point path is the one training uses) but tiny.
Sleeping rather than computing keeps every stage's cost fixed when more processes than
cores share a machine, so the measured bubble reflects the schedule, not contention.
"""

from __future__ import annotations

import time

import torch
from torch import nn

from parallel3d.kernels.deferred import defer


class _Sleep(torch.autograd.Function):
    """``y = x * scale``, sleeping: forward ``t_fwd``; backward ``t_bwd`` for dx and
    ``t_w`` for d(scale), the latter recorded for the W when one is being recorded."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: torch.Tensor, t_fwd: float, t_bwd: float, t_w: float):
        time.sleep(t_fwd)
        ctx.save_for_backward(x)
        ctx.scale, ctx.t_bwd, ctx.t_w = scale, t_bwd, t_w
        return x * scale

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (x,) = ctx.saved_tensors
        scale, t_w = ctx.scale, ctx.t_w
        time.sleep(ctx.t_bwd)

        def weight_grads() -> list:
            time.sleep(t_w)
            return [(scale, (grad * x).sum().to(scale.dtype))]

        dx = grad * scale.detach()
        if defer(weight_grads):
            return dx, None, None, None, None
        return dx, weight_grads()[0][1], None, None, None


class FixedCostChunk(nn.Module):
    """``(mb, S) tokens`` (first chunk) or ``(mb, S, dim)`` -> ``(mb, S, dim)``, sleeping
    ``t_fwd`` forward and ``t_bwd`` + ``t_w`` backward; one scalar weight so there is a
    gradient."""

    def __init__(self, t_fwd: float, t_bwd: float, dim: int, first: bool, t_w: float = 0.0):
        super().__init__()
        self.t_fwd, self.t_bwd, self.t_w, self.dim, self.first = t_fwd, t_bwd, t_w, dim, first
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            x = x.float().unsqueeze(-1).expand(*x.shape, self.dim)
        return _Sleep.apply(x, self.scale, self.t_fwd, self.t_bwd, self.t_w)


def mean_loss(out: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return out.float().mean()
