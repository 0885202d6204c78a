"""Parameters a rank holds, for the planner: one decoder layer's share at a tp degree
(:func:`layer_params`), a pipeline rank's whole share with its routed experts
(:func:`stage_params`, :func:`stage_expert_params`), and the largest unit ZeRO 3 gathers at
once (:func:`zero3_unit_params`)."""

from __future__ import annotations

from parallel3d.planner.experts import expert_params, moe_replicated_params, sparse_layers_of
from parallel3d.planner.spec import Layout, rank_chunks


def layer_params(model, tp: int, sparse: bool = False) -> int:
    """Parameters of one decoder layer on one tensor-parallel rank; ``sparse``: a
    Mixture-of-Experts layer without its routed experts (:func:`~parallel3d.planner.experts.expert_params`)."""
    hd = model.head_dim
    q, kv = model.n_heads * hd, model.n_kv_heads * hd
    matmul = 2 * model.dim * q + 2 * model.dim * kv + (0 if sparse else 3 * model.dim * model.ffn_dim)
    qk_norms = ((model.n_heads + model.n_kv_heads) * hd if model.qk_norm_all_heads else 2 * hd) * model.qk_norm
    # the two RMSNorm weights, the q/k norms and an MoE block's router and shared experts
    # are replicated over tp
    return matmul // tp + 2 * model.dim + qk_norms + (moe_replicated_params(model) if sparse else 0)

def stage_params(model, layout: Layout, pp_rank: int, split: list[int]) -> tuple[int, int, int]:
    """(parameters held, layers held, largest single parameter) on ``pp_rank``; the held
    count includes the routed experts of its sparse layers (:func:`stage_expert_params`)."""
    chunks = rank_chunks(pp_rank, layout.pp, layout.virtual_stages, layout.schedule)
    layers = sum(split[c] for c in chunks)
    sparse = sparse_layers_of(model, split, chunks)
    n = (layers - sparse) * layer_params(model, layout.tp) + stage_expert_params(model, layout, pp_rank, split)
    if sparse:
        n += sparse * layer_params(model, layout.tp, sparse=True)
    embed = model.vocab_size * model.dim // layout.tp
    largest = max(model.dim * model.ffn_dim // layout.tp, embed)
    first, last = 0 in chunks, (layout.chunks - 1) in chunks
    if first:
        n += embed
    if last:
        n += model.dim  # final norm
        if not (model.tie_embeddings and first):
            n += embed  # the head (a tied head on another stage holds its own copy)
    return n, layers, largest

def zero3_unit_params(model, layout: Layout, pp_rank: int, split: list[int]) -> int:
    """Parameters of the largest unit ZeRO 3 gathers at once on ``pp_rank`` (a decoder
    layer, the embedding, or the final norm and head; :func:`parallel3d.planner.timing.stage_units`).
    A Mixture-of-Experts layer's unit holds its ``E / ep`` routed experts besides its
    attention, router and shared experts."""
    chunks = rank_chunks(pp_rank, layout.pp, layout.virtual_stages, layout.schedule)
    n, layers, _ = stage_params(model, layout, pp_rank, split)
    first, last = 0 in chunks, (layout.chunks - 1) in chunks
    embed = model.vocab_size * model.dim // layout.tp
    head = (model.dim + (0 if model.tie_embeddings and first else embed)) if last else 0
    sparse = sparse_layers_of(model, split, chunks)
    layer = layer_params(model, layout.tp) if layers > sparse else 0
    if sparse:
        layer = max(layer, layer_params(model, layout.tp, sparse=True) + expert_params(model, layout.ep))
    return max(layer, embed if first else 0, head)

def stage_expert_params(model, layout: Layout, pp_rank: int, split: list[int]) -> int:
    """Routed-expert parameters held on ``pp_rank`` (its sparse layers' ``E / ep`` experts)."""
    chunks = rank_chunks(pp_rank, layout.pp, layout.virtual_stages, layout.schedule)
    sparse = sparse_layers_of(model, split, chunks)
    return sparse * expert_params(model, layout.ep) if sparse else 0
