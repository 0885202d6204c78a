"""Tensor-parallel communication as autograd functions that undo each other.

Each function takes its process group explicitly (``topo.tp_group``); a ``None`` group, or
a group of one, makes every function the identity, so the same code runs at tp=1.

Pairs, forward <-> backward (``p`` = ranks in the group)::

    copy_to_tp_region          identity                  <-> all-reduce (sum)
    reduce_from_tp_region      all-reduce (sum)          <-> identity
    scatter_to_tp_region       keep my 1/p of dim -1     <-> all-gather dim -1
    gather_from_tp_region      all-gather dim -1         <-> keep my 1/p of dim -1
    scatter_to_sequence        keep my 1/p of dim 1      <-> all-gather dim 1
    gather_from_sequence       all-gather dim 1          <-> reduce-scatter dim 1
    reduce_scatter_to_sequence reduce-scatter dim 1      <-> all-gather dim 1

``gather_from_sequence`` feeds a column-parallel layer, whose input gradient is a partial
sum on each rank (each rank holds some output features): its backward therefore sums and
scatters in one reduce-scatter. With ``grad_is_partial=False`` it splits instead.

The sequence dimension is 1: activations are (B, S, H) as in ``models/llama``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from parallel3d.distributed import all_reduce, reduce_scatter_flat

SEQ_DIM = 1  # activations are (B, S, H)


def group_size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group) -> int:
    return 0 if group is None else dist.get_rank(group)


# -- the collectives themselves (no autograd) -----------------------------------------------

def _all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    if group_size(group) == 1:
        return x
    return all_reduce(x.contiguous(), group)


def _split(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """This rank's 1/p of ``x`` along ``dim`` (a copy, so the full tensor can be freed)."""
    p = group_size(group)
    if p == 1:
        return x
    if x.shape[dim] % p:
        raise ValueError(f"dim {dim} of size {x.shape[dim]} does not split over {p} ranks")
    return x.chunk(p, dim=dim)[group_rank(group)].contiguous()


def _all_gather(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim``, in rank order."""
    p = group_size(group)
    if p == 1:
        return x
    front = x.movedim(dim, 0).contiguous()  # the collective concatenates along dim 0
    out = front.new_empty((p * front.shape[0], *front.shape[1:]))
    dist.all_gather_single(out, front, group=group)
    return out.movedim(0, dim).contiguous()


def _reduce_scatter(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """Sum ``x`` over the ranks and keep this rank's 1/p along ``dim``."""
    p = group_size(group)
    if p == 1:
        return x
    if x.shape[dim] % p:
        raise ValueError(f"dim {dim} of size {x.shape[dim]} does not split over {p} ranks")
    front = x.movedim(dim, 0).contiguous()
    out = front.new_empty((front.shape[0] // p, *front.shape[1:]))
    reduce_scatter_flat(out.view(-1), front.view(-1), group)
    return out.movedim(0, dim).contiguous()


# -- autograd pairs ------------------------------------------------------------------------

class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x.clone(), group)  # never reduce into the caller's tensor

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _split(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, ctx.dim, ctx.group), None, None


class _GatherFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group, grad_is_partial):
        ctx.dim, ctx.group, ctx.grad_is_partial = dim, group, grad_is_partial
        return _all_gather(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        if ctx.grad_is_partial:
            return _reduce_scatter(grad, ctx.dim, ctx.group), None, None, None
        return _split(grad, ctx.dim, ctx.group), None, None, None


class _ReduceScatterToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _reduce_scatter(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, ctx.dim, ctx.group), None, None


def _identity(group) -> bool:
    return group_size(group) == 1


def copy_to_tp_region(x: torch.Tensor, group) -> torch.Tensor:
    """Forward: identity. Backward: all-reduce the gradient (each rank used ``x`` for a
    different part of the output, so the gradient of ``x`` is the sum of theirs)."""
    return x if _identity(group) else _CopyToRegion.apply(x, group)


def reduce_from_tp_region(x: torch.Tensor, group) -> torch.Tensor:
    """Forward: all-reduce partial sums into the full value. Backward: identity."""
    return x if _identity(group) else _ReduceFromRegion.apply(x, group)


def scatter_to_tp_region(x: torch.Tensor, group) -> torch.Tensor:
    """Forward: keep this rank's 1/p of the last dim. Backward: all-gather it."""
    return x if _identity(group) else _ScatterToRegion.apply(x, -1, group)


def gather_from_tp_region(x: torch.Tensor, group) -> torch.Tensor:
    """Forward: all-gather the last dim. Backward: keep this rank's 1/p of it."""
    return x if _identity(group) else _GatherFromRegion.apply(x, -1, group, False)


def scatter_to_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """Forward: keep this rank's 1/p of the sequence. Backward: all-gather it."""
    return x if _identity(group) else _ScatterToRegion.apply(x, SEQ_DIM, group)


def gather_from_sequence(x: torch.Tensor, group, grad_is_partial: bool = True) -> torch.Tensor:
    """Forward: all-gather the sequence shards, (B, S/p, H) -> (B, S, H). Backward:
    reduce-scatter (``grad_is_partial``, the input of a column-parallel layer) or split."""
    return x if _identity(group) else _GatherFromRegion.apply(x, SEQ_DIM, group, grad_is_partial)


def reduce_scatter_to_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """Forward: sum partial (B, S, H) over ranks, keep (B, S/p, H). Backward: all-gather."""
    return x if _identity(group) else _ReduceScatterToRegion.apply(x, SEQ_DIM, group)
