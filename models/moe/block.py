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

import torch.distributed as dist

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
        # Summed over the forwards since the caller last set them to None (a step's
        # micro-batches): assignments per expert (E,), dropped assignments, and the
        # logged auxiliary loss. Not buffers: no state.
        self.step_counts: torch.Tensor | None = None
        self.step_dropped: torch.Tensor | None = None
        self.step_aux: torch.Tensor | None = None
        # Training with the auxiliary loss (set by models/moe/parallelize.prepare_moe_training):
        # the gradient weight of this layer's loss per micro-batch (None: no auxiliary loss
        # in the backward), the weight of its value in the logged aux_loss, and the groups
        # over which a micro-batch's tokens are split.
        self.aux_scale: float | None = None
        self.aux_log_weight: float = 1.0
        self.token_groups: tuple = ()

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
        # index_select rather than advanced indexing: the same rows, a faster gather on CPU
        # (its backward, index_add_ in index order, sums a token's rows as index_put_ did)
        routed = self.experts(flat.index_select(0, token_of), kept_counts.tolist())  # (N, dim), expert-major
        routed = routed * routing.weights.reshape(-1).index_select(0, kept)[:, None]
        out = torch.zeros_like(flat).index_add_(0, token_of, routed.to(flat.dtype))
        if self.shared_expert is not None:
            shared = self.shared_expert(flat)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(flat)) * shared
            out = out + shared
        out = out.view(B, S, dim)
        prob_sum = routing.probs.sum(0)
        if self.aux_scale is not None and torch.is_grad_enabled():
            out = self._attach_aux_loss(out, counts, prob_sum, T)
        if torch._C._current_graph_task_id() == -1:  # not a recomputation inside backward
            dropped = torch.tensor(order.numel() - kept.numel(), device=counts.device)
            self.last_stats = RouterStats(counts, prob_sum, T, dropped)
            self.step_counts = counts if self.step_counts is None else self.step_counts + counts
            self.step_dropped = dropped if self.step_dropped is None else self.step_dropped + dropped
        return out

    def _attach_aux_loss(self, out: torch.Tensor, counts: torch.Tensor, prob_sum: torch.Tensor,
                         T: int) -> torch.Tensor:
        """This layer's auxiliary loss over the micro-batch, its gradient joined to the
        backward pass of ``out`` (``_AuxGrad``): ``E sum_i f_i P_i`` with ``f_i`` the
        micro-batch's assignments to expert i per token and ``P_i`` its mean probability.
        When the micro-batch's tokens are split over ranks (``token_groups``: tensor
        parallelism's sequence shards, context parallelism), ``f`` and the token count are
        summed over them first (no gradient) and each rank's term holds the probabilities
        of its own tokens: the ranks' terms add up to the loss of the whole micro-batch."""
        totals = torch.cat([counts.to(torch.float32), counts.new_tensor([T], dtype=torch.float32)])
        for group in self.token_groups:  # integer-valued: every rank gets the exact sums
            dist.all_reduce(totals, group=group)
        f, n_tokens = totals[:-1] / totals[-1], totals[-1]
        aux = self.cfg.n_experts * (f * (prob_sum / n_tokens)).sum()
        if torch._C._current_graph_task_id() == -1:
            part = aux.detach() * self.aux_log_weight
            self.step_aux = part if self.step_aux is None else self.step_aux + part
        return _AuxGrad.apply(out, aux, self.aux_scale)


class _AuxGrad(torch.autograd.Function):
    """Identity on ``out``; in backward, the auxiliary loss ``aux`` (a scalar of the same
    graph) receives the gradient ``scale``: as if ``scale * aux`` were added to the loss,
    without the loss value (pipeline stages return no loss but the last one's; this way
    each stage's routers get their gradient where they are, as Megatron-Core's
    MoEAuxLossAutoScaler does)."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        ctx.aux_dtype, ctx.aux_device = aux.dtype, aux.device
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, torch.full((), ctx.scale, dtype=ctx.aux_dtype, device=ctx.aux_device), None


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
