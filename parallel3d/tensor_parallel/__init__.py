"""Tensor parallelism: communication pairs, parallel layers, vocab-parallel loss.

    comm.py           autograd functions that undo each other (copy <-> all-reduce, ...)
    layers.py         ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
    cross_entropy.py  cross-entropy over vocabulary-split logits, never gathered
    grad_sync.py      summing gradients of parameters held by several tp ranks
    init.py           counter-based init of shards without the full tensor; materialize_

Every function and layer takes its process group explicitly (``topo.tp_group``).
"""

from .comm import (copy_to_tp_region, gather_from_sequence, gather_from_tp_region,
                   reduce_from_tp_region, reduce_scatter_to_sequence, scatter_to_sequence,
                   scatter_to_tp_region)
from .cross_entropy import vocab_parallel_cross_entropy
from .grad_sync import sync_tensor_parallel_grads
from .layers import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
                     enter_tensor_parallel_region, mark_replicated, padded_size)

__all__ = [
    "copy_to_tp_region", "reduce_from_tp_region", "scatter_to_tp_region", "gather_from_tp_region",
    "scatter_to_sequence", "gather_from_sequence", "reduce_scatter_to_sequence",
    "ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "mark_replicated",
    "enter_tensor_parallel_region",
    "padded_size", "vocab_parallel_cross_entropy", "sync_tensor_parallel_grads",
]
