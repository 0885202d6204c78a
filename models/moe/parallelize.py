"""Expert parallelism for the MoE block: each rank of the expert group keeps 1/ep of the
routed experts and reaches the others by all-to-all (``parallel3d.expert_parallel``).

Rank r of ``ep`` keeps experts ``[r E/ep, (r + 1) E/ep)`` under their global names
(``experts.{e}.gate_proj.weight``), so checkpoints and the Hugging Face names see one
expert per tensor whatever the degree. The router, the shared expert and the rest of the
layer stay replicated: their gradients are those of this rank's tokens, reduced over the
data-parallel ranks as any dense weight; an expert's gradient already sums the rows of
every rank of its expert group (reduced over the ranks holding the same expert, dp / ep).

:func:`update_expert_biases_` is DeepSeek-V3's aux-loss-free step: each expert's selection
bias moves by ``rate * sign(mean(n) - n_i)``, ``n`` the assignments of the whole step,
summed over the micro-batches this rank ran (each block's ``step_counts``) and over the
ranks that routed different tokens (dp x cp). Every rank computes the same update from
the same all-reduced counts, so the replicated biases stay equal without a broadcast.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from parallel3d.distributed import all_reduce
from parallel3d.expert_parallel import dispatch_experts_combine

from .block import MoEBlock
from .experts import Experts
from .router import update_expert_bias_


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


@torch.no_grad()
def update_expert_biases_(model: nn.Module, group) -> dict[str, float]:
    """For each :class:`MoEBlock` of ``model`` that ran since the last call: all-reduce its
    step counts over ``group`` (None: this rank's alone), move its ``expert_bias`` (if it
    has one) by ``bias_update_rate``, reset the counts. Returns each block's max / mean
    assignments per expert over the step (1: balanced), by module name."""
    imbalance = {}
    for name, block in model.named_modules():
        if not isinstance(block, MoEBlock) or block.step_counts is None:
            continue
        counts = all_reduce(block.step_counts.clone(), group)
        block.step_counts = None
        if block.gate.expert_bias is not None:
            update_expert_bias_(block.gate.expert_bias, counts, block.cfg.bias_update_rate)
        imbalance[name] = (counts.max() / counts.float().mean()).item()
    return imbalance
