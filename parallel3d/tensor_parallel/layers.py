"""Tensor-parallel layers: column- and row-parallel linear, vocab-parallel embedding.

Notation: ``p`` ranks in the tensor-parallel group, this rank ``r``. Weights use the
``nn.Linear`` layout, ``A`` of shape (out, in), ``Y = X A^T``.

Every sharded parameter carries attributes saying how it is split, for code that must
know (the gradient sync below, the global grad norm, ZeRO, checkpoints):

    p.p3d_tp_dim        dim of the full tensor that is split (0: column-parallel and
                        vocab rows, 1: row-parallel input columns); None if replicated
    p.p3d_tp_range      (start, stop) of this shard along that dim, in the full tensor
    p.p3d_tp_full       size of the full (padded) tensor along that dim
    p.p3d_tp_shared     how many consecutive tp ranks hold this same shard (1 normally;
                        > 1 for kv-heads replicated when tp > n_kv_heads; tp for a
                        replicated norm weight)
    p.p3d_tp_partial_grad  True if each holder's gradient is a partial sum that must be
                        summed over the ``p3d_tp_shared`` holders before the optimizer
                        (:mod:`parallel3d.tensor_parallel.grad_sync`)
    p.p3d_norm_owner    False on all holders of a shared parameter but the first, so
                        ``global_grad_norm`` counts it once

The GEMMs go through ``parallel3d.kernels.gemm`` (``backend``: auto, triton or torch,
chosen per GEMM there). Gradient-accumulation fusion: a weight that carries an fp32
``main_grad`` tensor (same shape, contiguous, on its device: set by an optimizer) gets
its weight gradient added into it by the wgrad GEMM, in fp32, and no ``.grad``.
Every weight's backward splits into input and weight gradient for zero-bubble pipeline
schedules (``split_backward.py``, ``parallel3d.kernels.deferred``).
A layer built by its constructor has uninitialised weights (``torch.empty``, like any
meta-device build): take the slices of a dense layer with ``from_dense``, or fill the
shards with :func:`parallel3d.tensor_parallel.init.counter_normal_`.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from parallel3d.config import LinearBackend

from .column import SharedInput, column_parallel_forward
from .comm import (gather_from_tp_region, group_rank, group_size, reduce_from_tp_region,
                   reduce_scatter_to_sequence, scatter_to_tp_region)
from .split_backward import add_bias, embedding, linear


def padded_size(size: int, tp: int) -> int:
    """``size`` rounded up to a multiple of ``tp`` (the vocabulary under tensor parallelism)."""
    return math.ceil(size / tp) * tp


def even_range(full: int, tp_rank: int, tp: int) -> tuple[int, int]:
    """Rows ``[start, stop)`` of rank ``tp_rank`` when ``full`` (a multiple of tp) is split evenly."""
    if full % tp:
        raise ValueError(f"size {full} does not split evenly over tp={tp}")
    n = full // tp
    return tp_rank * n, (tp_rank + 1) * n


def mark_sharded(p: nn.Parameter, dim: int, rows: tuple[int, int], full: int,
                 tp_rank: int, shared: int = 1) -> None:
    """Record how ``p`` is split (see the module docstring)."""
    p.p3d_tp_dim, p.p3d_tp_range, p.p3d_tp_full = dim, tuple(rows), full
    p.p3d_tp_shared = shared
    p.p3d_tp_partial_grad = shared > 1
    if shared > 1:
        p.p3d_norm_owner = tp_rank % shared == 0


def mark_replicated(p: nn.Parameter, tp_rank: int, tp: int, partial_grad: bool) -> None:
    """``p`` is held whole by every tp rank; ``partial_grad`` under sequence parallelism,
    where each rank's gradient covers only its sequence shard."""
    p.p3d_tp_dim, p.p3d_tp_range, p.p3d_tp_full = None, None, None
    p.p3d_tp_shared = tp
    p.p3d_tp_partial_grad = partial_grad and tp > 1
    p.p3d_norm_owner = tp_rank == 0


def tp_coords(group, tp: int | None, tp_rank: int | None) -> tuple[int, int]:
    """``(tp, tp_rank)``: as given (the topology's), else read from ``group``. Given, a
    shard can be laid out without any process group (a dry run builds ranks' modules on
    the meta device from coordinates alone)."""
    if tp is None:
        return group_size(group), group_rank(group)
    return tp, tp_rank


class ColumnParallelLinear(nn.Module):
    """``Y = X A^T + b`` with ``A`` split by output rows.

    ``A = [A_1; ..; A_p]`` (each (out/p, in)), ``b = [b_1; ..; b_p]``; rank r computes
    ``Y_r = X A_r^T + b_r``, (B, S, out/p): its share of the output features.

    What crosses the wire (group of p ranks):

    * forward: nothing, ``X`` is replicated; under sequence parallelism each rank holds
      (B, S/p, in) and ``X`` is all-gathered along S.
    * backward: ``dX = sum_r dY_r A_r`` is all-reduced (reduce-scattered along S under
      sequence parallelism), started before the wgrad GEMM and waited for after it
      (:mod:`parallel3d.tensor_parallel.column`).
    * ``gather_output=True`` all-gathers ``Y`` to (B, S, out) (backward: split).

    Layers reading the same ``X`` (q, k and v; gate and up) are tied by
    :func:`share_input`: the first one called computes all of them in one node, so the
    wire carries ``X`` once and one reduction of the summed dX overlaps all their wgrads.

    ``rows=(start, stop)`` takes any block of rows instead of the even split: kv-heads
    replicated over ``shared`` ranks when tp exceeds their number. Weight attributes:
    ``p3d_tp_dim = 0`` and the others in the module docstring.
    """

    def __init__(self, in_features: int, out_features: int, group, *, bias: bool = False,
                 gather_output: bool = False, sequence_parallel: bool = False,
                 rows: tuple[int, int] | None = None,
                 shared: int = 1, backend: LinearBackend = "auto", device=None, dtype=None,
                 tp: int | None = None, tp_rank: int | None = None):
        super().__init__()
        tp, tp_rank = tp_coords(group, tp, tp_rank)
        rows = rows or even_range(out_features, tp_rank, tp)
        if gather_output and (shared != 1 or rows != even_range(out_features, tp_rank, tp)):
            raise ValueError("gather_output needs the even split of the output rows")
        self.in_features, self.out_features = in_features, out_features
        self.group, self.backend = group, backend
        self.gather_output, self.sequence_parallel = gather_output, sequence_parallel
        self.shared_input: SharedInput | None = None  # set by share_input
        factory = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.empty(rows[1] - rows[0], in_features, **factory))
        self.weight.p3d_takes_main_grad = True  # its GEMM honours an fp32 main_grad
        mark_sharded(self.weight, 0, rows, out_features, tp_rank, shared)
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.zeros(rows[1] - rows[0], **factory))
            mark_sharded(self.bias, 0, rows, out_features, tp_rank, shared)

    @classmethod
    def from_dense(cls, linear: nn.Linear, group, *, out_features: int | None = None, **kwargs):
        """This rank's block of rows of ``linear`` (padded with zero rows up to
        ``out_features`` if given, e.g. a vocabulary padded to a multiple of tp)."""
        full = out_features or linear.out_features
        layer = cls(linear.in_features, full, group, bias=linear.bias is not None,
                    device=linear.weight.device, dtype=linear.weight.dtype, **kwargs)
        start, stop = layer.weight.p3d_tp_range
        with torch.no_grad():
            layer.weight.zero_()
            have = max(0, min(stop, linear.out_features) - start)
            layer.weight[:have].copy_(linear.weight[start:start + have])
            if linear.bias is not None:
                layer.bias[:have].copy_(linear.bias[start:start + have])
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.shared_input is not None:
            y = self.shared_input.output(self, x)  # (B, S, out/p)
        else:
            (y,) = column_parallel_forward(x, [self], self.group, self.sequence_parallel, self.backend)
        if self.gather_output:
            y = gather_from_tp_region(y, self.group)  # (B, S, out)
        return y

    def extra_repr(self) -> str:
        start, stop = self.weight.p3d_tp_range
        return (f"in={self.in_features}, out={self.out_features}, rows=[{start}, {stop}), "
                f"shared={self.weight.p3d_tp_shared}, sequence_parallel={self.sequence_parallel}, "
                f"gather_output={self.gather_output}")


class RowParallelLinear(nn.Module):
    """``Y = X A^T + b`` with ``A`` split by input columns.

    ``A = [A_1 .. A_p]`` (each (out, in/p)) and ``X = [X_1 .. X_p]`` along the features;
    rank r holds ``X_r`` (B, S, in/p), usually the output of a column-parallel layer, and
    computes the partial sum ``X_r A_r^T``; ``Y = sum_r X_r A_r^T + b``.

    What crosses the wire:

    * forward: all-reduce of the partial (B, S, out); under sequence parallelism a
      reduce-scatter along S instead, leaving (B, S/p, out) on each rank.
    * backward: nothing (all-gather of dY along S under sequence parallelism); each rank
      computes ``dX_r = dY A_r`` and ``dA_r = dY^T X_r`` locally.
    * ``input_is_parallel=False`` first keeps this rank's 1/p of a replicated ``X``.

    The bias is added once, after the reduction, and is replicated (``p3d_tp_dim`` None,
    counted once in the norm; under sequence parallelism its gradient is partial). Weight
    attributes: ``p3d_tp_dim = 1``.

    The partial sum is the GEMM's own output, so it is all-reduced in place (no copy);
    ``reduce_in_place = False`` (set by selective recomputation, whose checkpoint keeps
    that output) reduces a copy instead.
    """

    def __init__(self, in_features: int, out_features: int, group, *, bias: bool = False,
                 input_is_parallel: bool = True, sequence_parallel: bool = False,
                 backend: LinearBackend = "auto", device=None, dtype=None,
                 tp: int | None = None, tp_rank: int | None = None):
        super().__init__()
        tp, tp_rank = tp_coords(group, tp, tp_rank)
        cols = even_range(in_features, tp_rank, tp)
        self.in_features, self.out_features = in_features, out_features
        self.group, self.backend = group, backend
        self.input_is_parallel, self.sequence_parallel = input_is_parallel, sequence_parallel
        self.reduce_in_place = True
        factory = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.empty(out_features, cols[1] - cols[0], **factory))
        self.weight.p3d_takes_main_grad = True  # its GEMM honours an fp32 main_grad
        mark_sharded(self.weight, 1, cols, in_features, tp_rank)
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.zeros(out_features, **factory))
            mark_replicated(self.bias, tp_rank, tp, partial_grad=sequence_parallel)

    @classmethod
    def from_dense(cls, linear: nn.Linear, group, **kwargs):
        layer = cls(linear.in_features, linear.out_features, group, bias=linear.bias is not None,
                    device=linear.weight.device, dtype=linear.weight.dtype, **kwargs)
        start, stop = layer.weight.p3d_tp_range
        with torch.no_grad():
            layer.weight.copy_(linear.weight[:, start:stop])
            if linear.bias is not None:
                layer.bias.copy_(linear.bias)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_tp_region(x, self.group)  # (B, S, in) -> (B, S, in/p)
        y = linear(x, self.weight, None, self.backend)  # (B, S, out), partial sum
        if self.sequence_parallel:
            y = reduce_scatter_to_sequence(y, self.group)  # (B, S/p, out)
        else:
            y = reduce_from_tp_region(y, self.group, inplace=self.reduce_in_place)  # (B, S, out)
        return y if self.bias is None else add_bias(y, self.bias)

    def extra_repr(self) -> str:
        start, stop = self.weight.p3d_tp_range
        return (f"in={self.in_features}, out={self.out_features}, cols=[{start}, {stop}), "
                f"sequence_parallel={self.sequence_parallel}")


class VocabParallelEmbedding(nn.Module):
    """``E[t]`` with the table ``E`` (V, H) split by vocabulary rows.

    ``V`` is padded to ``Vp``, a multiple of p (the padded rows are zero and never looked
    up); rank r holds rows ``[r Vp/p, (r+1) Vp/p)``. Each rank looks up the tokens that
    fall in its rows and writes zeros for the others; the sum over ranks is the
    embedding.

    What crosses the wire: forward all-reduce of (B, S, H) (under sequence parallelism a
    reduce-scatter along S, leaving (B, S/p, H)); backward nothing (all-gather of dY along
    S under sequence parallelism). Weight attributes: ``p3d_tp_dim = 0``.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, group, *,
                 sequence_parallel: bool = False, device=None, dtype=None,
                 tp: int | None = None, tp_rank: int | None = None):
        super().__init__()
        tp, tp_rank = tp_coords(group, tp, tp_rank)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.padded_num_embeddings = padded_size(num_embeddings, tp)
        self.group, self.sequence_parallel = group, sequence_parallel
        rows = even_range(self.padded_num_embeddings, tp_rank, tp)
        self.vocab_start, self.vocab_stop = rows
        self.weight = nn.Parameter(torch.empty(rows[1] - rows[0], embedding_dim,
                                               device=device, dtype=dtype))
        mark_sharded(self.weight, 0, rows, self.padded_num_embeddings, tp_rank)

    @classmethod
    def from_dense(cls, embedding: nn.Embedding, group, **kwargs):
        layer = cls(embedding.num_embeddings, embedding.embedding_dim, group,
                    device=embedding.weight.device, dtype=embedding.weight.dtype, **kwargs)
        start, stop = layer.vocab_start, layer.vocab_stop
        have = max(0, min(stop, embedding.num_embeddings) - start)
        with torch.no_grad():
            layer.weight.zero_()
            layer.weight[:have].copy_(embedding.weight[start:start + have])
        return layer

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        outside = (tokens < self.vocab_start) | (tokens >= self.vocab_stop)  # (B, S)
        local = (tokens - self.vocab_start).masked_fill(outside, 0)
        h = embedding(local, self.weight)  # (B, S, H), rows of other ranks still to zero
        h = h.masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return reduce_scatter_to_sequence(h, self.group)  # (B, S/p, H)
        return reduce_from_tp_region(h, self.group, inplace=True)  # (B, S, H); h is ours

    def extra_repr(self) -> str:
        return (f"vocab={self.num_embeddings} (padded {self.padded_num_embeddings}), "
                f"rows=[{self.vocab_start}, {self.vocab_stop}), dim={self.embedding_dim}, "
                f"sequence_parallel={self.sequence_parallel}")


def share_input(module: nn.Module, *layers: ColumnParallelLinear) -> None:
    """Tie column-parallel layers inside ``module`` that always read ``module``'s input
    (q, k, v in attention; gate, up in the MLP): called one by one on it, they are
    computed in one node (one gather under sequence parallelism, one overlapped dX
    reduction). Under sequence parallelism a forward pre-hook on ``module`` hands it the
    gathered input. Parameter names do not change."""
    first = layers[0]
    for layer in layers:
        same = (layer.group is first.group and layer.sequence_parallel == first.sequence_parallel
                and layer.backend == first.backend and layer.in_features == first.in_features)
        if not same or layer.gather_output or layer.shared_input is not None:
            raise ValueError("share_input: layers need the same group, sequence_parallel, backend "
                             "and in_features, no gather_output, and no earlier share_input")
    shared = SharedInput(layers)
    for layer in layers:
        layer.shared_input = shared
    module.register_forward_pre_hook(shared)
