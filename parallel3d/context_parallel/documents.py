"""Packed documents under context parallelism, from the queries' side alone.

Documents are contiguous runs of the window, so for a query at global position ``i`` in
the document that starts at ``s_i`` and a key at ``j <= i`` (causal)::

    same document  <=>  j >= s_i

The mask of any block needs only its queries' starts ``s`` (B, cq) and its keys' global
positions, which the head-tail layout fixes (chunk ``b`` holds ``b c .. (b+1) c - 1``):
no document id crosses the wire. ``sharding.document_keys`` gives each rank its starts
from its own per-document positions.

A block of keys ``k_min .. k_max`` (global positions) needs, given its queries' smallest
and largest start ``s_lo``, ``s_hi``:

- no document mask when ``s_hi <= k_min`` (every key at or after every query's start:
  every block of a plain window, whose starts are all 0);
- nothing at all when ``s_lo > k_max`` (every key before every query's document):
  skipped;
- else the (B, 1, cq, ck) mask ``k_pos >= s``.

Each query chunk's ``s_lo``, ``s_hi`` are computed on the host once per forward (the
block decisions are Python branches): from the loader's host copy of the positions when
it passed one (``MicroBatch.to``: ``positions.p3d_host``), so a GPU forward never waits
for the device to read them; else read from the device tensor (one small transfer). A query sees itself, so no row of
the whole attention is left without a visible key.
"""

from __future__ import annotations

import torch

SKIP = "skip"  # a block fully masked by the documents: not computed


class DocumentStarts:
    """The document start (global position) of each local query, (B, S_l), cut into the
    ``n`` local chunks of ``c = S_l / n`` tokens, with each chunk's least and greatest
    start on the host (from ``host``, the same starts on the CPU, when given)."""

    def __init__(self, starts: torch.Tensor, n_chunks: int = 2, host: torch.Tensor | None = None):
        self.starts = starts
        self.c = starts.shape[-1] // n_chunks
        src = starts if host is None else host
        pieces = src.reshape(src.shape[0], n_chunks, self.c)  # (B, n, c)
        self.bounds = torch.stack([pieces.amin((0, 2)), pieces.amax((0, 2))], 1).tolist()  # n x [lo, hi]

    @classmethod
    def of(cls, starts, n_chunks: int = 2, host: torch.Tensor | None = None) -> "DocumentStarts | None":
        """``starts`` prepared (a tensor, or already a :class:`DocumentStarts`); None when
        there are none or every start is 0 (one document from the window's start: the
        causal mask says it all). ``host``: the same starts on the CPU, if at hand."""
        if starts is None or isinstance(starts, DocumentStarts):
            return starts
        docs = cls(starts, n_chunks, host)
        return None if max(hi for _, hi in docs.bounds) == 0 else docs

    def block(self, q_units: tuple[int, int], key_chunks):
        """For local query chunks ``q_units`` (lo, hi) against keys of the global chunks
        ``key_chunks`` (in their order in the block, ``c`` tokens each): None (no mask),
        :data:`SKIP`, or the (B, 1, cq, ck) bool mask, True where the key is in the
        query's document."""
        s_lo = min(self.bounds[u][0] for u in range(*q_units))
        s_hi = max(self.bounds[u][1] for u in range(*q_units))
        c = self.c
        if s_hi <= min(key_chunks) * c:
            return None
        if s_lo > (max(key_chunks) + 1) * c - 1:
            return SKIP
        starts = self.starts[:, q_units[0] * c:q_units[1] * c]  # (B, cq)
        k_pos = torch.cat([torch.arange(b * c, (b + 1) * c, device=starts.device) for b in key_chunks])
        return (k_pos >= starts.unsqueeze(-1)).unsqueeze(1)


def local_document_mask(starts: torch.Tensor) -> torch.Tensor:
    """cp = 1: the (B, 1, S, S) causal same-document mask of a whole window from its
    tokens' document starts (B, S)."""
    S = starts.shape[-1]
    pos = torch.arange(S, device=starts.device)
    visible = (pos >= starts.unsqueeze(-1)) & (pos <= pos.unsqueeze(-1))  # (B, S, S)
    return visible.unsqueeze(1)
