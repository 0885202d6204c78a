"""LoRA in the planner: what trains on a rank, and the bytes of a rank's model states.

With ``[lora]`` (``parallel3d/lora``) every weight is frozen but the adapters and the
weights ``lora.trainable`` names. A frozen weight is stored in the training dtype with no
gradient, no fp32 master and no Adam moments; what trains has all three, and ZeRO 1/2
shard only those (the flat-buffer optimizer takes the parameters that train); ZeRO 3
shards the frozen weights too (``zero/frozen.py``; the units in flight are the planner's
to add, as for any ZeRO 3 job)::

    weights     (trained + frozen) x weight bytes (2 bf16, 4 fp32)   / dp x cp at ZeRO 3
    master      trained x 4 (bf16 only)           / dp x cp at ZeRO 1, 2, 3
    gradients   trained x 4 (fp32)                / dp x cp at ZeRO 2, 3 (ZeRO 1: the
                                                    whole buffer and its reduced shard)
    optimizer   trained x 8 (Adam's two moments)  / dp x cp at ZeRO 1, 2, 3

(:func:`lora_states`: the one formula, used by the planner's search with the counts
below and by ``train --dry-run`` with the counts of the rank's modules built on meta.)

Adapters of rank ``r`` on one projection of one tensor-parallel rank
(``parallel3d/lora/adapters.py``): column-parallel (q, k, v, gate, up; ``in`` -> ``out``)
``A`` (r, in) whole, ``B`` (out / tp, r); row-parallel (o, down) ``A`` (r, in / tp),
``B`` (out, r) whole. Their GEMMs add ``2 x adapter elements`` FLOPs per token to the
forward, as much to the input gradient and to the weight gradient (:func:`adapter_params`).
On a Mixture-of-Experts layer the MLP targets' adapters are each expert's own, whole at
every tp rank as the experts are (:func:`sparse_adapter_params`): a token's pass reads
its k experts' and the shared expert's; the routed experts' adapters take ZeRO's expert
replicas (edp x cp), the rest dp x cp.
"""

from __future__ import annotations

from dataclasses import dataclass

from parallel3d.planner.experts import sparse_layers_of
from parallel3d.planner.spec import ADAM_BYTES, PRECISION, LoraSpec, Layout, kv_width, rank_chunks

COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


def projection_shapes(model, tp: int) -> dict[str, tuple[int, int]]:
    """(in, out) of each projection, unsplit; k and v have max(1, kv / tp) heads a rank
    (kv-heads replicated past their number), written as tp times that."""
    d, f, q = model.dim, model.ffn_dim, model.n_heads * model.head_dim
    kv = kv_width(model, tp) * tp
    return {"q_proj": (d, q), "k_proj": (d, kv), "v_proj": (d, kv), "o_proj": (q, d),
            "gate_proj": (d, f), "up_proj": (d, f), "down_proj": (f, d)}


def adapter_params(model, tp: int, spec: LoraSpec) -> int:
    """Adapter elements of one decoder layer on one tensor-parallel rank."""
    n = 0
    for target, (fan_in, fan_out) in projection_shapes(model, tp).items():
        if target not in spec.targets:
            continue
        if target in COLUMN:
            n += spec.rank * fan_in + fan_out // tp * spec.rank
        else:
            n += spec.rank * fan_in // tp + fan_out * spec.rank
    return n


def dropout_rebuilt_elements(model, tp: int, spec: LoraSpec, sequence_parallel: bool) -> int:
    """Elements per token of the largest dropped input an adapter rebuilds in the
    backward (``lora/dropout.py``: the dropped copy is not kept, it is rebuilt under a
    checkpoint for A's weight gradient, one adapter at a time): a column layer's whole
    input (its token shard under sequence parallelism, per token of the layer's input), a
    row layer's 1/tp of its input. 0 without dropout."""
    if not spec.dropout:
        return 0
    return max((fan_in // (tp if target not in COLUMN or sequence_parallel else 1)
                for target, (fan_in, _) in projection_shapes(model, tp).items() if target in spec.targets),
               default=0)


def _layer_trainable(model, tp: int, names: set[str]) -> int:
    """Elements of the weights ``lora.trainable`` names in one decoder layer on one tp rank."""
    hd = model.head_dim
    n = model.dim * len(names & {"input_layernorm", "post_attention_layernorm"})
    if model.qk_norm:
        wide = model.qk_norm_all_heads  # split over tp with the heads, else one head's width
        n += ((model.n_heads * hd // tp if wide else hd) if "q_norm" in names else 0)
        n += ((model.n_kv_heads * hd // tp if wide else hd) if "k_norm" in names else 0)
    for target, (fan_in, fan_out) in projection_shapes(model, tp).items():
        if target in names:
            n += fan_in * fan_out // tp
    return n


def sparse_adapter_params(model, layout: Layout, spec: LoraSpec) -> tuple[int, int, int]:
    """Adapter elements of one Mixture-of-Experts layer on one rank: (those every tp rank's
    token pass reads once: the attention's, split as a dense layer's, and the shared
    expert's, whole; the routed experts' on the rank, ``E / ep`` whole experts; one
    expert's). The MLP targets' adapters sit on each expert's own projections
    (``parallel3d/lora/experts.py``): r (d + f) elements each, f the expert's width."""
    moe, r, d = model.moe, spec.rank, model.dim
    attention = adapter_params(model, layout.tp, LoraSpec(r, tuple(t for t in spec.targets if t not in MLP)))
    mlp = sum(t in spec.targets for t in MLP)
    per_expert = mlp * r * (d + moe.ffn_dim)
    return attention + mlp * r * (d + moe.shared_ffn_dim) * bool(moe.shared_ffn_dim), \
        moe.n_experts // layout.ep * per_expert, per_expert


@dataclass(frozen=True)
class TrainedUnits:
    """Elements that train on one pipeline rank, by the units the planner's data-parallel
    model walks (the embedding, each decoder layer, the final norm and head)."""

    embed: int
    per_layer: int  # a dense decoder layer's
    head: int
    layers: int
    largest: int  # the largest single tensor that trains (its gradient is one transient)
    adapters: int  # of the total, the adapters' (held beside the base's weights)
    sparse_layers: int = 0  # of the layers, Mixture-of-Experts ones: each trains per_sparse_layer
    per_sparse_layer: int = 0  # besides its routed experts' adapters
    experts: int = 0  # the routed experts' adapters on the rank (marked p3d_expert: their own replicas)

    @property
    def total(self) -> int:
        return (self.embed + (self.layers - self.sparse_layers) * self.per_layer
                + self.sparse_layers * self.per_sparse_layer + self.experts + self.head)


def trained_units(model, layout: Layout, pp_rank: int, split: list[int], spec: LoraSpec) -> TrainedUnits:
    chunks = rank_chunks(pp_rank, layout.pp, layout.virtual_stages, layout.schedule)
    layers = sum(split[c] for c in chunks)
    first, last = 0 in chunks, (layout.chunks - 1) in chunks
    names = set(spec.trainable)
    if model.tie_embeddings and names & {"embed_tokens", "lm_head"}:
        names |= {"embed_tokens", "lm_head"}  # one tensor (apply_lora's rule)
    vocab = -(-model.vocab_size // layout.tp) * model.dim  # rows padded to a multiple of tp
    embed = vocab if first and "embed_tokens" in names else 0
    head = (model.dim if "norm" in names else 0) if last else 0
    if last and "lm_head" in names and not (model.tie_embeddings and first):
        head += vocab  # a tied head on another stage holds its own copy
    per_layer = adapter_params(model, layout.tp, spec) + _layer_trainable(model, layout.tp, names)
    shapes = projection_shapes(model, layout.tp)
    tensors = [max(fan_in, fan_out // layout.tp) * spec.rank for t, (fan_in, fan_out) in shapes.items()
               if t in spec.targets]
    tensors += [fan_in * fan_out // layout.tp for t, (fan_in, fan_out) in shapes.items() if t in names]
    largest = max([embed, vocab if head > model.dim else 0, *tensors])
    sparse = sparse_layers_of(model, split, chunks)
    adapters = (layers - sparse) * adapter_params(model, layout.tp, spec)
    if not sparse:
        return TrainedUnits(embed, per_layer, head, layers, largest, adapters)
    replicated, routed, _ = sparse_adapter_params(model, layout, spec)
    # a sparse layer's own trainable weights: its norms and attention's (the MLP's names
    # would be its experts', which lora.trainable does not plan)
    per_sparse = replicated + _layer_trainable(model, layout.tp, names - set(MLP))
    return TrainedUnits(embed, per_layer, head, layers, largest, adapters + sparse * (replicated + routed),
                        sparse, per_sparse, sparse * routed)


@dataclass(frozen=True)
class LoraStates:
    weights: int
    master: int
    grads: int
    optimizer: int


def lora_states(trained: int, frozen: int, dtype: str, zero: int, replicas: int) -> LoraStates:
    """Bytes of a rank's model states under LoRA (the module docstring's table); the
    sharded buffers are padded to a multiple of ``replicas`` (ceil), as the flat buffers are."""
    b = PRECISION[dtype]
    shard = -(-trained // replicas)
    held = shard + -(-frozen // replicas) if zero >= 3 else trained + frozen
    return LoraStates(weights=held * b["weight"],
                      master=b["master"] * (shard if zero >= 1 else trained),
                      grads=4 * (shard if zero >= 2 else trained + (shard if zero == 1 else 0)),
                      optimizer=ADAM_BYTES * (shard if zero >= 1 else trained))
