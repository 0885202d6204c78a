"""Attention of this rank's head-tail queries over the whole sequence's gathered K/V, block
by block: the all-gather mode's local computation.

The sequence is ``2 cp`` chunks of ``c`` tokens; this rank's queries are chunks
``a = r`` and ``a = 2cp-1-r``. Query chunk ``a`` attends key chunks ``0 .. a-1`` whole and
chunk ``a`` causally; the chunks after it are fully masked and never computed. A rank
computes ``2 cp + 1`` blocks of ``c x c`` whatever its rank (the head-tail balance), where
one SDPA call with an (S_l, S) mask computes all ``2 cp`` of its ``c x S`` scores (the mask
does not skip work) and, on CPU, applies the mask element by element.

Blocks are :mod:`blocks`' (the CPU flash kernel with its log-sum-exp, or the explicit
math), run as spans (``spans.py``: blocks with the same queries and adjacent keys, or the
other way round, are one call), merged by log-sum-exp; the backward recomputes each span
from the saved q, K/V, output and log-sum-exp. Packed documents: each span's mask from
the queries' document starts and the keys' global positions (``documents.py``).

The blocks come in two parts (:func:`gathered_spans`): those on the rank's own two key
chunks (the ring's step 0, ``1 / cp`` of its attention), which need nothing from the
other ranks, and those on the other ranks' chunks. Across ranks
(:func:`overlapped_gather_attention`, what ``comm="allgather"`` runs) the own part runs
while the all-gather of K/V is in flight; in the backward the other part runs first, its
dK/dV go out in an asynchronous reduce-scatter (summed in fp32 on gloo, in K/V's dtype on
NCCL), and the own part's backward runs under it. :func:`gathered_attention` computes the
same parts on K/V given whole, for every rank in one process (``local.py``, tests).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from parallel3d.distributed import all_gather_flat, check_device, reduce_scatter_flat

from .blocks import CAUSAL, FULL
from .documents import DocumentStarts
from .sharding import head_tail_chunks, shard_sequence, unshard_sequence
from .spans import Span, backward_spans, forward_spans, merge_spans


def gathered_plan(cp: int, cp_rank: int) -> list[tuple[int, int, str]]:
    """``(q_half, key_chunk, kind)`` of every block this rank computes."""
    return [(qi, b, CAUSAL if b == a else FULL)
            for qi, a in enumerate(head_tail_chunks(cp, cp_rank)) for b in range(a + 1)]


def gathered_spans(cp: int, cp_rank: int) -> tuple[list[Span], list[Span]]:
    """:func:`gathered_plan` in its two parts as spans (``spans.merge_spans``): the blocks
    on the rank's own key chunks, in positions of its local K/V (0 its head chunk, 1 its
    tail), and the blocks on the other ranks' chunks, in global chunk order."""
    own = head_tail_chunks(cp, cp_rank)
    plan = gathered_plan(cp, cp_rank)
    return (merge_spans([(qi, own.index(b), kind) for qi, b, kind in plan if b in own]),
            merge_spans([block for block in plan if block[1] not in own]))


def _forward(q, own_kv, gathered, docs, scale, cp: int, cp_rank: int):
    """(O in q's dtype, lse fp32, the K/V in global order (2, B, Hkv, S, D)): the own
    chunks' blocks on ``own_kv`` (2, B, Hkv, S_l, D), then ``gathered()``'s K/V for the
    others'."""
    own, others = gathered_spans(cp, cp_rank)
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    lse = torch.full(q.shape[:-1], float("-inf"), device=q.device)
    forward_spans(q, own_kv, own, head_tail_chunks(cp, cp_rank), docs, scale, out, lse)
    kv = gathered()
    forward_spans(q, kv, others, range(2 * cp), docs, scale, out, lse)
    return out.to(q.dtype), lse, kv


def _backward(q, kv, o, lse, d_out, docs, scale, cp: int, cp_rank: int, reduce_scatter):
    """(dq, dK/dV of the own chunks (2, B, Hkv, S_l, D) fp32, the handle): the other
    chunks' blocks first, their dK/dV (2, B, Hkv, S, D; zero on the own chunks) handed to
    ``reduce_scatter``, whose handle's ``wait()`` gives what the other ranks add to the
    own chunks, then the own chunks' blocks under it."""
    own, others = gathered_spans(cp, cp_rank)
    d_out = d_out.to(q.dtype)
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dkv_others = torch.zeros(kv.shape, dtype=torch.float32, device=q.device)
    backward_spans(q, kv, o, d_out, lse, others, range(2 * cp), docs, scale, dq, dkv_others)
    pending = reduce_scatter(dkv_others)
    del dkv_others  # the handle keeps what it needs (across ranks: only its send buffer)
    own_kv = shard_sequence(kv, cp, cp_rank, dim=3)
    dkv = torch.zeros(own_kv.shape, dtype=torch.float32, device=q.device)
    backward_spans(q, own_kv, o, d_out, lse, own, head_tail_chunks(cp, cp_rank), docs, scale, dq, dkv)
    return dq, dkv.add_(pending.wait()), pending


class _Kept:
    """In one process nothing goes over the wire: the other chunks' dK/dV is kept whole
    for the caller (who sums every rank's), and the own chunks get nothing more here."""

    def __init__(self, dkv_others: torch.Tensor):
        self.dkv_others = dkv_others

    def wait(self) -> float:
        return 0.0


class _GatheredAttention(torch.autograd.Function):
    """q (B, H, S_l, D) local; kv (2, B, Hkv, S, D) whole sequence in global order;
    docs a ``DocumentStarts`` or None -> (B, H, S_l, D). Every rank in one process: the
    K/V's gradient is this rank's share for every chunk (the caller sums the ranks')."""

    @staticmethod
    def forward(ctx, q, kv, docs, cp, cp_rank, scale):
        o, lse, _ = _forward(q, shard_sequence(kv, cp, cp_rank, dim=3), lambda: kv, docs, scale, cp, cp_rank)
        ctx.save_for_backward(q, kv, o, lse)
        ctx.docs, ctx.cp, ctx.cp_rank, ctx.scale = docs, cp, cp_rank, scale
        return o

    @staticmethod
    def backward(ctx, d_out):
        q, kv, o, lse = ctx.saved_tensors
        cp, r = ctx.cp, ctx.cp_rank
        dq, dkv_own, kept = _backward(q, kv, o, lse, d_out, ctx.docs, ctx.scale, cp, r, _Kept)
        dkv = kept.dkv_others
        halves = dkv_own.tensor_split(2, dim=3)
        for chunk, half in zip(head_tail_chunks(cp, r), halves):  # the own chunks' share, in place
            c = half.shape[3]
            dkv[:, :, :, chunk * c:(chunk + 1) * c].add_(half)
        return dq.to(q.dtype), dkv.to(kv.dtype), None, None, None, None


def gathered_attention(q, kv, cp: int, cp_rank: int, doc_starts=None, scale=None):
    """This rank's head-tail queries over the K/V of the whole sequence given whole (module
    docstring); ``doc_starts`` the local queries' document starts (B, S_l), or a
    ``documents.DocumentStarts``, or None."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return _GatheredAttention.apply(q, kv, DocumentStarts.of(doc_starts), cp, cp_rank, scale)


class _ReduceScatter:
    """The other chunks' dK/dV on their way to their owners: ``wait()`` gives this rank's
    chunks' sum over the cp group (fp32)."""

    def __init__(self, dkv: torch.Tensor, group, dtype: torch.dtype):
        cp = dist.get_world_size(group)
        # each rank's chunks of it, in the all-gather's layout (cp, 2, B, Hkv, S_l, D), in
        # K/V's dtype: one buffer, copied into chunk by chunk
        chunks = dkv.tensor_split(2 * cp, dim=3)
        c = chunks[0].shape[3]
        send = torch.empty((cp, *dkv.shape[:3], 2 * c, dkv.shape[4]), dtype=dtype, device=dkv.device)
        for p in range(cp):
            for half, chunk in enumerate(head_tail_chunks(cp, p)):
                send[p, :, :, :, half * c:(half + 1) * c].copy_(chunks[chunk])
        self.received = torch.empty(send.shape[1:], dtype=torch.float32, device=dkv.device)
        self.work = reduce_scatter_flat(self.received.view(-1), send.view(-1), group, async_op=True)
        self.send = send  # alive until the collective is done

    def wait(self) -> torch.Tensor:
        self.work.wait()
        return self.received


class _OverlappedGather(torch.autograd.Function):
    """q (B, H, S_l, D), k / v (B, Hkv, S_l, D) local, docs a ``DocumentStarts`` or None
    -> (B, H, S_l, D): the K/V all-gather and the dK/dV reduce-scatter over ``group``
    under the own chunks' blocks (module docstring)."""

    @staticmethod
    def forward(ctx, q, k, v, docs, group, scale):
        cp, r = dist.get_world_size(group), dist.get_rank(group)
        kv = torch.stack([k, v])  # (2, B, Hkv, S_l, D)
        check_device(kv, group)
        every = torch.empty((cp, *kv.shape), dtype=kv.dtype, device=kv.device)
        work = all_gather_flat(every.view(-1), kv.view(-1), group=group, async_op=True)

        def gathered():
            work.wait()
            return unshard_sequence(every.unbind(0), dim=3)  # (2, B, Hkv, S, D), global order

        o, lse, kv_all = _forward(q, kv, gathered, docs, scale, cp, r)
        ctx.save_for_backward(q, kv_all, o, lse)
        ctx.docs, ctx.group, ctx.scale = docs, group, scale
        return o

    @staticmethod
    def backward(ctx, d_out):
        q, kv, o, lse = ctx.saved_tensors
        group = ctx.group
        cp, r = dist.get_world_size(group), dist.get_rank(group)
        dq, dkv, _ = _backward(q, kv, o, lse, d_out, ctx.docs, ctx.scale, cp, r,
                               lambda dkv_others: _ReduceScatter(dkv_others, group, kv.dtype))
        return dq.to(q.dtype), dkv[0].to(kv.dtype), dkv[1].to(kv.dtype), None, None, None


def overlapped_gather_attention(q, k, v, group, doc_starts=None, scale=None):
    """This rank's head-tail queries over the whole sequence, K/V all-gathered over the cp
    ``group`` (cp >= 2) under the own chunks' blocks (module docstring); ``doc_starts`` as
    :func:`gathered_attention`."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return _OverlappedGather.apply(q, k, v, DocumentStarts.of(doc_starts), group, scale)
