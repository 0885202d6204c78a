"""FLOPs of a training step: one count, shared by the planner and the trainer's MFU.

Convention (that of Megatron-LM, Narayanan et al. 2021, eq. 3, and of PaLM's MFU,
Chowdhery et al. 2022, appendix B): count the multiply-adds of every matrix product as 2
FLOPs, nothing else (norms, softmax, rotary and element-wise ops are left out), and count
attention over the *full* S x S score matrix even though the model is causal. Published
MFU figures (Megatron, PaLM, Llama 3, NeMo's "model TFLOP/s") use this full count, so
figures computed here compare with theirs.

Per token, with ``d = dim``, ``h * hd = d`` (query width), ``kv = n_kv_heads * hd``,
``f = ffn_dim``, ``L`` layers, vocabulary ``V`` and sequence length ``S``::

    matmul weights per layer  W = 2 d^2 (q, o) + 2 d kv (k, v) + 3 d f (gate, up, down)
    forward                   2 (L W + V d)          the projections and the output head
                            + 4 L S d               scores Q K^T and the product with V
    training (model FLOPs)    3 x forward           backward = 2 x forward

The embedding lookup is a gather, not a product: it is not counted, whether or not the
embedding is tied to the output head (the head's product always is).

Hardware FLOPs add what recomputation re-runs: with ``full`` recomputation every layer's
forward runs twice (the head does not: it is outside the recomputed layers); with
``selective`` the attention products are re-run (the matmul outputs are kept, see
``train.recompute``). MFU uses model FLOPs; the time a step takes follows hardware FLOPs.
"""

from __future__ import annotations

from parallel3d.config import Recompute


def layer_matmul_params(cfg) -> int:
    """Weights of one decoder layer that take part in a matrix product."""
    kv = cfg.n_kv_heads * cfg.head_dim
    q = cfg.n_heads * cfg.head_dim
    return 2 * cfg.dim * q + 2 * cfg.dim * kv + 3 * cfg.dim * cfg.ffn_dim


def attention_flops_per_token(cfg, seq_len: int) -> int:
    """Forward FLOPs of one layer's attention products (scores and their product with V)."""
    return 4 * seq_len * cfg.n_heads * cfg.head_dim


def layer_forward_flops_per_token(cfg, seq_len: int) -> int:
    """Forward FLOPs of one decoder layer per token: projections plus full attention."""
    return 2 * layer_matmul_params(cfg) + attention_flops_per_token(cfg, seq_len)


def head_forward_flops_per_token(cfg) -> int:
    """Forward FLOPs of the output head per token (``V x d`` product)."""
    return 2 * cfg.vocab_size * cfg.dim


def model_flops_per_token(cfg, seq_len: int) -> int:
    """Training FLOPs (forward + backward) per token, without recomputation."""
    forward = cfg.n_layers * layer_forward_flops_per_token(cfg, seq_len) + head_forward_flops_per_token(cfg)
    return 3 * forward


# What each ``train.recompute`` mode re-runs of a layer in the backward pass, per token.
RECOMPUTE_FLOPS = {"none": lambda cfg, seq_len: 0, "full": layer_forward_flops_per_token,
                   "selective": attention_flops_per_token}


def recompute_flops_per_token(cfg, seq_len: int, recompute: Recompute) -> int:
    """FLOPs re-run in the backward pass per token by ``recompute``."""
    return cfg.n_layers * RECOMPUTE_FLOPS[recompute](cfg, seq_len)


def hardware_flops_per_token(cfg, seq_len: int, recompute: Recompute = "none") -> int:
    """Training FLOPs per token that the GPUs actually execute (recomputation included)."""
    return model_flops_per_token(cfg, seq_len) + recompute_flops_per_token(cfg, seq_len, recompute)


def mfu(tokens_per_s: float, flops_per_token: float, n_gpus: int, peak_flops: float) -> float:
    """Model FLOPs utilization: achieved model FLOP/s over the GPUs' peak."""
    return tokens_per_s * flops_per_token / (n_gpus * peak_flops)
