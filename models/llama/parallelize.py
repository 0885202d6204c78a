"""Turn a plain :class:`Llama` into this rank's part of a parallel model.

Data parallelism needs no change to the model. Tensor parallelism
(:func:`apply_tensor_parallel`) swaps q/k/v/gate/up for column-parallel and o/down for
row-parallel layers, the embedding and the head for vocabulary-parallel ones. Pipeline parallelism cuts the
model into chunks first (:func:`cut_pipeline_stages`); tensor parallelism is then applied
to each chunk.

Tensor parallelism over p ranks, per decoder layer (Megatron's split)::

    attention  q: heads split, n_heads/p per rank     (column-parallel, rows of q_proj)
               k, v: kv-heads split, n_kv_heads/p per rank; if p > n_kv_heads, each rank
                     gets the one kv-head its query heads read (replicated over
                     p/n_kv_heads ranks, gradients summed over them)
               o: input columns of those heads           (row-parallel, one all-reduce)
    MLP        gate, up: ffn_dim/p rows each             (column-parallel)
               down: ffn_dim/p input columns             (row-parallel, one all-reduce)
    MoE block  whole on every rank (expert tp 1): it routes the tokens the rank holds
               (all of them, or its S/p under sequence parallelism, partial gradients)
    norms      replicated (counted once in the grad norm)

The input of attention and of the MLP crosses the wire once for all their
column-parallel layers (``share_input``: q, k, v and gate, up run as one node each; one
all-reduce of the summed dX in backward, overlapped with their wgrad GEMMs). With
sequence parallelism the residual stream and the norms hold S/p positions per rank; that
node all-gathers the sequence, and the row-parallel layers reduce-scatter it back.

Context parallelism (:func:`apply_context_parallel`) changes no weight: the model's input
is this rank's head-tail chunks of each sequence, and attention reaches the rest of the
sequence over the cp group (``parallel3d.context_parallel``).

Every rank builds the full model from the seed and keeps its slices (``from_dense``), so
the sharded model equals the unsharded one: that is the tp-aware initialisation. For
models too big to build whole, see :mod:`parallel3d.models.llama.sharded_init`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from parallel3d.context_parallel import ContextParallelAttention, choose_comm
from parallel3d.errors import UserError
from parallel3d.kernels import gemm  # noqa: F401 - registers torch.ops.parallel3d.linear_*
from parallel3d.tensor_parallel import (ColumnParallelLinear, RowParallelLinear,
                                        VocabParallelEmbedding, mark_replicated, padded_size,
                                        share_input, vocab_parallel_cross_entropy)
from parallel3d.pipeline.schedules import SPLIT_BACKWARD
from parallel3d.tensor_parallel.norm import ShardedRMSNorm

from .config import LlamaConfig, tensor_parallel_problems  # noqa: F401 - re-exported
from .model import MLP, Llama
# the pipeline cut and the recomputation have files of their own; their names stay
# importable from here, where the family's callers find them
from .recompute import RECOMPUTE, apply_recompute  # noqa: F401
from .stages import (PipelineStage, cut_pipeline_stages, mark_tied_embeddings,  # noqa: F401
                     split_llama_weight_grads, stage_costs)


IGNORE_INDEX = -100  # a target that is not trained on (torch's F.cross_entropy default)


def cross_entropy_loss(logits: torch.Tensor, targets: torch.Tensor,
                       divisor: float | None = None) -> torch.Tensor:
    """Next-token cross-entropy in fp32, skipping targets equal to :data:`IGNORE_INDEX`.

    ``divisor`` None: the mean over the supervised positions of this batch. A number: the
    sum over them divided by it (the pipeline passes the supervised tokens of the whole
    global batch over dp, so every micro-batch is weighted by its share of them)."""
    flat_logits, flat_targets = logits.float().flatten(0, 1), targets.flatten()
    if divisor is None:
        return F.cross_entropy(flat_logits, flat_targets, ignore_index=IGNORE_INDEX)
    return F.cross_entropy(flat_logits, flat_targets, ignore_index=IGNORE_INDEX, reduction="sum") / divisor


class VocabParallelLoss:
    """:func:`cross_entropy_loss` from logits split by vocabulary, (B, S, Vp/tp) on each
    tp rank (the same value on every tp rank; targets equal to :data:`IGNORE_INDEX` add
    nothing and get no gradient); tp 1 is one rank holding every column. ``inplace``:
    the backward overwrites the logits with their gradient (training's loss)."""

    def __init__(self, vocab_size: int, tp_rank: int, tp: int, group, inplace: bool = False):
        self.vocab_size, self.group, self.inplace = vocab_size, group, inplace
        self.vocab_start = tp_rank * (padded_size(vocab_size, tp) // tp)
        self.per_source = None  # a SourceLossSums while training on a data.blend (the trainer's)

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor,
                 divisor: float | None = None, sources: torch.Tensor | None = None) -> torch.Tensor:
        loss = vocab_parallel_cross_entropy(logits, targets, vocab_start=self.vocab_start,
                                            vocab_size=self.vocab_size, group=self.group,
                                            ignore_index=IGNORE_INDEX, inplace=self.inplace)
        if sources is not None and self.per_source is not None:
            self.per_source.add(loss, sources)  # (B, S) per-token losses, detached inside
        if divisor is not None:
            return loss.sum() / divisor
        return loss.sum() / (targets != IGNORE_INDEX).sum()


def check_tensor_parallel(cfg: LlamaConfig, tp: int) -> None:
    """Raise :class:`UserError` naming the numbers if ``cfg`` cannot be split over tp."""
    problems = tensor_parallel_problems(cfg, tp)
    if problems:
        raise UserError("; ".join(problems))


def kv_rows(cfg: LlamaConfig, tp_rank: int, tp: int) -> tuple[tuple[int, int], int]:
    """Rows of k_proj/v_proj this rank keeps, and over how many ranks they are shared."""
    hd = cfg.head_dim
    if cfg.n_kv_heads % tp == 0:
        n = cfg.n_kv_heads // tp
        return (tp_rank * n * hd, (tp_rank + 1) * n * hd), 1
    # tp > n_kv_heads: query heads [r*h, (r+1)*h), h = n_heads/tp, all read kv-head
    # r*h // (n_heads/n_kv_heads) = r // (tp/n_kv_heads).
    shared = tp // cfg.n_kv_heads
    head = tp_rank // shared
    return (head * hd, (head + 1) * hd), shared


def apply_tensor_parallel(model: Llama, topo, sequence_parallel: bool = False,
                          backend: str = "auto") -> Llama:
    """Swap in the tensor-parallel layers of this tp rank, in place; returns ``model``.

    Works on any subset of the model a pipeline stage keeps: ``embed_tokens``, ``norm``
    and ``lm_head`` may be None. The lm_head keeps its logits split by vocabulary (padded
    to a multiple of tp): use :class:`VocabParallelLoss`.
    """
    tp, tp_rank, group = topo.tp, topo.tp_rank, topo.tp_group
    if tp == 1:
        return model
    cfg = model.cfg
    check_tensor_parallel(cfg, tp)
    sp = sequence_parallel
    coords = {"tp": tp, "tp_rank": tp_rank}  # from the topology: no group needed to lay out
    col = row = {"sequence_parallel": sp, "backend": backend, **coords}
    kv, shared = kv_rows(cfg, tp_rank, tp)
    for layer in model.layers.values():
        attn, mlp = layer.self_attn, layer.mlp
        attn.q_proj = ColumnParallelLinear.from_dense(attn.q_proj, group, **col)
        attn.k_proj = ColumnParallelLinear.from_dense(attn.k_proj, group, rows=kv, shared=shared, **col)
        attn.v_proj = ColumnParallelLinear.from_dense(attn.v_proj, group, rows=kv, shared=shared, **col)
        attn.o_proj = RowParallelLinear.from_dense(attn.o_proj, group, **row)
        share_input(attn, attn.q_proj, attn.k_proj, attn.v_proj)
        if isinstance(mlp, MLP):
            mlp.gate_proj = ColumnParallelLinear.from_dense(mlp.gate_proj, group, **col)
            mlp.up_proj = ColumnParallelLinear.from_dense(mlp.up_proj, group, **col)
            mlp.down_proj = RowParallelLinear.from_dense(mlp.down_proj, group, **row)
            share_input(mlp, mlp.gate_proj, mlp.up_proj)
        else:  # MoE: every rank computes its tokens through whole experts
            for p in mlp.parameters():
                mark_replicated(p, tp_rank, tp, partial_grad=sp)
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            mark_replicated(norm.weight, tp_rank, tp, partial_grad=sp)
        if attn.q_norm is not None and attn.qk_norm_all_heads:
            # OLMoE: a norm over all heads' columns, split with them (a sum over tp inside)
            attn.q_norm = ShardedRMSNorm.from_dense(attn.q_norm, group, tp, tp_rank)
            attn.k_norm = ShardedRMSNorm.from_dense(attn.k_norm, group, tp, tp_rank)
        elif attn.q_norm is not None:
            # One weight applied to every head; each rank sees its own heads (and the
            # query heads reading its kv-heads), so its gradient is a part of the sum.
            for norm in (attn.q_norm, attn.k_norm):
                mark_replicated(norm.weight, tp_rank, tp, partial_grad=True)
    if model.norm is not None:
        mark_replicated(model.norm.weight, tp_rank, tp, partial_grad=sp)
    if model.embed_tokens is not None:
        model.embed_tokens = VocabParallelEmbedding.from_dense(model.embed_tokens, group,
                                                               sequence_parallel=sp, **coords)
    if model.lm_head is not None:
        head = ColumnParallelLinear.from_dense(
            model.lm_head, group, out_features=padded_size(cfg.vocab_size, tp), **row)
        if cfg.tie_embeddings and model.embed_tokens is not None:
            head.weight = model.embed_tokens.weight  # the same (Vp/tp, dim) shard
        model.lm_head = head
    # Hidden states between layers hold S/tp positions; rotary tables must cover S.
    model.sequence_shards = tp if sp else 1
    return model


def apply_context_parallel(model: Llama, cp_group, comm: str = "auto") -> Llama:
    """Context parallelism on this rank's model or pipeline chunk (in place, after
    :func:`apply_tensor_parallel`): attention over the whole sequence through
    ``cp_group`` (``ContextParallelAttention``, ``comm`` "allgather" / "ring" / "auto"),
    rotary tables covering cp times the rank's window. ``cp_group`` None (cp = 1): no
    change.

    The model then takes this rank's head-tail chunks of each sequence
    (``context_parallel.shard_sequence``) and always their ``positions``: the global
    positions (``shard_positions``), or the per-document positions of packed windows.
    """
    if cp_group is None:
        return model
    if model.attention_fn is not None:
        raise ValueError("context parallelism already applied to this model")
    model.attention_fn = ContextParallelAttention(cp_group, choose_comm(comm, model.cfg.n_heads,
                                                                        model.cfg.n_kv_heads))
    model.sequence_shards *= dist.get_world_size(cp_group)
    return model


def parallelize_llama(model: Llama, topo, parallel_cfg) -> tuple[nn.Module, callable]:
    """Return (this rank's model, its loss function).

    Pipeline parallelism first cuts this rank's chunks (:func:`cut_pipeline_stages`), then
    tensor parallelism splits each chunk (:func:`apply_tensor_parallel`) and context
    parallelism routes its attention through the cp group (:func:`apply_context_parallel`;
    the chunk then takes this rank's head-tail tokens and their positions); a zero-bubble
    schedule has every weight's backward split into B and W
    (:func:`split_llama_weight_grads`), except on the first chunk, whose backward runs
    whole. With ``pp > 1`` the model is a :class:`PipelineStage`: this rank's chunks
    under the unsplit parameter names, run by the pipeline schedule through
    ``.pipeline_chunks``.
    """
    chunks = cut_pipeline_stages(model, topo, parallel_cfg) if topo.pp > 1 else [model]
    for chunk in chunks:
        apply_tensor_parallel(chunk, topo, parallel_cfg.sequence_parallel, parallel_cfg.linear_backend)
        apply_context_parallel(chunk, topo.cp_group, parallel_cfg.cp_comm)  # cp 1: no group, no change
        # The first chunk's backward always runs undivided (its input gradient has no
        # reader: parallel3d.pipeline.actions.undivided_backwards): its layers keep
        # torch's own backward rather than the split's autograd functions.
        if parallel_cfg.schedule in SPLIT_BACKWARD and chunk.embed_tokens is None:
            split_llama_weight_grads(chunk)
    if topo.pp > 1:
        mark_tied_embeddings(chunks)
        model = PipelineStage(chunks)
    # At any tp (tp 1 included: no fp32 copy of the logits, no log-softmax, the gradient
    # written over the logits) the vocab-parallel loss: the logits are the loss's only
    # buffer of their size.
    return model, VocabParallelLoss(chunks[0].cfg.vocab_size, topo.tp_rank, topo.tp, topo.tp_group,
                                    inplace=True)


# -- pipeline stages -----------------------------------------------------------------------

def activation_shape(model_cfg: LlamaConfig, micro_batch: int, seq_len: int, tp: int = 1,
                     sequence_parallel: bool = False, cp: int = 1) -> tuple[int, int, int]:
    """What one pipeline stage hands the next (and the gradient that comes back): the
    hidden states of this rank's tokens, ``(micro_batch, seq_len/cp, dim)`` (a cp rank
    holds its head-tail chunks), or ``(micro_batch, seq_len/cp/tp, dim)`` under sequence
    parallelism, where each tp rank holds its shard of those."""
    local = seq_len // cp
    return (micro_batch, local // tp if sequence_parallel else local, model_cfg.dim)
