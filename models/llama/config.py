"""The Llama family's configuration (plain Python, no torch): the shapes, the published
presets, and what follows from the shapes alone: parameter counts, a pipeline stage's
embedding and head costs, the reasons a tensor-parallel degree cannot split the model.
The planner, the dry run's checks and ``parallel3d plan`` read only this (``model.py``
re-exports it beside the model)."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

from ..moe.config import MoEConfig

ROPE_SCALINGS = ("default", "linear", "llama3")  # rope_scaling's rope_type values (rope.py)


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int = 2048
    dim: int = 128
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 2
    ffn_dim: int = 352
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    init_std: float = 0.02
    max_seq_len: int = 8192
    # q/k/v projections with a bias (Qwen2; Llama/Qwen3 attention_bias); the MLP never has one.
    qkv_bias: bool = False
    # o_proj with a bias too (attention_bias of Llama and Qwen3 covers q, k, v and o).
    o_bias: bool = False
    # RMSNorm over each head's q and k before the rotation (Qwen3), weights of head_dim.
    qk_norm: bool = False
    # The q and k norms span all heads at once, weights of n_heads * head_dim and
    # n_kv_heads * head_dim (OLMo, OLMoE).
    qk_norm_all_heads: bool = False
    # Width of one attention head when it is not dim / n_heads (Mistral-Nemo, Qwen3);
    # 0: dim / n_heads.
    head_dim_override: int = 0
    # Rotary frequency scaling as sorted (key, value) pairs of Hugging Face's
    # rope_scaling, e.g. (("factor", 8.0), ..., ("rope_type", "llama3")); () for none.
    rope_scaling: tuple = ()
    # Mixture-of-Experts on the layers not in moe.dense_layers (a dict is read as the
    # section, as JSON gives it back); None: every layer dense.
    moe: MoEConfig | None = None

    def __post_init__(self):
        if isinstance(self.moe, dict):
            object.__setattr__(self, "moe", MoEConfig(**self.moe))

    def is_sparse(self, layer: int) -> bool:
        return self.moe is not None and self.moe.is_sparse(layer)

    @property
    def head_dim(self) -> int:
        return self.head_dim_override or self.dim // self.n_heads

    def validate(self) -> None:
        if self.dim % self.n_heads and not self.head_dim_override:
            raise ValueError(f"model.dim {self.dim} is not divisible by model.n_heads {self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"model.n_heads {self.n_heads} is not divisible by model.n_kv_heads {self.n_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head dim {self.head_dim} must be even for rotary embeddings")
        kind = dict(self.rope_scaling).get("rope_type", "default")
        if kind not in ROPE_SCALINGS:
            raise ValueError(f"rope scaling '{kind}' is not supported: parallel3d implements "
                             f"{sorted(ROPE_SCALINGS)}")
        if self.moe is not None:
            self.moe.validate()
            outside = [i for i in self.moe.dense_layers if not 0 <= i < self.n_layers]
            if outside:
                raise ValueError(f"moe.dense_layers {outside} are not layers of model.n_layers {self.n_layers}")

    def num_params(self, include_embedding: bool = True) -> int:
        hd = self.head_dim
        attn = self.dim * (self.n_heads * hd) * 2 + self.dim * (self.n_kv_heads * hd) * 2
        if self.qkv_bias:
            attn += (self.n_heads + 2 * self.n_kv_heads) * hd
        qk_norms = (self.n_heads + self.n_kv_heads) * hd if self.qk_norm_all_heads else 2 * hd
        attn += self.dim * self.o_bias + qk_norms * self.qk_norm
        mlp = 3 * self.dim * self.ffn_dim
        per_layer = attn + mlp + 2 * self.dim
        emb = self.vocab_size * self.dim
        head = 0 if self.tie_embeddings else self.vocab_size * self.dim
        n = self.n_layers * per_layer + self.dim + head
        if self.moe is not None:
            sparse = sum(self.is_sparse(i) for i in range(self.n_layers))
            n += sparse * (self.moe.num_params(self.dim) - mlp)
        return n + emb if include_embedding else n


# Shapes of published models (Llama 3.2 1B, Llama 3.1 8B and 70B). Rope scaling of the
# long-context releases is not modelled; theta is that of the base models.
PRESETS: dict[str, LlamaConfig] = {
    "debug": LlamaConfig(),
    # the debug model with 8 experts (top 2) on every layer but the first, Qwen3-MoE style
    "debug-moe": LlamaConfig(moe=MoEConfig(n_experts=8, top_k=2, ffn_dim=96, norm_topk_prob=True,
                                           dense_layers=(0,), aux_loss_coef=0.01)),
    "1b": LlamaConfig(vocab_size=128256, dim=2048, n_layers=16, n_heads=32, n_kv_heads=8,
                      ffn_dim=8192, rope_theta=500000.0, tie_embeddings=True),
    "8b": LlamaConfig(vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                      ffn_dim=14336, rope_theta=500000.0),
    "70b": LlamaConfig(vocab_size=128256, dim=8192, n_layers=80, n_heads=64, n_kv_heads=8,
                       ffn_dim=28672, rope_theta=500000.0),
}


def config_from_preset(name: str, **overrides) -> LlamaConfig:
    """The preset ``name`` with any non-None field of ``overrides`` replaced."""
    if name not in PRESETS:
        raise ValueError(f"unknown model.preset '{name}': choose one of {sorted(PRESETS)}")
    known = {f.name for f in fields(LlamaConfig)}
    changes = {k: v for k, v in overrides.items() if v is not None and k in known}
    return replace(PRESETS[name], **changes)


def stage_costs(cfg: LlamaConfig) -> tuple[float, float]:
    """(embedding, head) cost in decoder layers, by GEMM FLOPs per token (the split rule
    of ``parallel3d.pipeline.partition``). The embedding is a gather: 0. The head is one
    ``dim x vocab`` GEMM against the layer's attention and MLP GEMMs. Tensor parallelism
    divides both alike, so the ratio holds for any tp."""
    hd = cfg.head_dim
    layer = 2 * cfg.dim * cfg.n_heads * hd + 2 * cfg.dim * cfg.n_kv_heads * hd + 3 * cfg.dim * cfg.ffn_dim
    return 0.0, cfg.vocab_size * cfg.dim / layer


def tensor_parallel_problems(cfg: LlamaConfig, tp: int) -> list[str]:
    """Every reason ``cfg`` cannot be split over tp, each naming the numbers."""
    problems = []
    if cfg.n_heads % tp:
        problems.append(f"model.n_heads {cfg.n_heads} is not divisible by parallel.tp {tp}: "
                        "choose a tp that divides the number of heads")
    if cfg.n_kv_heads % tp and tp % cfg.n_kv_heads:
        problems.append(
            f"model.n_kv_heads {cfg.n_kv_heads} and parallel.tp {tp}: one must divide the other "
            "(kv-heads are split when tp divides them, replicated when they divide tp)")
    if cfg.ffn_dim % tp and not all(cfg.is_sparse(i) for i in range(cfg.n_layers)):
        problems.append(f"model.ffn_dim {cfg.ffn_dim} is not divisible by parallel.tp {tp}: "
                        "choose a tp that divides the MLP width")
    if cfg.qk_norm and cfg.qk_norm_all_heads and cfg.n_kv_heads % tp:
        problems.append(f"q/k norms over all heads (OLMoE) split with the heads: parallel.tp {tp} must "
                        f"divide model.n_kv_heads {cfg.n_kv_heads}")
    return problems
