"""Tensor parallelism: communication pairs, parallel layers, vocab-parallel loss.

    comm.py           autograd functions that undo each other (copy <-> all-reduce, ...)
    column.py         column-parallel layers sharing an input in one node; dX reduction
                      overlapped with the wgrad GEMMs
    layers.py         ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
    split_backward.py embedding / bias / linear whose weight gradient a zero-bubble W
                      computes; split_weight_grads for nn.Linear and nn.Embedding
    cross_entropy.py  cross-entropy over vocabulary-split logits, never gathered
    grad_sync.py      summing gradients of parameters held by several tp ranks
    init.py           counter-based init of shards without the full tensor; materialize_
    gemm_backends.py  one table of Triton-or-cuBLAS per GEMM shape, measured on rank 0

Every function and layer takes its process group explicitly (``topo.tp_group``).
"""

from .comm import (copy_to_tp_region, gather_from_sequence, gather_from_tp_region,
                   reduce_from_tp_region, reduce_scatter_to_sequence, scatter_to_sequence,
                   scatter_to_tp_region)
from .cross_entropy import vocab_parallel_cross_entropy
from .grad_sync import sync_tensor_parallel_grads
from .layers import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
                     mark_replicated, padded_size, share_input)

__all__ = [
    "copy_to_tp_region", "reduce_from_tp_region", "scatter_to_tp_region", "gather_from_tp_region",
    "scatter_to_sequence", "gather_from_sequence", "reduce_scatter_to_sequence",
    "ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "mark_replicated",
    "share_input",
    "padded_size", "vocab_parallel_cross_entropy", "sync_tensor_parallel_grads",
]
