"""Expert-parallel token dispatch: all-to-all of counts, then tokens, local experts, and back.

``ep`` ranks of ``ep_group`` share ``E`` experts, rank r holding the ``L = E / ep`` experts
``[r L, (r + 1) L)``. Each rank routes its own tokens and sorts its ``N`` assignments
expert-major (``models/moe/experts.py``); since the experts of one rank are consecutive
ids, the rows for rank j are one contiguous run. Then, per MoE layer::

    counts    all-to-all of the (ep, L) assignment counts: rank j learns, from every
              source rank i, how many rows of each of its experts arrive (no autograd)
    dispatch  all-to-all of the rows (splits: rows per destination / per source), the
              arrivals source-major, re-sorted local-expert-major (stable: source order
              inside each expert)
    experts   the local experts on their contiguous slices (``run_local``)
    combine   the inverse permutation, and the all-to-all back with the splits swapped

The row all-to-all is an autograd pair with itself: the backward of a dispatch with splits
(send, receive) is the all-to-all of the gradient with (receive, send), so the gradient of
each token flows back to the rank that owns it and each expert's weight gradient sums the
rows of every rank. At ``ep_group`` None or of one rank it is the local computation.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.distributed as dist

from parallel3d.distributed import check_device


def _group_size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _all_to_all_rows(x: torch.Tensor, send: list[int], receive: list[int], group) -> torch.Tensor:
    """Rows ``x`` (sum(send), ...) -> (sum(receive), ...): ``send[j]`` rows go to rank j,
    ``receive[i]`` come from rank i, in rank order."""
    x = x.contiguous()
    check_device(x, group)
    out = x.new_empty((sum(receive), *x.shape[1:]))
    dist.all_to_all_single(out, x, output_split_sizes=receive, input_split_sizes=send, group=group)
    return out


CATEGORY = "all-to-all"  # the timeline category of the token exchanges' waits


def _span(timeline, name: str):
    """The time blocked in a token all-to-all, as a span of category "all-to-all" on the
    trainer's timeline (not a breakdown category: it sits inside forward and backward)."""
    if timeline is None:
        return contextlib.nullcontext()
    return timeline.span(name, CATEGORY, lane="comm")


class _AllToAll(torch.autograd.Function):
    """Forward: rows by ``send`` / ``receive`` splits. Backward: the gradient's rows by the
    swapped splits, back to the ranks they came from."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, send: list[int], receive: list[int], group, timeline=None) -> torch.Tensor:
        ctx.send, ctx.receive, ctx.group, ctx.timeline = send, receive, group, timeline
        with _span(timeline, "all-to-all"):
            return _all_to_all_rows(x, send, receive, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        with _span(ctx.timeline, "all-to-all (backward)"):
            return _all_to_all_rows(grad, ctx.receive, ctx.send, ctx.group), None, None, None, None


def all_to_all_rows(x: torch.Tensor, send: list[int], receive: list[int], group, timeline=None) -> torch.Tensor:
    """Differentiable row all-to-all (see :class:`_AllToAll`); ``timeline``: where its
    waits are recorded (both directions)."""
    return _AllToAll.apply(x, send, receive, group, timeline)


def exchange_counts(counts: torch.Tensor, group) -> torch.Tensor:
    """``counts`` (E,) of this rank's assignments per global expert -> (ep, L): row i the
    counts rank i sends to this rank's L experts."""
    ep = _group_size(group)
    mine = counts.reshape(ep, -1).contiguous()  # (ep, L): row j for rank j's experts
    check_device(mine, group)
    received = torch.empty_like(mine)
    dist.all_to_all_single(received, mine, group=group)
    return received


def dispatch_experts_combine(x: torch.Tensor, counts: torch.Tensor,
                             run_local: Callable[[torch.Tensor, list[int]], torch.Tensor],
                             group, timeline=None) -> torch.Tensor:
    """Rows ``x`` (N, dim) sorted by global expert with ``counts`` (E,) per expert, through
    the experts wherever they live; returns (N, dim) in ``x``'s row order.

    ``run_local(rows, local_counts)`` runs this rank's L experts on rows sorted by local
    expert (``local_counts[e]`` rows for local expert e), as ``Experts.forward`` does.
    ``timeline``: the trainer's, where the all-to-alls' waits are recorded (category
    "all-to-all").
    """
    ep = _group_size(group)
    if ep == 1:
        return run_local(x, counts.tolist())
    if counts.numel() % ep:
        raise ValueError(f"{counts.numel()} experts do not split over an expert group of {ep} ranks")
    with _span(timeline, "all-to-all (counts)"):
        arriving = exchange_counts(counts, group)  # (ep, L)
        send = counts.reshape(ep, -1).sum(1).tolist()
        receive = arriving.sum(1).tolist()
    rows = all_to_all_rows(x, send, receive, group, timeline)  # (R, dim), source-major
    n_local = arriving.shape[1]
    local_expert = torch.arange(n_local, device=counts.device).repeat(ep)  # each (source, expert) run
    order = torch.argsort(torch.repeat_interleave(local_expert, arriving.reshape(-1)), stable=True)
    # Both permutations are index_select gathers (the same rows as indexing / index_copy,
    # faster on CPU; a permutation's backward adds each row once to zeros: exact).
    out = run_local(rows.index_select(0, order), arriving.sum(0).tolist())  # local-expert-major
    inverse = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
    back = out.index_select(0, inverse)  # source-major again
    return all_to_all_rows(back, receive, send, group, timeline)
