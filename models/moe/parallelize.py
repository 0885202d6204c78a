"""Expert parallelism for the MoE block: each rank of the expert group keeps 1/ep of the
routed experts and reaches the others by all-to-all (``parallel3d.expert_parallel``).

Rank r of ``ep`` keeps experts ``[r E/ep, (r + 1) E/ep)`` under their global names
(``experts.{e}.gate_proj.weight``), so checkpoints and the Hugging Face names see one
expert per tensor whatever the degree. The router, the shared expert and the rest of the
layer stay replicated: their gradients are those of this rank's tokens, reduced over the
data-parallel ranks as any dense weight; an expert's gradient already sums the rows of
every rank of its expert group (reduced over the ranks holding the same expert, dp / ep).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from parallel3d.expert_parallel import dispatch_experts_combine

from .block import MoEBlock
from .experts import Experts


class ExpertParallelExperts(Experts):
    """This rank's experts; ``forward`` takes rows sorted by global expert and counts for all
    E experts, like :class:`Experts` holding them all."""

    def __init__(self, held: dict[int, nn.Module], group):
        nn.ModuleDict.__init__(self, {str(e): m for e, m in sorted(held.items())})
        self.group = group

    def forward(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        run_local = super().forward  # the held experts on rows sorted by local expert
        counts = torch.tensor(counts, dtype=torch.int64, device=x.device)
        return dispatch_experts_combine(x, counts, run_local, self.group)


def local_experts(n_experts: int, ep: int, ep_rank: int) -> range:
    if n_experts % ep:
        raise ValueError(f"moe.n_experts {n_experts} is not divisible by parallel.ep {ep}")
    per_rank = n_experts // ep
    return range(ep_rank * per_rank, (ep_rank + 1) * per_rank)


def apply_expert_parallel(model: nn.Module, ep_group) -> nn.Module:
    """Keep this rank's experts in every :class:`MoEBlock` of ``model`` (in place); the
    others are dropped. ``ep_group`` None or of one rank: unchanged."""
    if ep_group is None or dist.get_world_size(ep_group) == 1:
        return model
    ep, ep_rank = dist.get_world_size(ep_group), dist.get_rank(ep_group)
    for block in [m for m in model.modules() if isinstance(m, MoEBlock)]:
        held = {e: block.experts[str(e)] for e in local_experts(block.cfg.n_experts, ep, ep_rank)}
        block.experts = ExpertParallelExperts(held, ep_group)
    return model
