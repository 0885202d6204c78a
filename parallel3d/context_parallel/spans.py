"""The calls a rank makes: the plans' blocks merged into spans, and the spans run.

A span ``((q_lo, q_hi), (k_lo, k_hi), kind)`` is the local query chunks ``q_lo .. q_hi-1``
against the chunks ``k_lo .. k_hi-1`` of the K/V at hand (``c`` tokens each, ``c`` the
chunk size), FULL or CAUSAL. Two FULL blocks with the same queries and adjacent keys (or
the same keys and adjacent queries) make one FULL span: one kernel call instead of two,
and one log-sum-exp merge instead of two (the same score elements: within a span no
key is masked but by the documents). CAUSAL blocks (a chunk against itself) stay single.

At cp 2 this takes the all-gather mode from 5 blocks a rank to 3 or 4 spans (a query
chunk's earlier key chunks are one span of the gathered K/V, in global order), and the
ring's later steps from 2 blocks to 1 span (both local query chunks against the head
chunk held, or the tail query chunk against both held chunks).

Running a span: its rows of the local queries and columns of the K/V at hand are views;
:func:`blocks.block_forward` / :func:`blocks.block_backward` compute it, with the
documents' mask of :class:`documents.DocumentStarts` (None, a mask, or skipped). A
CAUSAL span with no mask runs as rows of :data:`CAUSAL_PIECE` queries (each row against
the keys before it, then its own causal diagonal): fewer wasted tiles on the diagonal.
"""

from __future__ import annotations

from .blocks import CAUSAL, FULL, block_backward, block_forward, merge_
from .documents import SKIP

Span = tuple[tuple[int, int], tuple[int, int], str]

# A CAUSAL block without a document mask runs as rows of about this many queries: row i
# against the keys before it (FULL) and its own diagonal (CAUSAL). The CPU flash kernel
# computes every tile that reaches the diagonal whole (tiles of 256 queries at 1024), so
# one 1024-token causal block costs 0.74 of a full one where 0.5 is its share; as rows of
# 256 it costs 0.65 (measured fwd + bwd, 4 heads on 2, D 64, one thread).
CAUSAL_PIECE = 256


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
    """Blocks ``(q_chunk, k_chunk, kind)`` as spans, joined pairwise until no two join
    (greedy; for the plans here, 2 to 4 FULL blocks a rank, that is the fewest)."""
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


def _mask(docs, q_units, k_chunks, k_units):
    return None if docs is None else docs.block(q_units, k_chunks[k_units[0]:k_units[1]])


def _calls(q_units, k_units, kind, mask, c: int):
    """The kernel calls of a span: (rows of the local queries, columns of the K/V at hand,
    kind, mask). A CAUSAL span without a mask as rows of about :data:`CAUSAL_PIECE`."""
    rows, cols = slice(q_units[0] * c, q_units[1] * c), slice(k_units[0] * c, k_units[1] * c)
    n = c // CAUSAL_PIECE
    if kind != CAUSAL or mask is not None or n < 2:
        return [(rows, cols, kind, mask)]
    cuts = [c * i // n for i in range(n + 1)]
    calls = []
    for lo, hi in zip(cuts, cuts[1:]):
        piece = slice(rows.start + lo, rows.start + hi)
        if lo:
            calls.append((piece, slice(cols.start, cols.start + lo), FULL, None))
        calls.append((piece, slice(cols.start + lo, cols.start + hi), CAUSAL, None))
    return calls


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
        for rows, cols, kind_, mask_ in _calls(q_units, k_units, kind, mask, c):
            o_b, lse_b = block_forward(q[:, :, rows], kv[0][:, :, cols], kv[1][:, :, cols], kind_, mask_, scale)
            merge_(out[:, :, rows], lse[:, :, rows], o_b, lse_b)


def backward_spans(q, kv, out, d_out, lse, spans, k_chunks, docs, scale, dq, dkv) -> None:
    """Add every span's share of the gradients to ``dq`` (B, H, S_l, D) and ``dkv``
    (2, B, Hkv, n c, D) (fp32, in place), from the whole rows' ``out``, ``d_out`` and
    ``lse``; arguments as :func:`forward_spans`."""
    c = q.shape[2] // 2
    for q_units, k_units, kind in spans:
        mask = _mask(docs, q_units, k_chunks, k_units)
        if mask is SKIP:
            continue
        for rows, cols, kind_, mask_ in _calls(q_units, k_units, kind, mask, c):
            dq_b, dk_b, dv_b = block_backward(q[:, :, rows], kv[0][:, :, cols], kv[1][:, :, cols], out[:, :, rows],
                                              d_out[:, :, rows], lse[:, :, rows], None, kind_, mask_, scale)
            dq[:, :, rows].add_(dq_b)
            dkv[0][:, :, cols].add_(dk_b)
            dkv[1][:, :, cols].add_(dv_b)
