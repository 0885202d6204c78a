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

from functools import partial

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import (CheckpointPolicy, checkpoint,
                                    create_selective_checkpoint_contexts, noop_context_fn)

from parallel3d.config import Recompute
from parallel3d.context_parallel import ContextParallelAttention, choose_comm
from parallel3d.errors import UserError
from parallel3d.kernels import gemm  # noqa: F401 - registers torch.ops.parallel3d.linear_*
from parallel3d.tensor_parallel import (ColumnParallelLinear, RowParallelLinear,
                                        VocabParallelEmbedding, mark_replicated, padded_size,
                                        share_input, vocab_parallel_cross_entropy)
from parallel3d.kernels.deferred import defer
from parallel3d.pipeline.partition import layer_ranges, rank_chunks, resolve_split
from parallel3d.pipeline.schedules import SPLIT_BACKWARD
from parallel3d.tensor_parallel.split_backward import split_weight_grads
from parallel3d.tensor_parallel.norm import ShardedRMSNorm

from .model import MLP, Llama, LlamaConfig, RMSNorm, _RMSNormFn


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


def tensor_parallel_problems(cfg: LlamaConfig, tp: int) -> list[str]:
    """Every reason ``cfg`` cannot be split over tp, each naming the numbers."""
    problems = []
    if cfg.n_heads % tp:
        problems.append(f"model.n_heads {cfg.n_heads} is not divisible by parallel.tp {tp}: "
                        "choose a tp that divides the number of heads")
    if cfg.n_kv_heads % tp and tp % cfg.n_kv_heads:
        problems.append(
            f"model.n_kv_heads {cfg.n_kv_heads} and parallel.tp {tp}: one must divide the other "
            "(kv-heads are split when tp divides them, replicated when they divide tp)")
    if cfg.ffn_dim % tp and not all(cfg.is_sparse(i) for i in range(cfg.n_layers)):
        problems.append(f"model.ffn_dim {cfg.ffn_dim} is not divisible by parallel.tp {tp}: "
                        "choose a tp that divides the MLP width")
    if cfg.qk_norm and cfg.qk_norm_all_heads and cfg.n_kv_heads % tp:
        problems.append(f"q/k norms over all heads (OLMoE) split with the heads: parallel.tp {tp} must "
                        f"divide model.n_kv_heads {cfg.n_kv_heads}")
    return problems


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


def stage_costs(cfg: LlamaConfig) -> tuple[float, float]:
    """(embedding, head) cost in decoder layers, by GEMM FLOPs per token (the split rule
    of ``parallel3d.pipeline.partition``). The embedding is a gather: 0. The head is one
    ``dim x vocab`` GEMM against the layer's attention and MLP GEMMs. Tensor parallelism
    divides both alike, so the ratio holds for any tp."""
    hd = cfg.head_dim
    layer = 2 * cfg.dim * cfg.n_heads * hd + 2 * cfg.dim * cfg.n_kv_heads * hd + 3 * cfg.dim * cfg.ffn_dim
    return 0.0, cfg.vocab_size * cfg.dim / layer


def cut_pipeline_stages(model: Llama, topo, parallel_cfg) -> list[Llama]:
    """This rank's chunks of ``model`` (one per virtual stage, in order), each a Llama over
    a contiguous run of layers that shares its modules with ``model``: the first chunk of
    the pipeline keeps the embedding, the last the final norm and the head. Layers keep
    their global keys, so parameter names are those of the unsplit model.

    With tied embeddings the first and last stage both hold the one matrix: the pipeline
    schedule sums its gradient over ``topo.embed_group``, and the last stage's copy is
    left out of the gradient norm (``p3d_norm_owner = False``)."""
    cfg = model.cfg
    v = parallel_cfg.virtual_stages
    counts = resolve_split(cfg.n_layers, topo.pp, v, parallel_cfg.pp_layers, *stage_costs(cfg),
                           schedule=parallel_cfg.schedule)
    ranges = layer_ranges(counts)
    last = len(counts) - 1
    return [_chunk(model, ranges[c], first=c == 0, last=c == last)
            for c in rank_chunks(topo.pp_rank, topo.pp, v, parallel_cfg.schedule)]


def mark_tied_embeddings(chunks: list[Llama]) -> None:
    """Under pp > 1 with tied embeddings, once tensor parallelism made them their final
    parameters: when the embedding and the head are on different ranks, mark both (the
    optimizer sums their gradients over ``topo.embed_group`` and the norm counts the head's
    copy out). When this rank holds both in different chunks (zb-v's V puts the first and
    the last chunk on rank 0), the head takes the embedding's parameter itself, which then
    gets one gradient per chunk and micro-batch (``p3d_grads_per_micro_batch``: ZeRO's
    bucket counting waits for both)."""
    if not chunks[0].cfg.tie_embeddings:
        return
    embeds = [c.embed_tokens for c in chunks if c.embed_tokens is not None]
    heads = [c.lm_head for c in chunks if c.lm_head is not None]
    if embeds and heads:
        heads[0].weight = embeds[0].weight  # the same (Vp/tp, dim) rows at any tp
        embeds[0].weight.p3d_grads_per_micro_batch = 2
        return
    for module in embeds + heads:
        module.weight.p3d_tied_embedding = True
    for head in heads:
        head.weight.p3d_norm_owner = False  # counted on the first stage


class _SplitRMSNormFn(_RMSNormFn):
    """:class:`~.model._RMSNormFn` whose weight gradient a zero-bubble W computes (the
    same arithmetic: ``dw = sum over rows of dy * n``, ``dx`` as there)."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        ctx.weight = weight  # the W's target (recomputation hands back copies of saved tensors)
        return _RMSNormFn.forward(ctx, x, weight, eps)

    @staticmethod
    def backward(ctx, dy):
        x, weight, rstd = ctx.saved_tensors
        dw = None
        if ctx.needs_input_grad[1]:
            param = ctx.weight

            def weight_grads() -> list:  # keeps x, rstd and dy (not an fp32 copy of x r)
                n = (x.to(rstd.dtype) * rstd).to(x.dtype)
                return [(param, (dy * n).reshape(-1, x.shape[-1]).sum(0).to(weight.dtype))]

            if not defer(weight_grads):
                dw = weight_grads()[0][1]
        n32 = x.to(rstd.dtype) * rstd
        g = (dy * weight).to(rstd.dtype)
        dx = rstd * (g - n32 * (g * n32).mean(-1, keepdim=True))
        return dx.to(x.dtype), dw, None


def _split_rms_norm_forward(norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
    return _SplitRMSNormFn.apply(x, norm.weight, norm.eps)


def split_llama_weight_grads(model: Llama) -> Llama:
    """Every weight of ``model`` (a chunk, after tensor parallelism) gets a backward that
    honours the B/W split of zero-bubble schedules (``parallel3d.kernels.deferred``): the
    tensor-parallel layers do already; ``nn.Linear`` and ``nn.Embedding`` (tp = 1) go
    through ``tensor_parallel.split_backward``, the RMSNorms through
    :class:`_SplitRMSNormFn`. Parameters and their names are unchanged."""
    split_weight_grads(model)
    for module in model.modules():
        if isinstance(module, RMSNorm):
            module.forward = partial(_split_rms_norm_forward, module)
    return model


def _chunk(model: Llama, layers: range, first: bool, last: bool) -> Llama:
    # The shell is built on the meta device (no memory, no initialisation cost) and then
    # given the real modules of its part.
    with torch.device("meta"):
        chunk = Llama(model.cfg)
    chunk.embed_tokens = model.embed_tokens if first else None
    chunk.layers = nn.ModuleDict({str(i): model.layers[str(i)] for i in layers})
    chunk.norm = model.norm if last else None
    chunk.lm_head = model.lm_head if last else None
    return chunk


class PipelineStage(nn.Module):
    """This rank's chunks gathered under the unsplit names (``embed_tokens``,
    ``layers.<global index>``, ``norm``, ``lm_head``, whichever it holds), so parameters,
    ``state_dict`` keys and checkpoints do not depend on the split. It is not called: the
    schedule runs each of ``pipeline_chunks`` (a plain list, so nothing is registered
    twice)."""

    def __init__(self, chunks: list[Llama]):
        super().__init__()
        self.pipeline_chunks = chunks
        self.embed_tokens = chunks[0].embed_tokens
        self.layers = nn.ModuleDict({k: layer for c in chunks for k, layer in c.layers.items()})
        self.norm = chunks[-1].norm
        self.lm_head = chunks[-1].lm_head

    def forward(self, *args, **kwargs):
        raise RuntimeError("a PipelineStage is run chunk by chunk by the pipeline schedule "
                           "(parallel3d.pipeline), not called as a whole")


# -- activation recomputation ---------------------------------------------------------------

# Selective recomputation keeps what is costly to recompute and cheap to store relative to
# it: the outputs of the matrix multiplications (q, k, v, o, gate, up, down), whether
# torch's (aten.mm / addmm / bmm) or the Triton GEMM (its custom op). Everything else in
# the layer (RMSNorm, RoPE, attention itself, SiLU * up, residual adds, and the
# tensor-parallel collectives) is re-run in the backward pass from those saved outputs.
_MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
            torch.ops.parallel3d.linear_fwd.default}


def _keep_matmul_outputs(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op in _MATMULS else CheckpointPolicy.PREFER_RECOMPUTE


def _recomputed_forward(forward, context_fn, *args, **kwargs):
    return checkpoint(forward, *args, use_reentrant=False, context_fn=context_fn, **kwargs)


# ``train.recompute`` -> the checkpoint context of each layer's recomputed forward
# (None: no recomputation).
RECOMPUTE = {"none": None, "full": noop_context_fn,
             "selective": partial(create_selective_checkpoint_contexts, _keep_matmul_outputs)}


def apply_recompute(model: Llama, mode: Recompute) -> Llama:
    """Activation recomputation on each decoder layer this rank holds (in place).

    ``full``: a layer keeps only its input and re-runs its whole forward in the backward
    pass. ``selective``: the layer keeps its matmul outputs and re-runs the rest (torch's
    selective activation checkpointing with :func:`_keep_matmul_outputs` as policy).
    Either way the gradients are those of ``none``: the same ops on the same inputs.
    """
    context_fn = RECOMPUTE[mode]
    if context_fn is None:
        return model
    for layer in model.layers.values():
        if getattr(layer, "p3d_recompute", None) is not None:
            raise ValueError(f"recompute already applied ({layer.p3d_recompute})")
        if mode == "selective":  # the checkpoint keeps the GEMM outputs: reduce copies of them
            for module in layer.modules():
                if isinstance(module, RowParallelLinear):
                    module.reduce_in_place = False
        layer.forward = partial(_recomputed_forward, layer.forward, context_fn)
        layer.p3d_recompute = mode
    return model
