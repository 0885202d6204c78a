"""Turn a plain :class:`Llama` into this rank's part of a parallel model.

Today only data parallelism exists, which needs no change to the model; tensor
parallelism (swapping q/k/v/gate/up for column-parallel and o/down for row-parallel
layers) and pipeline stage cutting plug in here.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import (CheckpointPolicy, checkpoint,
                                    create_selective_checkpoint_contexts, noop_context_fn)

from parallel3d.errors import UserError

from .model import Llama


def cross_entropy_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over all (B*S) positions, computed in fp32."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def parallelize_llama(model: Llama, topo, parallel_cfg) -> tuple[Llama, callable]:
    """Return (this rank's model, its loss function)."""
    if topo.tp > 1:
        raise UserError("parallel.tp > 1 is not implemented yet: use parallel.tp=1")
    if topo.pp > 1:
        raise UserError("parallel.pp > 1 is not implemented yet: use parallel.pp=1")
    return model, cross_entropy_loss


# Selective recomputation keeps what is costly to recompute and cheap to store relative to
# it: the outputs of the matrix multiplications (q, k, v, o, gate, up, down). Everything
# else in the layer (RMSNorm, RoPE, attention itself, SiLU * up, residual adds) is re-run
# in the backward pass from those saved outputs.
_MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default}


def _keep_matmul_outputs(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op in _MATMULS else CheckpointPolicy.PREFER_RECOMPUTE


def _recomputed_forward(forward, context_fn, *args, **kwargs):
    return checkpoint(forward, *args, use_reentrant=False, context_fn=context_fn, **kwargs)


def apply_recompute(model: Llama, mode: str) -> Llama:
    """Activation recomputation on each decoder layer this rank holds (in place).

    ``full``: a layer keeps only its input and re-runs its whole forward in the backward
    pass. ``selective``: the layer keeps its matmul outputs and re-runs the rest (torch's
    selective activation checkpointing with :func:`_keep_matmul_outputs` as policy).
    Either way the gradients are those of ``none``: the same ops on the same inputs.
    """
    if mode == "none":
        return model
    if mode not in ("full", "selective"):
        raise UserError(f"train.recompute '{mode}' is not supported: use none, full or selective")
    context_fn = (partial(create_selective_checkpoint_contexts, _keep_matmul_outputs)
                  if mode == "selective" else noop_context_fn)
    for layer in model.layers.values():
        if getattr(layer, "p3d_recompute", None) is not None:
            raise ValueError(f"recompute already applied ({layer.p3d_recompute})")
        layer.forward = partial(_recomputed_forward, layer.forward, context_fn)
        layer.p3d_recompute = mode
    return model
