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

__all__ = [
    "COMMS", "ContextParallelAttention", "context_parallel_attention", "allgather_attention", "ring_attention",
    "kv_bytes_per_layer", "score_elements", "choose_comm", "shard_sequence", "unshard_sequence",
    "shard_positions", "contiguous_positions", "document_ids", "document_keys", "shard_documents",
    "head_tail_chunks",
]

# name -> module, imported on first use: ``cost`` is plain Python (the planner reads it
# without torch), the rest import torch
_HOME = {"COMMS": "attention", "ContextParallelAttention": "attention", "allgather_attention": "attention",
         "context_parallel_attention": "attention", "choose_comm": "cost", "kv_bytes_per_layer": "cost",
         "score_elements": "cost", "ring_attention": "ring"}


def __getattr__(name: str):
    if name in __all__:
        import importlib
        return getattr(importlib.import_module(f".{_HOME.get(name, 'sharding')}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
