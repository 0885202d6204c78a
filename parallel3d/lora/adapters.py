"""Low-rank adapters on a linear layer, split the way the layer's weight is split.

A frozen layer ``Y = X W^T`` gets ``Y = X W^T + s (X A^T) B^T``, ``A`` (r, in), ``B``
(out, r), ``s = alpha / r`` (PEFT's LoRA). Over the p ranks of the tensor-parallel group:

    column-parallel  W = [W_1; ..; W_p] by output rows (out/p, in) on rank k
                     A whole (r, in) on every rank; B = [B_1; ..; B_p] (out/p, r)
                     forward   H = X A^T (B, S, r)               no communication
                               Y_k += s H B_k^T                  (B, S, out/p)
                     backward  dH = sum_k s dY_k B_k             all-reduce of (B, S, r)
                               dA = dH^T X, the same on every rank (not a partial sum)
    row-parallel     W = [W_1 .. W_p] by input columns (out, in/p) on rank k
                     A = [A_1 .. A_p] (r, in/p); B whole (out, r) on every rank
                     forward   H = sum_k X_k A_k^T               all-reduce of (B, S, r)
                               Y += s H B^T                      after Y's own all-reduce
                     backward  nothing crosses the wire; dB the same on every rank
    plain nn.Linear  A and B whole: at tp 1, or a layer every tp rank holds whole (an MoE
                     layer's experts and shared expert), its factors then replicated too.

The all-reduces carry r values per token, against ``in`` for the layer's own dX: the
adapters add a small fraction to the wire. The replicated factor is marked so (``mark_replicated``: counted once in the global norm, no
tp sum of its gradient); the split one carries the weight's ``p3d_tp_*`` split
(``mark_sharded``), so checkpoints, the norm and ZeRO treat it as the weight's slice.

Under sequence parallelism (a rank holds S/p of the tokens between layers):

    column-parallel  H = gather_S(X_shard A^T)           all-gather of (B, S, r); its
                                                         backward reduce-scatters dH
                     A's gradient is a partial sum over the ranks' token shards
    row-parallel     H = reduce-scatter_S(X_k A_k^T)     (B, S/p, r), as Y is scattered;
                     Y_shard += s H B^T                  backward all-gathers dH; B's
                                                         gradient a partial sum

(the column side reads the shard that the module's gathered stand-in stands for,
``SharedInput``). The GEMMs go through ``tensor_parallel.split_backward.linear``: their weight gradients
honour the zero-bubble B/W split and a ``main_grad``, as the layers' own weights do. A
frozen base weight (``requires_grad=False``) gets no gradient there: its W does nothing.
``lora.dropout`` masks A's input (``lora/dropout.py``): the whole input on a column
layer (each tp rank draws the same mask; under sequence parallelism its token shard's),
the rank's columns on a row layer; the mask and A run under a checkpoint (``dropped_a``),
so no dropped copy is kept for the backward.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn

from parallel3d.tensor_parallel import (ColumnParallelLinear, RowParallelLinear, copy_to_tp_region,
                                        mark_replicated, reduce_from_tp_region)
from parallel3d.tensor_parallel.comm import gather_from_sequence, reduce_scatter_to_sequence
from parallel3d.tensor_parallel.layers import mark_sharded
from parallel3d.tensor_parallel.split_backward import linear

from .dropout import dropped_a


class LoraFactor(nn.Module):
    """One adapter matrix as ``.weight`` (so its name is PEFT's ``...q_proj.lora_A.weight``),
    ``x -> x W^T``; not an ``nn.Linear``, which ``split_weight_grads`` would rewrite. It is
    called as a module (not its weight read by the layer) so that forward pre-hooks on it
    run: ZeRO's wait for the all-gather of the bucket holding the updated weight."""

    def __init__(self, rows: int, cols: int, backend: str = "auto", device=None, dtype=None):
        super().__init__()
        self.backend = backend
        self.weight = nn.Parameter(torch.empty(rows, cols, device=device, dtype=dtype))
        self.weight.p3d_lora = True  # an adapter factor (what the LoRA helpers look for)
        self.weight.p3d_takes_main_grad = True  # its GEMM (split_backward.linear) honours one

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, None, self.backend)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}"


def _column_forward(layer, base_forward, x: torch.Tensor) -> torch.Tensor:
    if layer.sequence_parallel:
        # x is the module's gathered stand-in (or, untied, the shard itself): A reads this
        # rank's tokens (B, S/p, K), and H (B, S, r) is gathered, its gradient (a partial
        # sum over the ranks' output rows) reduce-scattered back
        shard = x if layer.shared_input is None else layer.shared_input.shard_of(x)
        y = base_forward(x)  # (B, S, out/p); the last member's call ends the module's entry
        h = gather_from_sequence(dropped_a(layer, shard, token_shard=(layer.lora_tp_rank, layer.lora_tp)),
                                 layer.group)
        return y + layer.lora_B(h * layer.lora_scaling)
    y = base_forward(x)  # (B, S, out/p)
    h = dropped_a(layer, x)  # (B, S, r), the same on every rank (so is the mask)
    h = copy_to_tp_region(h, layer.group)  # backward: dH summed over the ranks' output rows
    return y + layer.lora_B(h * layer.lora_scaling)  # (B, S, out/p); scaled at rank r (see _plain_forward)


def _row_forward(layer, base_forward, x: torch.Tensor) -> torch.Tensor:
    y = base_forward(x)  # (B, S, out) reduced; under sequence parallelism (B, S/p, out)
    h = dropped_a(layer, x, offset=layer.weight.p3d_tp_range[0])  # (B, S, r), partial sum
    if layer.sequence_parallel:  # summed and scattered as Y is: (B, S/p, r)
        h = reduce_scatter_to_sequence(h, layer.group)
    else:  # h is ours, reduced in place, unless selective recomputation keeps the GEMM outputs
        h = reduce_from_tp_region(h, layer.group, inplace=layer.reduce_in_place)
    return y + layer.lora_B(h * layer.lora_scaling)  # (B, S, out) or (B, S/p, out)


def _plain_forward(layer, base_forward, x: torch.Tensor) -> torch.Tensor:
    # The scaling multiplies the (B, S, r) factor, not the (B, S, out) product as PEFT
    # does: the same function (to rounding), one output-sized pass fewer each way.
    return base_forward(x) + layer.lora_B(dropped_a(layer, x) * layer.lora_scaling)


def attach(layer: nn.Module, rank: int, alpha: float, tp: int, tp_rank: int, dropout: float = 0.0,
           salt: int = 0) -> None:
    """Give ``layer`` (a ColumnParallelLinear, RowParallelLinear or, at tp 1, nn.Linear;
    on any device, meta included) the adapters ``lora_A``, ``lora_B`` (uninitialised,
    laid out as the module docstring says) and a forward that adds them; ``dropout`` on
    A's input with masks keyed by ``salt`` (``lora/dropout.py``)."""
    if hasattr(layer, "lora_A"):
        raise ValueError("LoRA adapters already attached to this layer")
    w = layer.weight
    factory = {"device": w.device, "dtype": w.dtype, "backend": getattr(layer, "backend", "auto")}
    sp = bool(getattr(layer, "sequence_parallel", False))  # a factor that reads a token shard: partial dW
    if isinstance(layer, ColumnParallelLinear):
        if layer.gather_output:
            raise ValueError("LoRA on a column-parallel layer needs gather_output off")
        layer.lora_A = LoraFactor(rank, layer.in_features, **factory)
        layer.lora_B = LoraFactor(w.shape[0], rank, **factory)
        mark_replicated(layer.lora_A.weight, tp_rank, tp, partial_grad=sp)
        mark_sharded(layer.lora_B.weight, 0, w.p3d_tp_range, w.p3d_tp_full, tp_rank, w.p3d_tp_shared)
        forward = _column_forward
    elif isinstance(layer, RowParallelLinear):
        if not layer.input_is_parallel:
            raise ValueError("LoRA on a row-parallel layer needs input_is_parallel")
        layer.lora_A = LoraFactor(rank, w.shape[1], **factory)
        layer.lora_B = LoraFactor(layer.out_features, rank, **factory)
        mark_sharded(layer.lora_A.weight, 1, w.p3d_tp_range, w.p3d_tp_full, tp_rank)
        mark_replicated(layer.lora_B.weight, tp_rank, tp, partial_grad=sp)
        forward = _row_forward
    elif type(layer) is nn.Linear:
        replicated = getattr(w, "p3d_tp_shared", 1) == tp and getattr(w, "p3d_tp_dim", None) is None
        if tp != 1 and not replicated:
            raise ValueError("a plain nn.Linear gets adapters at tp > 1 only when every tp rank holds it whole")
        layer.lora_A = LoraFactor(rank, layer.in_features, **factory)
        layer.lora_B = LoraFactor(layer.out_features, rank, **factory)
        if tp != 1:  # an MoE layer's experts: every tp rank computes them whole, as its weight
            for f in (layer.lora_A, layer.lora_B):
                mark_replicated(f.weight, tp_rank, tp, partial_grad=w.p3d_tp_partial_grad)
        forward = _plain_forward
    else:
        raise ValueError(f"LoRA: no adapters for a {type(layer).__name__}")
    if getattr(w, "p3d_expert", False):  # a routed expert's: reduced and sharded with the experts
        layer.lora_A.weight.p3d_expert = layer.lora_B.weight.p3d_expert = True
    layer.lora_scaling = alpha / rank
    layer.lora_dropout, layer.lora_salt, layer.lora_tp_rank, layer.lora_tp = dropout, salt, tp_rank, tp
    # the instance's forward as it stands (split_weight_grads may have replaced nn.Linear's),
    # kept to be put back by detach
    layer.lora_saved_forward = layer.__dict__.get("forward")
    layer.forward = partial(forward, layer, layer.forward)


def detach(layer: nn.Module) -> None:
    """Remove ``layer``'s adapters and give it back the forward it had before :func:`attach`."""
    saved = layer.__dict__.pop("lora_saved_forward")
    del layer.lora_A, layer.lora_B, layer.lora_scaling
    del layer.lora_dropout, layer.lora_salt, layer.lora_tp_rank, layer.lora_tp
    if saved is None:
        del layer.forward  # the class's own
    else:
        layer.forward = saved


def adapter_parameters(model: nn.Module, only=None) -> list[tuple[str, nn.Parameter]]:
    """(name, parameter) of every adapter factor ``model`` holds, in order (those in
    ``only``, a list of parameters, when given)."""
    keep = None if only is None else {id(p) for p in only}
    return [(n, p) for n, p in model.named_parameters()
            if getattr(p, "p3d_lora", False) and (keep is None or id(p) in keep)]


def trained_whole(model: nn.Module, only=None) -> list[tuple[str, nn.Parameter]]:
    """(name, parameter) of every weight ``model`` trains whole, not through adapters
    (``lora.trainable``: PEFT's ``modules_to_save``), those in ``only`` when given."""
    keep = None if only is None else {id(p) for p in only}
    return [(n, p) for n, p in model.named_parameters()
            if p.requires_grad and not getattr(p, "p3d_lora", False) and (keep is None or id(p) in keep)]


def model_config(model: nn.Module):
    """The model's config, whether ``model`` is the model or a rank's pipeline chunks."""
    return model.cfg if hasattr(model, "cfg") else model.pipeline_chunks[0].cfg
