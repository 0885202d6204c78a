"""Context parallelism: one sequence split over the cp ranks (head-tail chunks), attention
over the whole sequence from each rank's queries.

    sharding.py   head-tail sharding of tokens, global positions, document ids
    comm.py       the ring's p2p step
    blocks.py     one block's attention with its log-sum-exp, merge, backward; ring plan
    documents.py  packed documents: a block's mask from its queries' document starts
    spans.py      the plans' blocks merged into fewer kernel calls, and run
    ring.py       ring attention (autograd.Function; backward recomputes per block)
    gathered.py   the all-gather mode: the own chunks' blocks under the K/V all-gather
                  (and the reduce-scatter of dK/dV), then the other chunks'; in-process form
    attention.py  ``context_parallel_attention(q, k, v, group, comm=...)``; all-gather mode;
                  ``ContextParallelAttention``, the model's hook (``Llama.attention_fn``)
    cost.py       bytes per layer for each comm mode; attention work of a rank; "auto"

Every function takes the cp process group explicitly.
"""

from .attention import COMMS, ContextParallelAttention, allgather_attention, context_parallel_attention
from .cost import choose_comm, kv_bytes_per_layer, score_elements
from .ring import ring_attention
from .sharding import (contiguous_positions, document_ids, document_keys, head_tail_chunks, shard_documents,
                       shard_positions, shard_sequence, unshard_sequence)

__all__ = [
    "COMMS", "ContextParallelAttention", "context_parallel_attention", "allgather_attention", "ring_attention",
    "kv_bytes_per_layer", "score_elements", "choose_comm", "shard_sequence", "unshard_sequence",
    "shard_positions", "contiguous_positions", "document_ids", "document_keys", "shard_documents",
    "head_tail_chunks",
]
