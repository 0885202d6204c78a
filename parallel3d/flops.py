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

Mixture-of-Experts (``cfg.moe``): a sparse layer's MLP term counts the *active* weights, the
ones a token passes through (Megatron-Core's and DeepSeek's MFU convention), with ``E``
experts, ``k`` chosen per token, ``f_e`` an expert's width and ``f_s`` the shared experts'::

    sparse MLP weights  E d (router) + k 3 d f_e (routed) + 3 d f_s (+ d, the shared gate)

so ``6 x active parameters per token + attention``; the dense layers of the model
(``moe.dense_layers``) keep ``3 d f``.

Hardware FLOPs add what recomputation re-runs: with ``full`` recomputation every layer's
forward runs twice (the head does not: it is outside the recomputed layers); with
``selective`` the attention products are re-run (the matmul outputs are kept, see
``train.recompute``). MFU uses model FLOPs; the time a step takes follows hardware FLOPs.
"""

from __future__ import annotations

from parallel3d.config import Recompute


def attention_matmul_params(cfg) -> int:
    """Weights of one decoder layer's attention projections (q, k, v, o)."""
    kv = cfg.n_kv_heads * cfg.head_dim
    q = cfg.n_heads * cfg.head_dim
    return 2 * cfg.dim * q + 2 * cfg.dim * kv


def mlp_matmul_params(cfg, sparse: bool = False) -> int:
    """Weights one token's MLP multiplies by: the dense SwiGLU, or in a sparse layer the
    active ones (router, ``top_k`` routed experts, shared experts and their gate)."""
    if not sparse:
        return 3 * cfg.dim * cfg.ffn_dim
    return cfg.moe.active_params(cfg.dim)


def layer_matmul_params(cfg, sparse: bool = False) -> int:
    """Weights of one decoder layer that take part in a token's matrix products."""
    return attention_matmul_params(cfg) + mlp_matmul_params(cfg, sparse)


def sparse_layers(cfg) -> int:
    """Decoder layers whose MLP is a Mixture-of-Experts block (0 for a dense model)."""
    return sum(cfg.is_sparse(i) for i in range(cfg.n_layers)) if getattr(cfg, "moe", None) else 0


def attention_flops_per_token(cfg, seq_len: int) -> int:
    """Forward FLOPs of one layer's attention products (scores and their product with V)."""
    return 4 * seq_len * cfg.n_heads * cfg.head_dim


def layer_forward_flops_per_token(cfg, seq_len: int, sparse: bool = False) -> int:
    """Forward FLOPs of one decoder layer per token: projections plus full attention
    (``sparse``: a Mixture-of-Experts layer, its active weights)."""
    return 2 * layer_matmul_params(cfg, sparse) + attention_flops_per_token(cfg, seq_len)


def head_forward_flops_per_token(cfg) -> int:
    """Forward FLOPs of the output head per token (``V x d`` product)."""
    return 2 * cfg.vocab_size * cfg.dim


def model_flops_per_token(cfg, seq_len: int) -> int:
    """Training FLOPs (forward + backward) per token, without recomputation."""
    n_sparse = sparse_layers(cfg)
    forward = ((cfg.n_layers - n_sparse) * layer_forward_flops_per_token(cfg, seq_len)
               + n_sparse * (layer_forward_flops_per_token(cfg, seq_len, sparse=True) if n_sparse else 0)
               + head_forward_flops_per_token(cfg))
    return 3 * forward


# What each ``train.recompute`` mode re-runs of a layer in the backward pass, per token.
RECOMPUTE_FLOPS = {"none": lambda cfg, seq_len, sparse=False: 0, "full": layer_forward_flops_per_token,
                   "selective": lambda cfg, seq_len, sparse=False: attention_flops_per_token(cfg, seq_len)}


def recompute_flops_per_token(cfg, seq_len: int, recompute: Recompute) -> int:
    """FLOPs re-run in the backward pass per token by ``recompute``."""
    redo = RECOMPUTE_FLOPS[recompute]
    n_sparse = sparse_layers(cfg)
    return ((cfg.n_layers - n_sparse) * redo(cfg, seq_len)
            + (n_sparse * redo(cfg, seq_len, sparse=True) if n_sparse else 0))


def hardware_flops_per_token(cfg, seq_len: int, recompute: Recompute = "none") -> int:
    """Training FLOPs per token that the GPUs actually execute (recomputation included)."""
    return model_flops_per_token(cfg, seq_len) + recompute_flops_per_token(cfg, seq_len, recompute)


def mfu(tokens_per_s: float, flops_per_token: float, n_gpus: int, peak_flops: float) -> float:
    """Model FLOPs utilization: achieved model FLOP/s over the GPUs' peak."""
    return tokens_per_s * flops_per_token / (n_gpus * peak_flops)
