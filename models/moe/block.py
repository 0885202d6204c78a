"""The sparse MLP: router, routed experts, shared expert; balancing statistics and loss.

For hidden states x (B, S, dim) flattened to T = B S tokens::

    w, idx = route(x W_r^T)                                  (T, k) each (router.py)
    y_t = sum_j w_tj E_{idx_tj}(x_t)                         routed experts, dropless
        + sigmoid(x_t w_g) S(x_t)                            shared expert (gate optional)

The routed sum runs expert-major (experts.py): the T k assignments sorted by expert, each
expert on its contiguous rows, the weighted rows added back to their tokens. With a
capacity factor, an expert keeps its first C = ceil(cf T k / E) assignments; a dropped
assignment contributes nothing (the residual carries the token).

Each forward leaves :class:`RouterStats` in ``last_stats`` (the layer's assignments per
expert, the probability mass per expert with its gradient, tokens, dropped assignments):
the decoder's return value stays the hidden states, so pipeline stages and activation
recomputation see an ordinary module. :func:`load_balancing_loss` turns the stats of the
model's sparse layers into the auxiliary loss. ``step_counts`` sums the assignments per
expert over every forward since the caller last set it to None (the micro-batches of a
step, for the aux-loss-free bias update; a recomputed forward counts twice, which scales
a layer's counts uniformly and leaves ``sign(mean - n_i)`` and max / mean unchanged).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .config import MoEConfig
from .experts import Experts, SwiGLU, drop_over_capacity, sort_by_expert
from .router import Router


@dataclass
class RouterStats:
    tokens_per_expert: torch.Tensor  # (E,) int64 assignments routed to each expert (before drops)
    prob_sum: torch.Tensor           # (E,) fp32 sum over tokens of each expert's probability; has grad
    n_tokens: int                    # T
    dropped: torch.Tensor            # () int64 assignments over capacity

    def imbalance(self) -> torch.Tensor:
        """max / mean assignments per expert (1: perfectly balanced)."""
        counts = self.tokens_per_expert.float()
        return counts.max() / counts.mean()


class MoEBlock(nn.Module):
    """Drop-in for the dense MLP: (B, S, dim) -> (B, S, dim). Parameter names follow
    Hugging Face's Qwen-MoE layout: ``gate.weight``, ``experts.{e}.{gate,up,down}_proj.weight``,
    ``shared_expert.*``, ``shared_expert_gate.weight``."""

    def __init__(self, cfg: MoEConfig, dim: int):
        super().__init__()
        cfg.validate()
        self.cfg = cfg
        self.gate = Router(cfg, dim)
        self.experts = Experts(dim, cfg.ffn_dim, range(cfg.n_experts))
        self.shared_expert = SwiGLU(dim, cfg.shared_ffn_dim) if cfg.shared_ffn_dim else None
        self.shared_expert_gate = nn.Linear(dim, 1, bias=False) if cfg.shared_gate else None
        self.last_stats: RouterStats | None = None
        self.step_counts: torch.Tensor | None = None  # (E,) int64, not a buffer: no state

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, S, dim = x.shape
        flat = x.reshape(-1, dim)  # (T, dim)
        T, k = flat.shape[0], self.cfg.top_k
        routing = self.gate(flat)
        order, counts = sort_by_expert(routing.indices, self.cfg.n_experts)  # (T k,), (E,)
        kept, kept_counts = order, counts
        capacity = self.cfg.capacity(T)
        if capacity is not None:
            expert_of = routing.indices.reshape(-1)[order]
            kept, kept_counts = drop_over_capacity(order, counts, expert_of, capacity)
        token_of = kept // k  # (N,)
        routed = self.experts(flat[token_of], kept_counts.tolist())  # (N, dim), expert-major
        routed = routed * routing.weights.reshape(-1)[kept, None]
        out = torch.zeros_like(flat).index_add_(0, token_of, routed.to(flat.dtype))
        if self.shared_expert is not None:
            shared = self.shared_expert(flat)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(flat)) * shared
            out = out + shared
        dropped = torch.tensor(order.numel() - kept.numel(), device=counts.device)
        self.last_stats = RouterStats(counts, routing.probs.sum(0), T, dropped)
        self.step_counts = counts if self.step_counts is None else self.step_counts + counts
        return out.view(B, S, dim)


def load_balancing_loss(stats: list[RouterStats], n_experts: int, pooled: bool = True) -> torch.Tensor:
    """Switch Transformer's auxiliary loss ``E * sum_i f_i P_i``, ``f_i`` the assignments to
    expert i per token (they sum to k) and ``P_i`` its mean probability.

    ``pooled`` (transformers' ``load_balancing_loss_func``, which Qwen2/3-MoE, Mixtral and
    OLMoE share): f and P over all layers' tokens at once, ``f_i = sum_l n_li / (L T)``,
    ``P_i = sum_l sum_t p_lti / (L T)``. Otherwise the mean over layers of each layer's
    own loss (Megatron-Core's per-layer form; one layer's term needs only its own stats,
    which suits pipeline stages). The family's coefficient multiplies it outside.
    """
    if not stats:
        return torch.zeros(())
    if pooled:
        rows = sum(s.n_tokens for s in stats)
        f = sum(s.tokens_per_expert.float() for s in stats) / rows
        p = sum(s.prob_sum for s in stats) / rows
        return n_experts * (f * p).sum()
    per_layer = [n_experts * (s.tokens_per_expert.float() / s.n_tokens * s.prob_sum / s.n_tokens).sum()
                 for s in stats]
    return torch.stack(per_layer).mean()
