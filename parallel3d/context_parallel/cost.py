"""What context parallelism costs, for the planner: bytes a rank sends per attention
layer (forward + backward) in each comm mode, and the attention work of a rank's queries.

With ``kv = 2 B S Hkv D`` elements of K and V for the whole sequence (``b`` bytes each;
dK/dV accumulators of ``g`` bytes each travel in the ring's backward)::

    allgather:  forward all-gather (cp-1)/cp kv b,  backward reduce-scatter (cp-1)/cp kv b
    ring:       forward (cp-1) shards of kv/cp (b),  backward (cp-1) shards (b) + (cp-1) shards (g)

The gloo reduce-scatter (``distributed.reduce_scatter_flat``) sends the same (cp-1)/cp.
Activation recomputation runs the forward again: add its share once more.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # plain Python at run time: the planner imports it without torch
    import torch


def kv_bytes_per_layer(comm: str, *, batch: int, seq_len: int, n_kv_heads: int, head_dim: int,
                       cp: int, dtype_bytes: int = 2, grad_bytes: int = 4) -> float:
    """Bytes one cp rank sends per attention layer, forward and backward."""
    if cp == 1:
        return 0.0
    kv = 2 * batch * seq_len * n_kv_heads * head_dim
    if comm == "allgather":
        return 2 * (cp - 1) / cp * kv * dtype_bytes
    if comm == "ring":
        shard = kv / cp
        return 2 * (cp - 1) * shard * dtype_bytes + (cp - 1) * shard * grad_bytes
    raise ValueError(f"context-parallel comm {comm!r}: use allgather or ring")


def score_elements(q_positions: torch.Tensor) -> int:
    """Unmasked causal score elements of queries at these global positions: ``sum (p + 1)``
    (query ``p`` sees keys ``0..p``), the attention FLOPs up to a constant ``4 D H``."""
    return int((q_positions.long() + 1).sum())


def choose_comm(comm: str, n_heads: int, n_kv_heads: int) -> str:
    """``"auto"`` resolved until the planner's time model decides: ``"allgather"`` under
    grouped-query attention (K/V are ``n_kv_heads / n_heads`` of Q: the gathered whole-
    sequence K/V stay small, and one collective beats ``cp - 1`` steps), ``"ring"`` for
    multi-head attention (gathered K/V would be ``2 cp`` times the local Q, kept for the
    backward). Any other value is returned as given."""
    if comm != "auto":
        return comm
    return "allgather" if n_kv_heads < n_heads else "ring"
