"""Folding the adapters into the weights: PEFT's ``merge_and_unload`` on this rank's shards.

Each rank merges its own block, with no communication: ``W + s B A`` restricted to the
block is the block of the merged weight (column-parallel: rows of W and B, A whole,
``W_k + s B_k A``; row-parallel: columns of W and A, B whole, ``W_k + s B A_k``). The
product is taken in fp32 and in PEFT's order (``(B @ A) * s``) and added in fp32 before
the cast to the weight's dtype. The layers then run as before :func:`attach`, with no
adapter parameters: the model is a plain (parallel) model again, for an export or for
inference.
"""

from __future__ import annotations

import torch

from .adapters import LoraFactor, detach
from .experts import detach_experts


@torch.no_grad()
def merge_and_unload_(model: torch.nn.Module) -> torch.nn.Module:
    """Merge every adapter of ``model`` into its layer's weight and remove it, in place
    (an MoE layer's experts: each expert's, then the experts compute as they did before)."""
    for module in list(model.modules()):
        if not isinstance(getattr(module, "lora_A", None), LoraFactor):
            continue
        a, b = module.lora_A.weight.float(), module.lora_B.weight.float()
        w = module.weight
        w.copy_(w.float() + (b @ a) * module.lora_scaling)  # (out or out/p, in or in/p)
        detach(module)
    for module in list(model.modules()):
        if "lora_saved_swiglu" in module.__dict__:
            detach_experts(module)  # its experts' adapters are merged and gone: the computation back
    return model
