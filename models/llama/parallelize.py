"""Turn a plain :class:`Llama` into this rank's part of a parallel model.

Today only data parallelism exists, which needs no change to the model; tensor
parallelism (swapping q/k/v/gate/up for column-parallel and o/down for row-parallel
layers) and pipeline stage cutting plug in here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

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
