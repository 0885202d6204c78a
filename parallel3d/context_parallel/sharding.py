"""Head-tail sharding of a sequence over the cp ranks of a context-parallel group.

A sequence of ``S`` tokens is cut into ``2 cp`` equal chunks of ``c = S / (2 cp)``;
cp rank ``i`` holds chunks ``i`` and ``2cp-1-i``, concatenated (head chunk first)::

    S = 16, cp = 2:  chunks 0 1 2 3 of 4 tokens
        rank 0: tokens 0..3  and 12..15      rank 1: tokens 4..7 and 8..11

Under causal attention query ``p`` scores ``p + 1`` keys, so a rank's work is
``sum over its positions of (p + 1)``: chunk ``i`` and chunk ``2cp-1-i`` sum to the same
``c^2 (2cp-1) + c (c+1)`` on every rank (exactly balanced), where contiguous chunks give
the last rank ``~(2cp-1)x`` the first's work.

Each rank keeps its tokens' *global* position ids, so rotary embeddings need no change.
Packed documents carry per-document positions (0 at each document start); the document
ids (``(positions == 0).cumsum``, the numbering ``models/llama/documents.py`` uses) are
computed on the whole sequence and sharded the same way, so a mask built from a rank's
ids and another rank's ids stays right across chunk boundaries. A rank that has only its
own per-document positions gets keys that compare the same way from
:func:`document_keys`: a token's document start, global position minus position in its
document.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def check_shardable(seq_len: int, cp: int) -> None:
    """A ``ValueError`` naming the numbers when ``seq_len`` does not cut into ``2 cp`` chunks."""
    if cp < 1 or seq_len % (2 * cp):
        raise ValueError(f"sequence length {seq_len} does not split into 2 x cp = {2 * cp} equal chunks: "
                         f"use a sequence length that is a multiple of {2 * cp}")


def head_tail_chunks(cp: int, cp_rank: int) -> tuple[int, int]:
    """The two global chunk indices cp rank ``cp_rank`` holds: ``(cp_rank, 2cp-1-cp_rank)``."""
    return cp_rank, 2 * cp - 1 - cp_rank


def shard_sequence(x: torch.Tensor, cp: int, cp_rank: int, dim: int = 1) -> torch.Tensor:
    """This rank's tokens of ``x`` (..., S, ...) along ``dim``: chunks ``cp_rank`` and
    ``2cp-1-cp_rank`` of ``2cp``, concatenated: (..., S / cp, ...). A copy."""
    check_shardable(x.shape[dim], cp)
    chunks = x.tensor_split(2 * cp, dim=dim)
    head, tail = head_tail_chunks(cp, cp_rank)
    return torch.cat([chunks[head], chunks[tail]], dim=dim)


def unshard_sequence(shards: Sequence[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """The inverse of :func:`shard_sequence`: every rank's shard (in cp rank order) back
    to the whole sequence along ``dim``. Differentiable (a cat of slices)."""
    cp = len(shards)
    halves = [s.tensor_split(2, dim=dim) for s in shards]  # rank r: (chunk r, chunk 2cp-1-r)
    heads = [halves[r][0] for r in range(cp)]  # chunks 0 .. cp-1
    tails = [halves[r][1] for r in reversed(range(cp))]  # chunks cp .. 2cp-1
    return torch.cat(heads + tails, dim=dim)


def shard_positions(seq_len: int, cp: int, cp_rank: int, device=None) -> torch.Tensor:
    """Global position ids (S / cp,) of this rank's tokens, int64."""
    return shard_sequence(torch.arange(seq_len, device=device), cp, cp_rank, dim=0)


def contiguous_positions(seq_len: int, cp: int, cp_rank: int, device=None) -> torch.Tensor:
    """Global positions of rank ``cp_rank``'s tokens under plain contiguous sharding (the
    unbalanced layout, for comparison): ``[r S/cp, (r+1) S/cp)``."""
    n = seq_len // cp
    return torch.arange(cp_rank * n, (cp_rank + 1) * n, device=device)


def document_ids(positions: torch.Tensor) -> torch.Tensor:
    """Document number (B, S) of each token of whole packed windows whose per-document
    positions (B, S) restart at 0 at each document start (as ``document_mask`` reads them)."""
    return (positions == 0).cumsum(-1)


def shard_documents(positions: torch.Tensor, cp: int, cp_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For packed windows (B, S) of per-document positions: this rank's per-document
    positions and its tokens' document ids, both (B, S / cp), the ids numbered over the
    whole window so that equal ids on two ranks mean the same document."""
    return (shard_sequence(positions, cp, cp_rank, dim=1),
            shard_sequence(document_ids(positions), cp, cp_rank, dim=1))


def document_keys(positions: torch.Tensor, cp: int, cp_rank: int) -> torch.Tensor:
    """Keys (B, S_l) that are equal exactly for tokens of one document, from this rank's
    own per-document positions (B, S_l) (head-tail shard of a window of ``S_l * cp``):
    each token's document start, ``global position - position in its document``. Usable
    wherever document ids are (only equality is read). Positions that are the global
    ones (no packing) give one key, 0, for the whole window."""
    S_l = positions.shape[-1]
    return shard_positions(S_l * cp, cp, cp_rank, device=positions.device) - positions
