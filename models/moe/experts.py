"""Routed experts, dropless: tokens sorted expert-major, each expert on its contiguous slice.

With ``T`` tokens routed to ``k`` experts each, the ``N = T k`` assignments are sorted by
expert (stably, so each expert sees its tokens in token order); expert ``e`` then owns
rows ``[o_e, o_e + n_e)`` of the permuted tokens, ``o`` the prefix sums of the counts
``n``. :func:`grouped_swiglu` takes exactly that (permuted tokens, counts, per-expert
weights): the loop over experts inside is what a grouped GEMM replaces.

Experts are separate parameters, ``experts.{e}.{gate,up,down}_proj.weight`` keyed by the
global expert id (as Hugging Face writes them on disk, and as Megatron's grouped MLP keeps
them): a rank that holds some of the experts under expert parallelism keeps their names.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SwiGLU(nn.Module):
    """``down(silu(gate(x)) * up(x))`` with weights (f, dim), (f, dim), (dim, f): one expert,
    or the shared expert."""

    def __init__(self, dim: int, ffn_dim: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, ffn_dim, bias=False)
        self.up_proj = nn.Linear(dim, ffn_dim, bias=False)
        self.down_proj = nn.Linear(ffn_dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def grouped_swiglu(x: torch.Tensor, counts: list[int], gate: list[torch.Tensor],
                   up: list[torch.Tensor], down: list[torch.Tensor]) -> torch.Tensor:
    """Expert e's SwiGLU on its slice of the permuted tokens.

    x: (N, dim), rows grouped by expert, ``counts[e]`` rows for expert e (sum = N);
    gate[e], up[e]: (f, dim); down[e]: (dim, f). Returns (N, dim) in the same row order.
    """
    outs = []
    for rows, wg, wu, wd in zip(x.split(counts), gate, up, down):
        outs.append(F.linear(F.silu(F.linear(rows, wg)) * F.linear(rows, wu), wd))
    return torch.cat(outs) if outs else x[:0]


class Experts(nn.ModuleDict):
    """The routed experts this module holds, keyed by global expert id (all of them on one
    device; a subset under expert parallelism). ``swiglu`` computes them (the loop above;
    ``parallelize`` may set a grouped-GEMM one of the same signature on an instance)."""

    swiglu = staticmethod(grouped_swiglu)
    # forward reads the held experts' weights itself (their own forwards never run): ZeRO's
    # parameter gathers are waited for here (parallel3d.zero.params.bucket_readers)
    computes_children = True

    def __init__(self, dim: int, ffn_dim: int, expert_ids):
        super().__init__({str(e): SwiGLU(dim, ffn_dim) for e in expert_ids})

    def forward(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """x: (N, dim) sorted by expert, ``counts`` per held expert in id order -> (N, dim)."""
        experts = list(self.values())
        return self.swiglu(x, counts, [e.gate_proj.weight for e in experts],
                              [e.up_proj.weight for e in experts], [e.down_proj.weight for e in experts])


def sort_by_expert(indices: torch.Tensor, n_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The expert-major order of the assignments ``indices`` (T, k): ``order`` (T k,) into
    the flattened assignments (token ``order // k``), and ``counts`` (E,) per expert."""
    flat = indices.reshape(-1)
    order = torch.argsort(flat, stable=True)
    return order, torch.bincount(flat, minlength=n_experts)


def drop_over_capacity(order: torch.Tensor, counts: torch.Tensor, expert_of: torch.Tensor,
                       capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keep the first ``capacity`` assignments of each expert (in token order, as the stable
    sort left them): the kept ``order`` and ``counts``. ``expert_of`` (N,) is the expert of
    each sorted assignment."""
    starts = torch.cumsum(counts, 0) - counts  # (E,) first row of each expert
    rank_in_expert = torch.arange(order.numel(), device=order.device) - starts[expert_of]
    keep = rank_in_expert < capacity
    return order[keep], counts.clamp(max=capacity)
