"""Attention of this rank's head-tail queries over the whole sequence's gathered K/V, block
by block: the all-gather mode's local computation.

The sequence is ``2 cp`` chunks of ``c`` tokens; this rank's queries are chunks
``a = r`` and ``a = 2cp-1-r``. Query chunk ``a`` attends key chunks ``0 .. a-1`` whole and
chunk ``a`` causally; the chunks after it are fully masked and never computed. A rank
computes ``2 cp + 1`` blocks of ``c x c`` whatever its rank (the head-tail balance), where
one SDPA call with an (S_l, S) mask computes all ``2 cp`` of its ``c x S`` scores (the mask
does not skip work) and, on CPU, applies the mask element by element.

Blocks are :mod:`blocks`' (the CPU flash kernel with its log-sum-exp, or the explicit
math), run as spans (``spans.py``: a query chunk's earlier key chunks, adjacent in the
gathered K/V, are one call), merged by log-sum-exp; the backward recomputes each span
from the saved q, K/V, output and log-sum-exp. Packed documents: each span's mask from
the queries' document starts and the keys' global positions (``documents.py``). The
gradient of the gathered K/V goes back to ``comm.gather_from_cp``, whose backward
reduce-scatters it to the owners.
"""

from __future__ import annotations

import torch

from .blocks import CAUSAL, FULL
from .documents import DocumentStarts
from .sharding import head_tail_chunks
from .spans import Span, backward_spans, forward_spans, merge_spans


def gathered_plan(cp: int, cp_rank: int) -> list[tuple[int, int, str]]:
    """``(q_half, key_chunk, kind)`` of every block this rank computes."""
    return [(qi, b, CAUSAL if b == a else FULL)
            for qi, a in enumerate(head_tail_chunks(cp, cp_rank)) for b in range(a + 1)]


def gathered_spans(cp: int, cp_rank: int) -> list[Span]:
    """:func:`gathered_plan` as spans (``spans.merge_spans``): a query chunk's earlier key
    chunks are adjacent in the gathered K/V, one FULL span."""
    return merge_spans(gathered_plan(cp, cp_rank))


class _GatheredAttention(torch.autograd.Function):
    """q (B, H, S_l, D) local; kv (2, B, Hkv, S, D) whole sequence in global order;
    docs a ``DocumentStarts`` or None -> (B, H, S_l, D)."""

    @staticmethod
    def forward(ctx, q, kv, docs, cp, cp_rank, scale):
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.full(q.shape[:-1], float("-inf"), device=q.device)
        forward_spans(q, kv, gathered_spans(cp, cp_rank), range(2 * cp), docs, scale, out, lse)
        o = out.to(q.dtype)
        ctx.save_for_backward(q, kv, o, lse)
        ctx.docs, ctx.cp, ctx.cp_rank, ctx.scale = docs, cp, cp_rank, scale
        return o

    @staticmethod
    def backward(ctx, d_out):
        q, kv, o, lse = ctx.saved_tensors
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        dkv = torch.zeros(kv.shape, dtype=torch.float32, device=q.device)
        backward_spans(q, kv, o, d_out.to(q.dtype), lse, gathered_spans(ctx.cp, ctx.cp_rank), range(2 * ctx.cp),
                       ctx.docs, ctx.scale, dq, dkv)
        return dq.to(q.dtype), dkv.to(kv.dtype), None, None, None, None


def gathered_attention(q, kv, cp: int, cp_rank: int, doc_starts=None, scale=None):
    """This rank's head-tail queries over the gathered ``kv`` (module docstring);
    ``doc_starts`` the local queries' document starts (B, S_l), or a
    ``documents.DocumentStarts``, or None."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return _GatheredAttention.apply(q, kv, DocumentStarts.of(doc_starts), cp, cp_rank, scale)
