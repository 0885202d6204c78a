"""Attention of this rank's head-tail queries over the whole sequence's gathered K/V, block
by block: the all-gather mode's local computation.

The sequence is ``2 cp`` chunks of ``c`` tokens; this rank's queries are chunks
``a = r`` and ``a = 2cp-1-r``. Query chunk ``a`` attends key chunks ``0 .. a-1`` whole and
chunk ``a`` causally; the chunks after it are fully masked and never computed. A rank
computes ``2 cp + 1`` blocks of ``c x c`` whatever its rank (the head-tail balance), where
one SDPA call with an (S_l, S) mask computes all ``2 cp`` of its ``c x S`` scores (the mask
does not skip work) and, on CPU, applies the mask element by element.

Blocks are :mod:`blocks`' (the CPU flash kernel with its log-sum-exp, or the explicit
math), merged by log-sum-exp; the backward recomputes each block from the saved q, K/V,
output and log-sum-exp. The gradient of the gathered K/V goes back to
``comm.gather_from_cp``, whose backward reduce-scatters it to the owners.
"""

from __future__ import annotations

import torch

from .blocks import CAUSAL, FULL, block_backward, block_forward, block_mask, merge_
from .sharding import head_tail_chunks


def gathered_plan(cp: int, cp_rank: int) -> list[tuple[int, int, str]]:
    """``(q_half, key_chunk, kind)`` of every block this rank computes."""
    return [(qi, b, CAUSAL if b == a else FULL)
            for qi, a in enumerate(head_tail_chunks(cp, cp_rank)) for b in range(a + 1)]


class _GatheredAttention(torch.autograd.Function):
    """q (B, H, S_l, D) local; kv (2, B, Hkv, S, D) whole sequence in global order;
    q_docs (B, S_l) and k_docs (B, S), or None -> (B, H, S_l, D)."""

    @staticmethod
    def forward(ctx, q, kv, q_docs, k_docs, cp, cp_rank, scale):
        qh = q.tensor_split(2, dim=2)
        kc = kv.tensor_split(2 * cp, dim=3)  # (2, B, Hkv, c, D) each
        qd = None if q_docs is None else q_docs.tensor_split(2, dim=-1)
        kd = None if k_docs is None else k_docs.tensor_split(2 * cp, dim=-1)
        out = [torch.zeros(h.shape, dtype=torch.float32, device=q.device) for h in qh]
        lse = [torch.full(h.shape[:-1], float("-inf"), device=q.device) for h in qh]
        for qi, b, kind in gathered_plan(cp, cp_rank):
            same_doc = None if qd is None else block_mask(qd[qi], kd[b])
            merge_(out[qi], lse[qi], *block_forward(qh[qi], kc[b][0], kc[b][1], kind, same_doc, scale))
        o = torch.cat(out, dim=2).to(q.dtype)
        ctx.save_for_backward(q, kv, o, torch.cat(lse, dim=2), q_docs, k_docs)
        ctx.cp, ctx.cp_rank, ctx.scale = cp, cp_rank, scale
        return o

    @staticmethod
    def backward(ctx, d_out):
        q, kv, o, lse, q_docs, k_docs = ctx.saved_tensors
        cp, scale = ctx.cp, ctx.scale
        d_out = d_out.to(q.dtype)
        delta = (d_out.float() * o.float()).sum(-1)  # (B, H, S_l)
        qh, oh, doh, lseh, deltah = (x.tensor_split(2, dim=2) for x in (q, o, d_out, lse, delta))
        kc = kv.tensor_split(2 * cp, dim=3)
        qd = None if q_docs is None else q_docs.tensor_split(2, dim=-1)
        kd = None if k_docs is None else k_docs.tensor_split(2 * cp, dim=-1)
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        dkv = torch.zeros(kv.shape, dtype=torch.float32, device=q.device)
        dqh, dkc = dq.tensor_split(2, dim=2), dkv.tensor_split(2 * cp, dim=3)
        for qi, b, kind in gathered_plan(cp, ctx.cp_rank):
            same_doc = None if qd is None else block_mask(qd[qi], kd[b])
            dq_b, dk_b, dv_b = block_backward(qh[qi], kc[b][0], kc[b][1], oh[qi], doh[qi], lseh[qi],
                                              deltah[qi], kind, same_doc, scale)
            dqh[qi].add_(dq_b)
            dkc[b][0].add_(dk_b)
            dkc[b][1].add_(dv_b)
        return dq.to(q.dtype), dkv.to(kv.dtype), None, None, None, None, None


def gathered_attention(q, kv, cp: int, cp_rank: int, q_docs=None, k_docs=None, scale=None):
    """This rank's head-tail queries over the gathered ``kv`` (module docstring)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return _GatheredAttention.apply(q, kv, q_docs, k_docs, cp, cp_rank, scale)
