"""Ring attention: K/V passed around the cp group, one block of keys per step.

Rank ``r`` starts with its own K/V (chunks ``r`` and ``2cp-1-r``); at each of ``cp - 1``
steps it posts the send of the K/V it holds to ``r+1`` and the receive from ``r-1``, then
computes the blocks of the K/V at hand (``blocks.ring_plan``: fully masked blocks are
skipped; as spans, ``spans.py``: fewer, larger kernel calls) while the transfer runs, and
merges each span's partial output by its log-sum-exp. Packed documents need no
communication: a block's mask is the queries' document starts against the keys' global
positions (``documents.py``). Messages per rank and layer: forward ``cp-1`` K/V shards;
backward ``cp-1`` K/V shards again plus ``cp-1`` fp32 dK/dV shards.

Backward recomputes each block (nothing but q, k, v, the output and the lse is kept)
and passes dK/dV along with K/V: the accumulator of a rank's K/V starts at the next rank
(step 1), picks up each holder's share and travels on, so that after the last step it
reaches the K/V's owner, which adds its own share, kept at home. The owner computes one
block of its own chunks last, after sending its last accumulator on: that message, the
only one with no step after it, runs under that block.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .blocks import ring_plan
from .comm import ring_shift
from .documents import DocumentStarts
from .spans import Span, backward_spans, forward_spans, merge_spans

KV_TAG, GRAD_TAG = 0, 1


def ring_spans(cp: int, cp_rank: int) -> list[list[Span]]:
    """``blocks.ring_plan``'s blocks of each step as spans (``spans.merge_spans``): at
    step 0 the three blocks of the own chunks, at each later step one span (both query
    chunks against the head chunk held, or the tail query chunk against both)."""
    return [merge_spans(step) for step in ring_plan(cp, cp_rank)]


def _held_chunks(cp: int, cp_rank: int, t: int) -> tuple[int, int]:
    """The global chunks of the K/V held at step ``t``: cp rank ``(cp_rank - t) % cp``'s."""
    src = (cp_rank - t) % cp
    return src, 2 * cp - 1 - src


def ring_forward(q, k, v, docs, scale, cp: int, cp_rank: int, shift):
    """(O (B, H, S_l, D) in q's dtype, lse (B, H, S_l) fp32) of this rank's queries over
    the whole sequence. ``shift(x, tag)`` posts the send of ``x`` to cp rank ``r+1`` and
    the receive from ``r-1`` and returns a handle whose ``wait()`` gives what came in
    (``comm.ring_shift`` on the cp group; anything that delivers the same, for cp ranks
    in one process)."""
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    lse = torch.full(q.shape[:-1], float("-inf"), device=q.device)
    kv = torch.stack([k, v])  # (2, B, Hkv, S_l, D): one message a step
    for t, spans in enumerate(ring_spans(cp, cp_rank)):
        pending = shift(kv, KV_TAG) if t < cp - 1 else None
        forward_spans(q, kv, spans, _held_chunks(cp, cp_rank, t), docs, scale, out, lse)
        if pending is not None:
            kv = pending.wait()
    return out.to(q.dtype), lse


def ring_backward(q, k, v, o, lse, d_out, docs, scale, cp: int, cp_rank: int, shift):
    """(dq, dk, dv) of this rank's q, k, v from its ``o``, ``lse`` and upstream ``d_out``;
    ``shift`` as :func:`ring_forward`. dK/dV accumulators travel with the K/V and end at
    their owner, which adds its own share (module docstring)."""
    d_out = d_out.to(q.dtype)
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    own_kv = kv = torch.stack([k, v])
    steps = ring_spans(cp, cp_rank)
    *early, last = steps[0]  # the own chunks' spans; the last one waits for the end
    own = torch.zeros(kv.shape, dtype=torch.float32, device=q.device)  # (2, B, Hkv, S_l, D)
    incoming = None  # the dK/dV accumulator of the K/V now held, from rank r-1
    for t, spans in enumerate(steps):
        pending = shift(kv, KV_TAG) if t < cp - 1 else None
        if t == 0:
            backward_spans(q, kv, o, d_out, lse, early, _held_chunks(cp, cp_rank, 0), docs, scale, dq, own)
        else:
            dkv = torch.zeros(kv.shape, dtype=torch.float32, device=q.device)
            backward_spans(q, kv, o, d_out, lse, spans, _held_chunks(cp, cp_rank, t), docs, scale, dq, dkv)
            if incoming is not None:
                dkv.add_(incoming.wait())
            incoming = shift(dkv, GRAD_TAG)  # on to the next holder, last: the owner
        if pending is not None:
            kv = pending.wait()
    backward_spans(q, own_kv, o, d_out, lse, [last], _held_chunks(cp, cp_rank, 0), docs, scale, dq, own)
    own.add_(incoming.wait())  # every other rank's share of this rank's K/V
    return dq.to(q.dtype), own[0].to(k.dtype), own[1].to(v.dtype)


class _RingAttention(torch.autograd.Function):
    """q (B, H, S_l, D), k / v (B, Hkv, S_l, D), docs a ``DocumentStarts`` or None -> (B, H, S_l, D)."""

    @staticmethod
    def forward(ctx, q, k, v, docs, group, scale):
        cp, r = dist.get_world_size(group), dist.get_rank(group)
        o, lse = ring_forward(q, k, v, docs, scale, cp, r, lambda x, tag: ring_shift(x, group, tag))
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.group, ctx.scale, ctx.docs = group, scale, docs
        return o

    @staticmethod
    def backward(ctx, d_out):
        q, k, v, o, lse = ctx.saved_tensors
        group = ctx.group
        cp, r = dist.get_world_size(group), dist.get_rank(group)
        grads = ring_backward(q, k, v, o, lse, d_out, ctx.docs, ctx.scale, cp, r,
                              lambda x, tag: ring_shift(x, group, tag))
        return (*grads, None, None, None)


def ring_attention(q, k, v, group, doc_starts=None, scale=None):
    """Causal attention of this rank's head-tail queries over the whole sequence, K/V
    passed around ``group`` (cp >= 2); ``doc_starts`` the local queries' document starts
    (B, S_l) (or a ``documents.DocumentStarts``), None for one causal sequence. See the
    module docstring."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return _RingAttention.apply(q, k, v, DocumentStarts.of(doc_starts), group, scale)
