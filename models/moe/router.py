"""Token-choice top-k routing: scores, group-limited selection, combine weights.

For T tokens with router logits ``z = x W_r^T`` (T, E)::

    s = softmax(z)  or  sigmoid(z)                     scores (fp32), (T, E)
    c = s + b                                          b: the aux-loss-free bias (selection only)
    groups: c viewed (T, G, E/G); a group's score is the sum of its best two (DeepSeek-V3);
            the topk_group best groups stay, the others' c become -inf
    idx = topk(c, k)                                   (T, k), best first
    w = s[idx]                                         the unbiased scores of the chosen
    w = w / sum(w)        if norm_topk_prob
    w = w * routed_scaling

(DeepSeek-V3's reference fills dropped groups with 0, which a negative biased score could
lose to; -inf keeps the selection inside the chosen groups always.)

Balancing statistics per step: the assignments per expert ``n_i`` and the sum of the
probabilities each expert got, ``sum_t p_ti`` with ``p = s`` (softmax) or ``s / sum(s)``
(sigmoid, DeepSeek-V3's normalisation), which carries the gradient of the auxiliary loss.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .config import MoEConfig


@dataclass
class Routing:
    weights: torch.Tensor   # (T, k) combine weights, the logits' dtype
    indices: torch.Tensor   # (T, k) expert ids, int64
    probs: torch.Tensor     # (T, E) fp32 probabilities for the auxiliary loss


def _limit_to_groups(choice: torch.Tensor, n_group: int, topk_group: int) -> torch.Tensor:
    """``choice`` (T, E) with the experts outside each token's ``topk_group`` best groups
    set to -inf; a group's score is the sum of its best min(2, E/G) experts."""
    T, E = choice.shape
    grouped = choice.view(T, n_group, E // n_group)  # (T, G, E/G)
    group_score = grouped.topk(min(2, E // n_group), dim=-1).values.sum(-1)  # (T, G)
    keep = torch.zeros_like(group_score, dtype=torch.bool)
    keep.scatter_(1, group_score.topk(topk_group, dim=-1).indices, True)
    return grouped.masked_fill(~keep[..., None], float("-inf")).view(T, E)


def route(logits: torch.Tensor, cfg: MoEConfig, bias: torch.Tensor | None = None) -> Routing:
    """Top-k routing of ``logits`` (T, E); ``bias`` (E,) moves the selection only."""
    scores = logits.float().softmax(-1) if cfg.score_func == "softmax" else logits.float().sigmoid()
    choice = scores if bias is None else scores + bias.float()
    if cfg.n_group > 1:
        choice = _limit_to_groups(choice, cfg.n_group, cfg.topk_group)
    indices = choice.topk(cfg.top_k, dim=-1).indices  # (T, k)
    weights = scores.gather(1, indices)
    if cfg.norm_topk_prob:
        weights = weights / weights.sum(-1, keepdim=True)
    if cfg.routed_scaling != 1.0:
        weights = weights * cfg.routed_scaling
    probs = scores if cfg.score_func == "softmax" else scores / scores.sum(-1, keepdim=True)
    return Routing(weights.to(logits.dtype), indices, probs)


class Router(nn.Module):
    """The gate ``W_r`` (E, dim), named ``gate.weight`` as in Hugging Face, and, with
    ``cfg.expert_bias``, the selection bias ``expert_bias`` (E,), a persistent fp32 buffer
    that no gradient reaches (:func:`update_expert_bias_`)."""

    def __init__(self, cfg: MoEConfig, dim: int):
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.empty(cfg.n_experts, dim))
        nn.init.normal_(self.weight, std=0.02)
        bias = torch.zeros(cfg.n_experts, dtype=torch.float32) if cfg.expert_bias else None
        self.register_buffer("expert_bias", bias)  # None: registered absent, not in the state dict

    def forward(self, x: torch.Tensor) -> Routing:
        """x: (T, dim) -> :class:`Routing` of T tokens."""
        return route(F.linear(x, self.weight), self.cfg, self.expert_bias)


@torch.no_grad()
def update_expert_bias_(bias: torch.Tensor, counts: torch.Tensor, rate: float) -> torch.Tensor:
    """DeepSeek-V3's aux-loss-free update, in place: ``b_i += rate * sign(mean(n) - n_i)``
    with ``n`` the step's assignments per expert summed over every rank that routes
    (the caller all-reduces them first). Overloaded experts lose bias, idle ones gain it."""
    counts = counts.to(torch.float32)
    return bias.add_(torch.sign(counts.mean() - counts), alpha=rate)
