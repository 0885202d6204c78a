"""The Mixture-of-Experts section of a model config: routing, experts, balancing.

One frozen dataclass, the only thing the MoE block receives. Defaults are a Qwen3-MoE /
OLMoE style router (softmax over the experts, top-k, no renormalisation, the Switch
auxiliary loss); the other families are a few fields away:

=================  ============================================================
Mixtral            ``norm_topk_prob=True``
Qwen2-MoE          ``shared_ffn_dim > 0``, ``shared_gate=True``
DeepSeek-V3        ``score_func="sigmoid"``, ``n_group``/``topk_group``,
                   ``routed_scaling``, ``expert_bias=True``, ``aux_loss_coef=0``
=================  ============================================================
"""

from __future__ import annotations

import math
from dataclasses import dataclass

SCORE_FUNCS = ("softmax", "sigmoid")


@dataclass(frozen=True)
class MoEConfig:
    n_experts: int = 8
    top_k: int = 2
    # Width of one routed expert's SwiGLU (moe_intermediate_size).
    ffn_dim: int = 64
    score_func: str = "softmax"
    # Divide the k selected weights by their sum (Mixtral always; Qwen/OLMoE norm_topk_prob).
    norm_topk_prob: bool = False
    # Group-limited routing (DeepSeek-V3): experts in n_group equal groups, tokens choose
    # among the topk_group best groups only. 1 / 1: no grouping.
    n_group: int = 1
    topk_group: int = 1
    # Multiplies the routed experts' combined output weights (DeepSeek-V3 2.5).
    routed_scaling: float = 1.0
    # Shared expert(s) run on every token: their total SwiGLU width (0: none), and
    # Qwen2-MoE's sigmoid gate ``sigmoid(x w_g)`` on their output.
    shared_ffn_dim: int = 0
    shared_gate: bool = False
    # Layers that keep the dense MLP (the rest are sparse), resolved from the family's
    # mlp_only_layers / decoder_sparse_step / first_k_dense_replace.
    dense_layers: tuple = ()
    # Coefficient of the Switch-style auxiliary load-balancing loss (0: off).
    aux_loss_coef: float = 0.0
    # Tokens one expert takes per step: ceil(capacity_factor * tokens * top_k / n_experts);
    # the rest are dropped (counted). 0: dropless.
    capacity_factor: float = 0.0
    # Aux-loss-free balancing (DeepSeek-V3): a per-expert bias added to the scores for the
    # selection only, moved by bias_update_rate * sign(mean count - count) after each step.
    expert_bias: bool = False
    bias_update_rate: float = 1e-3

    def __post_init__(self):
        object.__setattr__(self, "dense_layers", tuple(sorted(int(i) for i in self.dense_layers)))

    def validate(self) -> None:
        if self.n_experts < 1 or not 1 <= self.top_k <= self.n_experts:
            raise ValueError(f"moe.top_k {self.top_k} must be between 1 and moe.n_experts {self.n_experts}")
        if self.score_func not in SCORE_FUNCS:
            raise ValueError(f"moe.score_func '{self.score_func}' is not supported: choose one of {SCORE_FUNCS}")
        if self.n_experts % self.n_group:
            raise ValueError(f"moe.n_experts {self.n_experts} is not divisible by moe.n_group {self.n_group}")
        if not 1 <= self.topk_group <= self.n_group:
            raise ValueError(f"moe.topk_group {self.topk_group} must be between 1 and moe.n_group {self.n_group}")
        if self.top_k > self.topk_group * (self.n_experts // self.n_group):
            raise ValueError(f"moe.top_k {self.top_k} exceeds the experts of moe.topk_group "
                             f"{self.topk_group} groups of {self.n_experts // self.n_group}")
        if self.capacity_factor < 0:
            raise ValueError(f"moe.capacity_factor {self.capacity_factor} must be >= 0 (0: dropless)")
        if self.shared_gate and not self.shared_ffn_dim:
            raise ValueError("moe.shared_gate needs a shared expert: set moe.shared_ffn_dim")

    def is_sparse(self, layer: int) -> bool:
        return layer not in self.dense_layers

    def capacity(self, n_tokens: int) -> int | None:
        """Assignments one expert takes in a step of ``n_tokens`` tokens; None: dropless."""
        if not self.capacity_factor:
            return None
        return math.ceil(self.capacity_factor * n_tokens * self.top_k / self.n_experts)

    def num_params(self, dim: int) -> int:
        """Parameters of one sparse block (router, routed and shared experts)."""
        shared = 3 * dim * self.shared_ffn_dim + dim * self.shared_gate
        return self.n_experts * dim + self.n_experts * 3 * dim * self.ffn_dim + shared

    def active_params(self, dim: int) -> int:
        """Parameters one token passes through in a sparse block."""
        shared = 3 * dim * self.shared_ffn_dim + dim * self.shared_gate
        return self.n_experts * dim + self.top_k * 3 * dim * self.ffn_dim + shared


def dense_layers_from(n_layers: int, mlp_only_layers=(), decoder_sparse_step: int = 1,
                      first_k_dense_replace: int = 0) -> tuple:
    """The dense layers of a family's spelling: Qwen's ``mlp_only_layers`` and
    ``decoder_sparse_step`` (layer i is sparse when ``(i + 1) % step == 0``), DeepSeek's
    ``first_k_dense_replace`` (the first k layers dense)."""
    step = decoder_sparse_step or 1
    return tuple(i for i in range(n_layers)
                 if i in set(mlp_only_layers) or (i + 1) % step or i < first_k_dense_replace)
