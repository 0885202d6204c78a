"""Causal attention over the whole sequence from this cp rank's head-tail queries.

``q`` (B, H, S_l, D), ``k`` / ``v`` (B, Hkv, S_l, D) with ``Hkv | H`` (grouped-query),
``S_l = S / cp`` the rank's tokens (chunks ``r`` and ``2cp-1-r``, ``sharding.py``);
``doc_ids`` (B, S_l) optional, the document of each local token numbered over the
whole window (``sharding.shard_documents``). Query at global position ``i`` attends key
``j`` iff ``j <= i`` (and, with ``doc_ids``, both in one document). Returns (B, H, S_l, D),
the rows of full-sequence attention for the local queries; gradients flow to q, k, v.

``comm``:

- ``"allgather"``: K and V of every rank gathered (one all-gather of the stacked
  (2, B, Hkv, S_l, D); backward: one reduce-scatter of dK/dV), put back in global order,
  and attended block by block (``gathered.py``: the chunks after a query chunk never
  computed). With GQA the K/V are small next to Q, and any mask is easy (the Llama 3
  paper's choice).
- ``"ring"``: ``ring.py``, ``cp - 1`` p2p steps overlapped with the blocks' attention.

A group of None or of one rank is plain causal (or document-masked) SDPA.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .comm import gather_from_cp, gather_ids
from .gathered import gathered_attention
from .ring import ring_attention
from .sharding import document_keys, unshard_sequence

COMMS = ("allgather", "ring")


def _check(q, k, v, doc_ids, cp: int, comm: str) -> None:
    if comm not in COMMS:
        raise ValueError(f"context-parallel comm {comm!r}: use one of {', '.join(COMMS)}")
    if q.dim() != 4 or k.shape != v.shape or k.shape[0] != q.shape[0] or k.shape[2:] != q.shape[2:]:
        raise ValueError(f"attention shapes q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: "
                         "expected (B, H, S_l, D) and (B, Hkv, S_l, D)")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"{q.shape[1]} query heads are not a multiple of {k.shape[1]} kv-heads")
    if cp > 1 and q.shape[2] % 2:
        raise ValueError(f"{q.shape[2]} local tokens do not split into a head and a tail chunk")
    if doc_ids is not None and doc_ids.shape != q.shape[:1] + q.shape[2:3]:
        raise ValueError(f"doc_ids {tuple(doc_ids.shape)}: expected (B, S_l) = {(q.shape[0], q.shape[2])}")


def _local_attention(q, k, v, doc_ids, scale):
    """cp = 1: the whole sequence is here."""
    gqa = q.shape[1] != k.shape[1]
    if doc_ids is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
    S = q.shape[2]
    causal = torch.ones(S, S, dtype=torch.bool, device=q.device).tril()
    mask = (doc_ids.unsqueeze(-1) == doc_ids.unsqueeze(-2)) & causal  # (B, S, S)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask.unsqueeze(1), scale=scale, enable_gqa=gqa)


def allgather_attention(q, k, v, group, doc_ids=None, scale=None):
    """``comm="allgather"`` (module docstring)."""
    cp, r = dist.get_world_size(group), dist.get_rank(group)
    kv = gather_from_cp(torch.stack([k, v]), group)  # (cp, 2, B, Hkv, S_l, D)
    kv = unshard_sequence(kv.unbind(0), dim=3)  # (2, B, Hkv, S, D), global order
    all_docs = None
    if doc_ids is not None:
        all_docs = unshard_sequence(gather_ids(doc_ids, group).unbind(0), dim=1)  # (B, S)
    return gathered_attention(q, kv, cp, r, doc_ids, all_docs, scale)


def context_parallel_attention(q, k, v, group, *, comm: str = "allgather",
                               doc_ids: torch.Tensor | None = None, scale: float | None = None):
    """Attention over the whole sequence from the local head-tail queries (module
    docstring); ``group`` the cp group (None: cp = 1)."""
    cp = 1 if group is None else dist.get_world_size(group)
    _check(q, k, v, doc_ids, cp, comm)
    if cp == 1:
        return _local_attention(q, k, v, doc_ids, scale)
    if comm == "ring":
        return ring_attention(q, k, v, group, doc_ids, scale)
    return allgather_attention(q, k, v, group, doc_ids, scale)


class ContextParallelAttention:
    """The model's attention hook under context parallelism (``Llama.attention_fn``):
    ``fn(q, k, v, positions)`` with this rank's head-tail q (B, H, S_l, D), k / v
    (B, Hkv, S_l, D) and per-document positions (B, S_l) (or the global positions of an
    unpacked window, which make one document). Without positions the rank cannot place
    its tokens (rotary embeddings included): the loader must pass them."""

    def __init__(self, group, comm: str = "allgather"):
        if comm not in COMMS:
            raise ValueError(f"context-parallel comm {comm!r}: use one of {', '.join(COMMS)}")
        self.group, self.comm = group, comm
        self.cp, self.cp_rank = dist.get_world_size(group), dist.get_rank(group)

    def __call__(self, q, k, v, positions):
        if positions is None:
            raise ValueError("context parallelism needs each token's position (the global positions of "
                             "the rank's head-tail chunks, or per-document positions): pass positions")
        doc_ids = document_keys(positions, self.cp, self.cp_rank)  # (B, S_l)
        return context_parallel_attention(q, k, v, self.group, comm=self.comm, doc_ids=doc_ids)
