"""Activation recomputation for the Llama family (``train.recompute``): each decoder
layer's forward re-run in the backward pass, whole or all but its matmul outputs."""

from __future__ import annotations

from functools import partial

import torch
from torch.utils.checkpoint import (CheckpointPolicy, checkpoint,
                                    create_selective_checkpoint_contexts, noop_context_fn)

from parallel3d.config import Recompute
from parallel3d.kernels import gemm  # noqa: F401 - registers torch.ops.parallel3d.linear_* (in _MATMULS)
from parallel3d.tensor_parallel import RowParallelLinear

from .model import Llama

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
