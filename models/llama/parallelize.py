"""Turn a plain :class:`Llama` into this rank's part of a parallel model.

Data parallelism needs no change to the model. Tensor parallelism
(:func:`apply_tensor_parallel`) swaps q/k/v/gate/up for column-parallel and o/down for
row-parallel layers, the embedding and the head for vocabulary-parallel ones; pipeline
stage cutting plugs in here too.

Tensor parallelism over p ranks, per decoder layer (Megatron's split)::

    attention  q: heads split, n_heads/p per rank     (column-parallel, rows of q_proj)
               k, v: kv-heads split, n_kv_heads/p per rank; if p > n_kv_heads, each rank
                     gets the one kv-head its query heads read (replicated over
                     p/n_kv_heads ranks, gradients summed over them)
               o: input columns of those heads           (row-parallel, one all-reduce)
    MLP        gate, up: ffn_dim/p rows each             (column-parallel)
               down: ffn_dim/p input columns             (row-parallel, one all-reduce)
    norms      replicated (counted once in the grad norm)

The input of attention and of the MLP crosses the wire once for all their
column-parallel layers (a forward pre-hook; the all-reduce of dX in backward). With
sequence parallelism the residual stream and the norms hold S/p positions per rank; the
hook all-gathers the sequence, and the row-parallel layers reduce-scatter it back.

Every rank builds the full model from the seed and keeps its slices (``from_dense``), so
the sharded model equals the unsharded one: that is the tp-aware initialisation. For
models too big to build whole, see :mod:`parallel3d.models.llama.sharded_init`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from parallel3d.errors import UserError
from parallel3d.tensor_parallel import (ColumnParallelLinear, RowParallelLinear,
                                        VocabParallelEmbedding, enter_tensor_parallel_region,
                                        mark_replicated, padded_size, vocab_parallel_cross_entropy)

from .model import Llama, LlamaConfig


def cross_entropy_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over all (B*S) positions, computed in fp32."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


class VocabParallelLoss:
    """Mean cross-entropy over all (B*S) positions from logits split by vocabulary,
    (B, S, Vp/tp) on each tp rank: equals :func:`cross_entropy_loss` on the full logits."""

    def __init__(self, vocab_size: int, tp_rank: int, tp: int, group):
        self.vocab_size, self.group = vocab_size, group
        self.vocab_start = tp_rank * (padded_size(vocab_size, tp) // tp)

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_cross_entropy(logits, targets, vocab_start=self.vocab_start,
                                            vocab_size=self.vocab_size, group=self.group).mean()


def check_tensor_parallel(cfg: LlamaConfig, tp: int) -> None:
    """Raise :class:`UserError` naming the numbers if ``cfg`` cannot be split over tp."""
    if cfg.n_heads % tp:
        raise UserError(f"model.n_heads {cfg.n_heads} is not divisible by parallel.tp {tp}: "
                        "choose a tp that divides the number of heads")
    if cfg.n_kv_heads % tp and tp % cfg.n_kv_heads:
        raise UserError(
            f"model.n_kv_heads {cfg.n_kv_heads} and parallel.tp {tp}: one must divide the other "
            "(kv-heads are split when tp divides them, replicated when they divide tp)")
    if cfg.ffn_dim % tp:
        raise UserError(f"model.ffn_dim {cfg.ffn_dim} is not divisible by parallel.tp {tp}: "
                        "choose a tp that divides the MLP width")


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
    col = {"sequence_parallel": sp, "communicate_input": False, "backend": backend}
    row = {"sequence_parallel": sp, "backend": backend}
    kv, shared = kv_rows(cfg, tp_rank, tp)
    for layer in model.layers.values():
        attn, mlp = layer.self_attn, layer.mlp
        attn.q_proj = ColumnParallelLinear.from_dense(attn.q_proj, group, **col)
        attn.k_proj = ColumnParallelLinear.from_dense(attn.k_proj, group, rows=kv, shared=shared, **col)
        attn.v_proj = ColumnParallelLinear.from_dense(attn.v_proj, group, rows=kv, shared=shared, **col)
        attn.o_proj = RowParallelLinear.from_dense(attn.o_proj, group, **row)
        mlp.gate_proj = ColumnParallelLinear.from_dense(mlp.gate_proj, group, **col)
        mlp.up_proj = ColumnParallelLinear.from_dense(mlp.up_proj, group, **col)
        mlp.down_proj = RowParallelLinear.from_dense(mlp.down_proj, group, **row)
        enter_tensor_parallel_region(attn, group, sp)
        enter_tensor_parallel_region(mlp, group, sp)
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            mark_replicated(norm.weight, tp_rank, tp, partial_grad=sp)
    if model.norm is not None:
        mark_replicated(model.norm.weight, tp_rank, tp, partial_grad=sp)
    if model.embed_tokens is not None:
        model.embed_tokens = VocabParallelEmbedding.from_dense(model.embed_tokens, group,
                                                               sequence_parallel=sp)
    if model.lm_head is not None:
        head = ColumnParallelLinear.from_dense(
            model.lm_head, group, out_features=padded_size(cfg.vocab_size, tp), **row)
        if cfg.tie_embeddings and model.embed_tokens is not None:
            head.weight = model.embed_tokens.weight  # the same (Vp/tp, dim) shard
        model.lm_head = head
    # Hidden states between layers hold S/tp positions; rotary tables must cover S.
    model.sequence_shards = tp if sp else 1
    return model


def parallelize_llama(model: Llama, topo, parallel_cfg) -> tuple[Llama, callable]:
    """Return (this rank's model, its loss function)."""
    if topo.pp > 1:
        raise UserError("parallel.pp > 1 is not implemented yet: use parallel.pp=1")
    if topo.tp == 1:
        return model, cross_entropy_loss
    apply_tensor_parallel(model, topo, parallel_cfg.sequence_parallel, parallel_cfg.linear_backend)
    return model, VocabParallelLoss(model.cfg.vocab_size, topo.tp_rank, topo.tp, topo.tp_group)
