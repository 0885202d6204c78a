"""Summing the gradients of parameters that several tensor-parallel ranks hold.

Two kinds of parameter are held by more than one rank of the tp group and see only part
of the batch's gradient on each (marked ``p.p3d_tp_partial_grad`` by the layers):

* norm weights (and row-parallel biases) under sequence parallelism: each rank applies
  them to its own sequence shard, so the full gradient is the sum over the tp group;
* kv-head projections replicated over ``p3d_tp_shared`` consecutive ranks (tp greater
  than n_kv_heads): each holder's query heads contribute a part of the gradient.

The optimizer (:class:`~parallel3d.zero.ZeroOptimizer`, every stage) sums those parts
on its reduced gradient shard with :func:`sum_over_tp_holders`, once per step after the
last backward (gradient accumulation has summed the micro-batches, so one collective per
step suffices); :func:`sync_tensor_parallel_grads` does the same to ``p.grad`` for a loop
without it (the tests' references). Parameters sharing the same ``p3d_tp_shared`` are
flattened into one buffer: one all-reduce for all norm weights, one for all replicated kv
projections.
"""

from __future__ import annotations

from collections import defaultdict

import torch
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from parallel3d.distributed import all_reduce


def partial_grad_params(params) -> list[torch.nn.Parameter]:
    return [p for p in params if getattr(p, "p3d_tp_partial_grad", False)]


@torch.no_grad()
def sync_tensor_parallel_grads(params, topo) -> None:
    """``g <- sum of g over the tp ranks holding the same copy`` for every parameter
    marked ``p3d_tp_partial_grad`` (a no-op when there are none or tp == 1)."""
    sum_over_tp_holders([(p.grad, p.p3d_tp_shared) for p in partial_grad_params(params)
                         if p.grad is not None], topo)


@torch.no_grad()
def sum_over_tp_holders(pieces: list[tuple[torch.Tensor, int]], topo) -> None:
    """Sum each tensor, in place, over the runs of ``shared`` consecutive tp ranks that hold
    it. ``pieces`` pairs a gradient (or any piece of one, such as a ZeRO shard's slice of
    it: every tp rank must pass pieces of the same shapes in the same order) with its
    ``p3d_tp_shared``."""
    if topo.tp_group is None or not pieces:  # tp = 1 (or no process groups: a dry run)
        return
    by_shared: dict[int, list[torch.Tensor]] = defaultdict(list)
    for g, shared in pieces:
        by_shared[shared].append(g)
    for shared, grads in sorted(by_shared.items()):
        flat = _flatten_dense_tensors(grads)  # (n,)
        if shared == topo.tp:
            all_reduce(flat, topo.tp_group)
        else:
            # Holders are runs of `shared` consecutive tp ranks. Each rank writes its part
            # into the row of its run in a (tp/shared, n) buffer of zeros; one all-reduce
            # over the tp group then sums every run at once, with no extra process groups.
            runs = torch.zeros(topo.tp // shared, flat.numel(), dtype=flat.dtype, device=flat.device)
            runs[topo.tp_rank // shared] = flat
            all_reduce(runs, topo.tp_group)
            flat = runs[topo.tp_rank // shared]
        for g, summed in zip(grads, _unflatten_dense_tensors(flat, grads)):
            g.copy_(summed)
