"""LoRA on a Mixture-of-Experts layer's routed experts: each expert's ``gate_proj``,
``up_proj`` and ``down_proj`` gets adapters of its own, named as PEFT names them on a
model whose experts are separate linear layers
(``layers.1.mlp.experts.5.gate_proj.lora_A.weight``).

The experts module computes its held experts itself (one grouped GEMM per projection,
their own forwards never run), so the adapters join there: for each projection

    Y = X W_e^T + s (X A_e^T) B_e^T        on expert e's rows of the sorted tokens

as three grouped GEMMs (the weights, then the A's, then the B's) of the experts' own
backend (``grouped_backend``, set by ``models/moe/parallelize.use_grouped_gemm``; the
per-expert loop when unset). An expert's factors sit with its weight: under expert
parallelism on the ranks that hold it (``p3d_expert``: reduced and sharded over the
expert-data-parallel replicas), under tensor parallelism whole on every tp rank, as the
experts are.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import nn

from parallel3d.kernels.grouped_linear import grouped_linear

from .adapters import attach, detach

PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


class LoraSwiGLU:
    """The experts' SwiGLU with the adapters of ``experts``' held experts added (an
    ``Experts.swiglu`` of the same signature; the weight lists it is handed are those of
    the same experts, in the same order)."""

    reads_grouped_backend = True  # use_grouped_gemm records the backend and keeps this

    def __init__(self, experts: nn.Module):
        self.experts = experts

    def __call__(self, x, counts, gate, up, down):
        held = list(self.experts.values())
        if not held:
            return x[:0]
        backend = getattr(self.experts, "grouped_backend", "loop")

        def project(t, weights, name):
            y = grouped_linear(t, counts, weights, backend)
            layers = [getattr(e, name) for e in held]
            if not hasattr(layers[0], "lora_A"):
                return y
            h = grouped_linear(t, counts, [m.lora_A.weight for m in layers], backend)
            # scaled on the (N, r) factor, as the dense layers' adapters (adapters._plain_forward)
            return y + grouped_linear(h * layers[0].lora_scaling, counts, [m.lora_B.weight for m in layers],
                                      backend)

        h = F.silu(project(x, gate, "gate_proj")) * project(x, up, "up_proj")
        return project(h, down, "down_proj")


def attach_experts(experts: nn.Module, targets, rank: int, alpha: float, tp: int, tp_rank: int) -> int:
    """Adapters on the ``targets`` projections of every expert ``experts`` holds; returns
    how many projections got them (0: ``targets`` names none of the experts')."""
    names = [t for t in PROJECTIONS if t in targets]
    if not names:
        return 0
    for expert in experts.values():
        for name in names:
            attach(getattr(expert, name), rank, alpha, tp, tp_rank)
    experts.lora_saved_swiglu = experts.__dict__.get("swiglu")
    experts.swiglu = LoraSwiGLU(experts)
    return len(names)


def detach_experts(experts: nn.Module) -> None:
    """Remove the adapters of ``experts`` and give it back the computation it had."""
    saved = experts.__dict__.pop("lora_saved_swiglu")
    for expert in experts.values():
        for name in PROJECTIONS:
            if hasattr(getattr(expert, name), "lora_A"):
                detach(getattr(expert, name))
    if saved is None:
        del experts.swiglu  # the class's own
    else:
        experts.swiglu = saved
