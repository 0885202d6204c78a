"""Causal attention over the whole sequence from this cp rank's head-tail queries.

``q`` (B, H, S_l, D), ``k`` / ``v`` (B, Hkv, S_l, D) with ``Hkv | H`` (grouped-query),
``S_l = S / cp`` the rank's tokens (chunks ``r`` and ``2cp-1-r``, ``sharding.py``);
``doc_starts`` (B, S_l) optional, the global position where each local token's document
starts (``sharding.document_keys`` from the rank's per-document positions). Query at
global position ``i`` attends key ``j`` iff ``j <= i`` (and, with ``doc_starts``,
``j >= doc_starts[i]``: the same document, ``documents.py``; nothing about documents
crosses the wire). Returns (B, H, S_l, D),
the rows of full-sequence attention for the local queries; gradients flow to q, k, v.

``comm``:

- ``"allgather"``: K and V of every rank gathered (one all-gather of the stacked
  (2, B, Hkv, S_l, D); backward: one reduce-scatter of dK/dV), put back in global order,
  and attended block by block (``gathered.py``: the chunks after a query chunk never
  computed; the blocks of the rank's own K/V run while the collective is in flight). With
  GQA the K/V are small next to Q, and any mask is easy (the Llama 3 paper's choice).
- ``"ring"``: ``ring.py``, ``cp - 1`` p2p steps overlapped with the blocks' attention.

A group of None or of one rank is plain causal (or document-masked) SDPA.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .documents import DocumentStarts, local_document_mask
from .gathered import overlapped_gather_attention
from .ring import ring_attention
from .sharding import document_keys

COMMS = ("allgather", "ring")


def _check(q, k, v, doc_starts, cp: int, comm: str) -> None:
    if comm not in COMMS:
        raise ValueError(f"context-parallel comm {comm!r}: use one of {', '.join(COMMS)}")
    if q.dim() != 4 or k.shape != v.shape or k.shape[0] != q.shape[0] or k.shape[2:] != q.shape[2:]:
        raise ValueError(f"attention shapes q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: "
                         "expected (B, H, S_l, D) and (B, Hkv, S_l, D)")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"{q.shape[1]} query heads are not a multiple of {k.shape[1]} kv-heads")
    if cp > 1 and q.shape[2] % 2:
        raise ValueError(f"{q.shape[2]} local tokens do not split into a head and a tail chunk")
    starts = doc_starts.starts if isinstance(doc_starts, DocumentStarts) else doc_starts
    if starts is not None and starts.shape != q.shape[:1] + q.shape[2:3]:
        raise ValueError(f"doc_starts {tuple(starts.shape)}: expected (B, S_l) = {(q.shape[0], q.shape[2])}")


def _local_attention(q, k, v, doc_starts, scale):
    """cp = 1: the whole sequence is here."""
    gqa = q.shape[1] != k.shape[1]
    docs = DocumentStarts.of(doc_starts, n_chunks=1)
    if docs is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=local_document_mask(docs.starts), scale=scale,
                                          enable_gqa=gqa)


def allgather_attention(q, k, v, group, doc_starts=None, scale=None):
    """``comm="allgather"`` (module docstring)."""
    return overlapped_gather_attention(q, k, v, group, doc_starts, scale)


def context_parallel_attention(q, k, v, group, *, comm: str = "allgather",
                               doc_starts: torch.Tensor | DocumentStarts | None = None,
                               scale: float | None = None):
    """Attention over the whole sequence from the local head-tail queries (module
    docstring); ``group`` the cp group (None: cp = 1)."""
    cp = 1 if group is None else dist.get_world_size(group)
    _check(q, k, v, doc_starts, cp, comm)
    if cp == 1:
        return _local_attention(q, k, v, doc_starts, scale)
    if comm == "ring":
        return ring_attention(q, k, v, group, doc_starts, scale)
    return allgather_attention(q, k, v, group, doc_starts, scale)


class ContextParallelAttention:
    """The model's attention hook under context parallelism (``Llama.attention_fn``):
    ``fn(q, k, v, positions)`` with this rank's head-tail q (B, H, S_l, D), k / v
    (B, Hkv, S_l, D) and per-document positions (B, S_l) (or the global positions of an
    unpacked window, which make one document: every document start 0, no document mask
    at all). Without positions the rank cannot place its tokens (rotary embeddings
    included): the loader must pass them. The document starts are derived once per
    ``positions`` tensor (every layer of a forward, and a recomputed forward, get the
    same one)."""

    def __init__(self, group, comm: str = "allgather"):
        if comm not in COMMS:
            raise ValueError(f"context-parallel comm {comm!r}: use one of {', '.join(COMMS)}")
        self.group, self.comm = group, comm
        self.cp, self.cp_rank = dist.get_world_size(group), dist.get_rank(group)
        self._docs = (None, -1, None)  # (positions, its version, its DocumentStarts or None)

    def _documents(self, positions: torch.Tensor) -> DocumentStarts | None:
        seen, version, docs = self._docs
        if seen is not positions or version != positions._version:
            host = getattr(positions, "p3d_host", None)  # the loader's CPU copy (MicroBatch.to)
            docs = DocumentStarts.of(document_keys(positions, self.cp, self.cp_rank),  # (B, S_l) starts
                                     host=None if host is None else document_keys(host, self.cp, self.cp_rank))
            self._docs = (positions, positions._version, docs)
        return docs

    def __call__(self, q, k, v, positions):
        if positions is None:
            raise ValueError("context parallelism needs each token's position (the global positions of "
                             "the rank's head-tail chunks, or per-document positions): pass positions")
        return context_parallel_attention(q, k, v, self.group, comm=self.comm, doc_starts=self._documents(positions))
