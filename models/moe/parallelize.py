"""Expert parallelism for the MoE block: each rank of the expert group keeps 1/ep of the
routed experts and reaches the others by all-to-all (``parallel3d.expert_parallel``).

Rank r of ``ep`` keeps experts ``[r E/ep, (r + 1) E/ep)`` under their global names
(``experts.{e}.gate_proj.weight``), so checkpoints and the Hugging Face names see one
expert per tensor whatever the degree. The router, the shared expert and the rest of the
layer stay replicated: their gradients are those of this rank's tokens, reduced over the
data-parallel ranks as any dense weight; an expert's gradient already sums the rows of
every rank of its expert group (reduced over the ranks holding the same expert, dp / ep).

:func:`finish_moe_step` takes DeepSeek-V3's aux-loss-free step: each expert's selection
bias moves by ``rate * sign(mean(n) - n_i)``, ``n`` the assignments of the whole step,
summed over the micro-batches this rank ran (each block's ``step_counts``) and over the
ranks that routed different tokens (dp x cp). Every rank computes the same update from
the same all-reduced counts, so the replicated biases stay equal without a broadcast.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from parallel3d.distributed import all_reduce
from parallel3d.expert_parallel import dispatch_experts_combine
from parallel3d.kernels.grouped_linear import grouped_linear

from .block import MoEBlock
from .experts import Experts
from .router import update_expert_bias_


class ExpertParallelExperts(Experts):
    """This rank's experts; ``forward`` takes rows sorted by global expert and counts for all
    E experts, like :class:`Experts` holding them all."""

    def __init__(self, held: dict[int, nn.Module], group):
        nn.ModuleDict.__init__(self, {str(e): m for e, m in sorted(held.items())})
        self.group = group
        self.timeline = None  # the trainer's: the all-to-alls' waits are recorded there

    def forward(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        run_local = super().forward  # the held experts on rows sorted by local expert
        counts = torch.tensor(counts, dtype=torch.int64, device=x.device)
        return dispatch_experts_combine(x, counts, run_local, self.group, self.timeline)


def local_experts(n_experts: int, ep: int, ep_rank: int) -> range:
    if n_experts % ep:
        raise ValueError(f"moe.n_experts {n_experts} is not divisible by parallel.ep {ep}")
    per_rank = n_experts // ep
    return range(ep_rank * per_rank, (ep_rank + 1) * per_rank)


def apply_expert_parallel(model: nn.Module, ep_group, ep: int | None = None,
                          ep_rank: int | None = None) -> nn.Module:
    """Keep this rank's experts in every :class:`MoEBlock` of ``model`` (in place); the
    others are dropped, and the kept experts' parameters are marked ``p3d_expert`` (their
    gradients and optimizer state live on the expert-data-parallel ranks only,
    ``parallel3d.zero.split``). ``ep`` / ``ep_rank``: the degree and this rank's place
    (default: read from ``ep_group``; given, a meta model is laid out with no process
    group, as the dry run does). Degree 1: unchanged."""
    if ep is None:
        ep = 1 if ep_group is None else dist.get_world_size(ep_group)
        ep_rank = 0 if ep == 1 else dist.get_rank(ep_group)
    if ep == 1:
        return model
    for block in [m for m in model.modules() if isinstance(m, MoEBlock)]:
        held = {e: block.experts[str(e)] for e in local_experts(block.cfg.n_experts, ep, ep_rank)}
        block.experts = ExpertParallelExperts(held, ep_group)
        for p in block.experts.parameters():
            p.p3d_expert = True
    return model


# parallel.linear_backend -> the experts' grouped GEMM backend (kernels/grouped_linear.py)
EXPERT_BACKENDS = {"auto": "auto", "triton": "triton", "torch": "loop"}


def grouped_gemm_swiglu(backend: str):
    """``grouped_swiglu``'s computation with each of its three GEMMs a grouped GEMM of
    ``backend`` (on CPU under "auto", the same per-expert F.linear calls, bit for bit)."""
    def swiglu(x, counts, gate, up, down):
        if not gate:
            return x[:0]
        h = F.silu(grouped_linear(x, counts, gate, backend)) * grouped_linear(x, counts, up, backend)
        return grouped_linear(h, counts, down, backend)
    return swiglu


def use_grouped_gemm(model: nn.Module, linear_backend: str) -> list[tuple[int, int, int]]:
    """Run every :class:`Experts` of ``model`` through the grouped GEMMs of
    ``parallel.linear_backend`` (in place): the backend is recorded as ``grouped_backend``,
    and a computation that reads it itself (``reads_grouped_backend``: LoRA's,
    ``parallel3d/lora/experts.py``) is kept. Returns each one's (held experts, dim, ffn)."""
    backend = EXPERT_BACKENDS[linear_backend]
    shapes = []
    for module in model.modules():
        if isinstance(module, Experts) and len(module):
            module.grouped_backend = backend
            if not getattr(module.__dict__.get("swiglu"), "reads_grouped_backend", False):
                module.swiglu = grouped_gemm_swiglu(backend)
            first = next(iter(module.values()))
            shapes.append((len(module), first.up_proj.in_features, first.up_proj.out_features))
    return shapes


def moe_blocks(model: nn.Module) -> list[tuple[str, MoEBlock]]:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, MoEBlock)]


def token_groups(topo, sequence_parallel: bool) -> tuple:
    """The groups over which one micro-batch's tokens are split: tensor parallelism's
    (with sequence parallelism: each tp rank routes S/tp positions) and context
    parallelism's. Without sequence parallelism every tp rank routes all the tokens."""
    groups = []
    if sequence_parallel and topo.tp > 1:
        groups.append(topo.tp_group)
    if topo.cp > 1:
        groups.append(topo.cp_group)
    return tuple(groups)


def prepare_moe_training(model: nn.Module, topo, sequence_parallel: bool, n_micro: int,
                         n_sparse_layers: int) -> None:
    """Set every :class:`MoEBlock` of this rank up for a step of ``n_micro`` micro-batches.

    The step's auxiliary loss is ``coef`` times the mean over the model's
    ``n_sparse_layers`` sparse layers and over the global batch's micro-batches of each
    layer's loss on its micro-batch (Megatron-Core's per-layer form: each layer's term
    needs only its own statistics, so it stays on its pipeline stage). Each micro-batch's
    term gets the gradient weight ``coef / (n_micro n_sparse)`` (the language-model loss
    of a micro-batch is divided by ``n_micro`` too, and data-parallel replicas average),
    times cp: context-parallel ranks hold parts of one micro-batch's loss whose gradients
    the replicas' average divides by cp, where the parts must add up. The logged value
    counts each part once: the tp ranks that route the same tokens (no sequence
    parallelism) log on tp rank 0 only."""
    groups = token_groups(topo, sequence_parallel)
    for _, block in moe_blocks(model):
        coef = block.cfg.aux_loss_coef
        block.token_groups = groups
        block.aux_scale = coef * topo.cp / (n_micro * n_sparse_layers) if coef else None
        logs = sequence_parallel or topo.tp_rank == 0
        block.aux_log_weight = coef / (n_micro * n_sparse_layers) if logs else 0.0


@torch.no_grad()
def finish_moe_step(model: nn.Module, topo, sequence_parallel: bool) -> dict[str, torch.Tensor]:
    """After a step's forward and backward passes: the step's assignments per expert of
    every :class:`MoEBlock` of this rank, summed over the ranks that routed different
    tokens (dp x cp, and tp under sequence parallelism), move the aux-loss-free biases
    (``update_expert_bias_``: every rank the same update from the same counts); the
    blocks' step sums are reset. Returns this rank's parts of the step's figures, to be
    reduced over the world by the caller: ``aux_loss`` (sum, then / dp), ``dropped``
    (assignments over capacity; sum) and
    ``imbalance`` (max over layers of max / mean assignments per expert; max)."""
    blocks = [b for _, b in moe_blocks(model) if b.step_counts is not None]
    device = next(model.parameters()).device
    zero = torch.zeros((), dtype=torch.float64, device=device)
    out = {"aux_loss": zero.clone(), "dropped": zero.clone(), "imbalance": zero.clone()}
    if not blocks:
        return out
    counts = torch.stack([b.step_counts for b in blocks]).to(torch.float64)  # (L, E)
    groups = [topo.dp_cp_group, *([topo.tp_group] if sequence_parallel and topo.tp > 1 else [])]
    for group in groups:
        counts = all_reduce(counts, group)
    for block, row in zip(blocks, counts):
        if block.gate.expert_bias is not None:
            update_expert_bias_(block.gate.expert_bias, row, block.cfg.bias_update_rate)
    out["imbalance"] = (counts.max(1).values / counts.mean(1)).max()
    out["aux_loss"] = sum((b.step_aux.double() for b in blocks if b.step_aux is not None), zero.clone())
    if sequence_parallel or topo.tp_rank == 0:  # tp ranks without sequence shards route the same tokens
        out["dropped"] = sum((b.step_dropped.double() for b in blocks), zero.clone())
    for b in blocks:
        b.step_counts = b.step_dropped = b.step_aux = None
    return out
