"""Ring attention: K/V passed around the cp group, one block of keys per step.

Rank ``r`` starts with its own K/V (chunks ``r`` and ``2cp-1-r``); at each of ``cp - 1``
steps it posts the send of the K/V it holds to ``r+1`` and the receive from ``r-1``, then
computes the blocks of the K/V at hand (``blocks.ring_plan``: fully masked blocks are
skipped) while the transfer runs, and merges each block's partial output by its
log-sum-exp. Messages per rank and layer: forward ``cp-1`` K/V shards; backward ``cp-1``
K/V shards again plus ``cp`` fp32 dK/dV shards.

Backward recomputes each block (nothing but q, k, v, the output and the lse is kept)
and passes dK/dV along with K/V: the accumulator of the K/V a rank holds picks up its
share and travels on, so that after the last step it reaches the K/V's owner, complete.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .blocks import block_backward, block_forward, block_mask, merge_, ring_plan
from .comm import gather_ids, ring_shift

KV_TAG, GRAD_TAG = 0, 1


def _halves(x: torch.Tensor, dim: int):
    return x.tensor_split(2, dim=dim)


def _docs_by_rank(doc_ids, group):
    """Every rank's (head, tail) document ids, (B, c) each, or None."""
    if doc_ids is None:
        return None
    return [_halves(d, -1) for d in gather_ids(doc_ids, group).unbind(0)]


def _same_doc(docs, r: int, qi: int, src: int, ki: int):
    """The block's same-document mask (B, 1, c, c): local half ``qi`` against half ``ki``
    of cp rank ``src``'s keys; None without documents."""
    return None if docs is None else block_mask(docs[r][qi], docs[src][ki])


class _RingAttention(torch.autograd.Function):
    """q (B, H, S_l, D), k / v (B, Hkv, S_l, D), doc_ids (B, S_l) or None -> (B, H, S_l, D)."""

    @staticmethod
    def forward(ctx, q, k, v, doc_ids, group, scale):
        cp, r = dist.get_world_size(group), dist.get_rank(group)
        qh = _halves(q, 2)  # head and tail chunk, (B, H, c, D) each
        docs = _docs_by_rank(doc_ids, group)
        out = [torch.zeros(h.shape, dtype=torch.float32, device=q.device) for h in qh]
        lse = [torch.full(h.shape[:-1], float("-inf"), device=q.device) for h in qh]
        kv = torch.stack([k, v])  # (2, B, Hkv, S_l, D): one message a step
        for t, blocks in enumerate(ring_plan(cp, r)):
            pending = ring_shift(kv, group, KV_TAG) if t < cp - 1 else None
            src = (r - t) % cp
            kh, vh = _halves(kv[0], 2), _halves(kv[1], 2)
            for qi, ki, kind in blocks:
                same_doc = _same_doc(docs, r, qi, src, ki)
                o_b, lse_b = block_forward(qh[qi], kh[ki], vh[ki], kind, same_doc, scale)
                merge_(out[qi], lse[qi], o_b, lse_b)
            if pending is not None:
                kv = pending.wait()
        o = torch.cat(out, dim=2).to(q.dtype)  # (B, H, S_l, D)
        ctx.save_for_backward(q, k, v, o, torch.cat(lse, dim=2), doc_ids)
        ctx.group, ctx.scale, ctx.has_docs = group, scale, doc_ids is not None
        return o

    @staticmethod
    def backward(ctx, d_out):
        q, k, v, o, lse, doc_ids = ctx.saved_tensors
        group, scale = ctx.group, ctx.scale
        cp, r = dist.get_world_size(group), dist.get_rank(group)
        d_out = d_out.to(q.dtype)
        delta = (d_out.float() * o.float()).sum(-1)  # (B, H, S_l)
        qh, oh, doh, lseh, deltah = (_halves(x, 2) for x in (q, o, d_out, lse, delta))
        docs = _docs_by_rank(doc_ids if ctx.has_docs else None, group)
        dq = [torch.zeros(h.shape, dtype=torch.float32, device=q.device) for h in qh]
        kv = torch.stack([k, v])
        incoming = None  # the dK/dV accumulator of the K/V now held, from rank r-1
        for t, blocks in enumerate(ring_plan(cp, r)):
            pending = ring_shift(kv, group, KV_TAG) if t < cp - 1 else None
            src = (r - t) % cp
            kh, vh = _halves(kv[0], 2), _halves(kv[1], 2)
            dkv = torch.zeros(kv.shape, dtype=torch.float32, device=q.device)  # (2, B, Hkv, S_l, D)
            dkh, dvh = _halves(dkv[0], 2), _halves(dkv[1], 2)
            for qi, ki, kind in blocks:
                same_doc = _same_doc(docs, r, qi, src, ki)
                dq_b, dk_b, dv_b = block_backward(qh[qi], kh[ki], vh[ki], oh[qi], doh[qi], lseh[qi],
                                                  deltah[qi], kind, same_doc, scale)
                dq[qi].add_(dq_b)
                dkh[ki].add_(dk_b)
                dvh[ki].add_(dv_b)
            if incoming is not None:
                dkv.add_(incoming.wait())
            incoming = ring_shift(dkv, group, GRAD_TAG)  # on to the next holder, last: the owner
            if pending is not None:
                kv = pending.wait()
        dkv = incoming.wait()
        return torch.cat(dq, dim=2).to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None


def ring_attention(q, k, v, group, doc_ids=None, scale=None):
    """Causal attention of this rank's head-tail queries over the whole sequence, K/V
    passed around ``group`` (cp >= 2). See the module docstring."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return _RingAttention.apply(q, k, v, doc_ids, group, scale)
