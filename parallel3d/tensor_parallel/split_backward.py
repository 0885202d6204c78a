"""Layers whose backward splits into the input gradient (B) and the weight gradient (W).

Zero-bubble pipeline schedules run a micro-batch's backward as B, and its W later
(:mod:`parallel3d.kernels.deferred`). The tensor-parallel GEMMs (``column.py``) and
``kernels.gemm.linear`` honour the split themselves; this module gives it to the rest of
what holds a weight:

* :func:`embedding`: a table lookup whose table gradient is deferred (used by
  :class:`~parallel3d.tensor_parallel.layers.VocabParallelEmbedding`, and by an
  ``nn.Embedding`` after :func:`split_weight_grads`);
* :func:`add_bias`: ``y + b`` with ``db`` deferred (the row-parallel layers' bias);
* :func:`linear`: ``x A^T + b`` through ``kernels.gemm.linear`` under autocast as
  ``F.linear`` would run (the row-parallel layers);
* :func:`split_weight_grads`: an ``nn.Linear`` (nn.Linear's own ops) and an
  ``nn.Embedding`` with the split.

Outside ``deferring`` each computes its weight gradient at once and gives the numbers
of the op it stands in for: the table gradient is ``aten.embedding_dense_backward``, what
``F.embedding``'s backward calls, and the bias gradient sums dY over the leading dims as
autograd's broadcasting does.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from parallel3d.kernels.deferred import defer
from parallel3d.kernels.gemm import linear as _kernel_linear


class _Embedding(torch.autograd.Function):
    """``E[ids]``: ids (...), E (V, H) -> (..., H); dE deferred under ``deferring``."""

    @staticmethod
    def forward(ctx, ids, weight):
        ctx.save_for_backward(ids)
        ctx.weight = weight
        return F.embedding(ids, weight)

    @staticmethod
    def backward(ctx, dy):
        (ids,) = ctx.saved_tensors
        weight = ctx.weight

        def weight_grads() -> list:
            return [(weight, torch.ops.aten.embedding_dense_backward(dy, ids, weight.shape[0], -1, False))]

        if defer(weight_grads):
            return None, None
        return None, weight_grads()[0][1]


class _Linear(torch.autograd.Function):
    """``x W^T + b`` with nn.Linear's own ops (``F.linear`` forward; ``dy W`` and
    ``dy^T x`` on the flattened tokens backward); dW and db deferred under ``deferring``.
    What an ``nn.Linear`` runs after :func:`split_weight_grads` (the checked, backend-
    dispatching ``kernels.gemm.linear`` costs 45 us more a call on CPU)."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.inputs = (weight, bias)  # the W's targets (recomputation hands back copies)
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        weight_in, bias_in = ctx.inputs
        want_x, want_w, want_b = ctx.needs_input_grad
        dx = dy.matmul(weight) if want_x else None

        def weight_grads() -> list:
            dy2d = dy.reshape(-1, dy.shape[-1])
            dw = dy2d.t().mm(x.reshape(-1, x.shape[-1])) if want_w else None
            return [(weight_in, dw), (bias_in, dy2d.sum(0) if want_b else None)]

        if defer(weight_grads):
            return dx, None, None
        (_, dw), (_, db) = weight_grads()
        return dx, dw, db


class _AddBias(torch.autograd.Function):
    """``y + b``, b broadcast over the leading dims; db deferred under ``deferring``."""

    @staticmethod
    def forward(ctx, y, bias):
        ctx.bias = bias
        return y + bias

    @staticmethod
    def backward(ctx, dy):
        bias = ctx.bias

        def weight_grads() -> list:
            return [(bias, dy.sum_to_size(bias.shape))]

        if defer(weight_grads):
            return dy, None
        return dy, weight_grads()[0][1]


def embedding(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``F.embedding(ids, weight)`` whose table gradient a zero-bubble W computes."""
    if not weight.requires_grad:
        return F.embedding(ids, weight)
    return _Embedding.apply(ids, weight)


def add_bias(y: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """``y + bias`` whose bias gradient a zero-bubble W computes."""
    if not bias.requires_grad:
        return y + bias
    return _AddBias.apply(y, bias)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           backend: str) -> torch.Tensor:
    """``x A^T + b`` (``parallel3d.kernels.gemm.linear``); a weight carrying an fp32
    ``main_grad`` gets its gradient added there."""
    main_grad = getattr(weight, "main_grad", None)
    device = x.device.type
    if torch.is_autocast_enabled(device):
        # What autocast does for F.linear: the GEMM runs in the autocast dtype (the casts
        # are differentiable, so fp32 weights still get fp32 gradients).
        dtype = torch.get_autocast_dtype(device)
        x, weight = x.to(dtype), weight.to(dtype)
        bias = None if bias is None else bias.to(dtype)
        with torch.autocast(device, enabled=False):
            return _kernel_linear(x, weight, bias, main_grad, backend)
    return _kernel_linear(x, weight, bias, main_grad, backend)


def _linear_forward(module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    weight, bias = module.weight, module.bias
    device = x.device.type
    if torch.is_autocast_enabled(device):  # as autocast runs F.linear
        dtype = torch.get_autocast_dtype(device)
        x, weight = x.to(dtype), weight.to(dtype)
        bias = None if bias is None else bias.to(dtype)
        with torch.autocast(device, enabled=False):
            return _Linear.apply(x, weight, bias)
    return _Linear.apply(x, weight, bias)


def _embedding_forward(module: nn.Embedding, ids: torch.Tensor) -> torch.Tensor:
    return embedding(ids, module.weight)


def split_weight_grads(model: nn.Module) -> nn.Module:
    """Give every ``nn.Linear`` and ``nn.Embedding`` of ``model`` a backward that honours
    the B/W split (in place; parameters and their names unchanged). The layers of this
    package honour it already; other weight-holding modules are the caller's to swap
    (the Llama's RMSNorm: ``models/llama/parallelize.py``). A weight a module does not
    split still gets its gradient, in B."""
    for module in model.modules():
        if type(module) is nn.Linear:
            module.forward = partial(_linear_forward, module)
        elif type(module) is nn.Embedding:
            if module.padding_idx is not None or module.max_norm is not None or module.sparse:
                raise ValueError("split_weight_grads: an nn.Embedding with padding_idx, max_norm "
                                 "or sparse gradients is not supported")
            module.forward = partial(_embedding_forward, module)
    return model
