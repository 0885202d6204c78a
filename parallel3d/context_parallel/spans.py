"""The calls a rank makes: the plans' blocks merged into spans, and the spans run.

A span ``((q_lo, q_hi), (k_lo, k_hi), kind)`` is the local query chunks ``q_lo .. q_hi-1``
against the chunks ``k_lo .. k_hi-1`` of the K/V at hand (``c`` tokens each, ``c`` the
chunk size), FULL or CAUSAL. Two FULL blocks with the same queries and adjacent keys (or
the same keys and adjacent queries) make one FULL span: one kernel call instead of two,
and one log-sum-exp merge instead of two (the same score elements: within a span no
key is masked but by the documents). CAUSAL blocks (a chunk against itself) stay single.

At cp 2 this takes the all-gather mode from 5 calls a rank to 3 or 4 (a query chunk's
earlier key chunks are one span of the gathered K/V, in global order), and the ring's
later steps from 2 calls to 1 (both local query chunks against the head chunk held, or
the tail query chunk against both held chunks).

Running a span: its rows of the local queries and columns of the K/V at hand are views;
:func:`blocks.block_forward` / :func:`blocks.block_backward` compute it, with the
documents' mask of :class:`documents.DocumentStarts` (None, a mask, or skipped).
"""

from __future__ import annotations

import torch

from .blocks import FULL, block_backward, block_forward, merge_
from .documents import SKIP

Span = tuple[tuple[int, int], tuple[int, int], str]


def _joined(a: Span, b: Span) -> Span | None:
    """``a`` and ``b`` as one span, or None."""
    if a[2] != FULL or b[2] != FULL:
        return None
    if a[0] == b[0] and a[1][1] == b[1][0]:  # same queries, b's keys right after a's
        return a[0], (a[1][0], b[1][1]), FULL
    if a[1] == b[1] and a[0][1] == b[0][0]:  # same keys, b's queries right after a's
        return (a[0][0], b[0][1]), a[1], FULL
    return None


def merge_spans(blocks: list[tuple[int, int, str]]) -> list[Span]:
    """Blocks ``(q_chunk, k_chunk, kind)`` as the fewest spans the pairwise joins give."""
    spans: list[Span] = [((qi, qi + 1), (ki, ki + 1), kind) for qi, ki, kind in blocks]
    joined = True
    while joined:
        joined = False
        for i in range(len(spans)):
            for j in range(len(spans)):
                new = None if i == j else _joined(spans[i], spans[j])
                if new is not None:
                    spans[i] = new
                    del spans[j]
                    joined = True
                    break
            if joined:
                break
    return spans


def _operands(x: torch.Tensor, units: tuple[int, int], c: int) -> torch.Tensor:
    """Chunks ``units`` of ``x`` (B, h, n c, ...) along the sequence (dim 2; an lse
    (B, h, n c) too): a view."""
    return x[:, :, units[0] * c:units[1] * c]


def _mask(docs, q_units, k_chunks, k_units):
    return None if docs is None else docs.block(q_units, k_chunks[k_units[0]:k_units[1]])


def forward_spans(q, kv, spans, k_chunks, docs, scale, out, lse) -> None:
    """Fold every span's attention into the running ``out`` (B, H, S_l, D) fp32 and
    ``lse`` (B, H, S_l) in place. ``q`` (B, H, S_l, D) the local queries, ``kv`` (2, B,
    Hkv, n c, D) the K/V at hand, ``k_chunks`` the global chunk index of each of its
    ``n`` chunks, ``docs`` a :class:`documents.DocumentStarts` or None."""
    c = q.shape[2] // 2
    for q_units, k_units, kind in spans:
        mask = _mask(docs, q_units, k_chunks, k_units)
        if mask is SKIP:
            continue
        k, v = (_operands(t, k_units, c) for t in kv)
        o_b, lse_b = block_forward(_operands(q, q_units, c), k, v, kind, mask, scale)
        merge_(_operands(out, q_units, c), _operands(lse, q_units, c), o_b, lse_b)


def backward_spans(q, kv, out, d_out, lse, spans, k_chunks, docs, scale, dq, dkv) -> None:
    """Add every span's share of the gradients to ``dq`` (B, H, S_l, D) and ``dkv``
    (2, B, Hkv, n c, D) (fp32, in place), from the whole rows' ``out``, ``d_out`` and
    ``lse``; arguments as :func:`forward_spans`."""
    c = q.shape[2] // 2
    for q_units, k_units, kind in spans:
        mask = _mask(docs, q_units, k_chunks, k_units)
        if mask is SKIP:
            continue
        q_b, out_b, d_out_b, lse_b = (_operands(t, q_units, c) for t in (q, out, d_out, lse))
        k, v = (_operands(t, k_units, c) for t in kv)
        dq_b, dk_b, dv_b = block_backward(q_b, k, v, out_b, d_out_b, lse_b, None, kind, mask, scale)
        _operands(dq, q_units, c).add_(dq_b)
        _operands(dkv[0], k_units, c).add_(dk_b)
        _operands(dkv[1], k_units, c).add_(dv_b)
