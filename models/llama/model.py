"""A Llama-family decoder as plain single-device PyTorch.

RMSNorm, rotary position embeddings (configurable theta, the "rotate half" layout used by
Hugging Face), grouped-query attention through ``F.scaled_dot_product_attention`` (flash
kernels on GPU for one causal sequence; packed documents either go through torch's
variable-length flash kernel, ``torch.nn.attention.varlen``, when the caller gives their
spans and the device runs it, or pass a block-diagonal boolean mask to SDPA, which runs
it with its memory-efficient kernel on GPU and its math kernel on CPU), a SwiGLU MLP, tied or untied
embeddings; Qwen3's q/k norms (OLMoE's over all heads at once), attention biases and a head
width other than dim / heads. With ``cfg.moe`` the MLP of the sparse layers is a
Mixture-of-Experts block (``models/moe``: Qwen2/3-MoE, Mixtral, OLMoE, DeepSeek-style
routing); ``Llama.moe_stats`` and ``Llama.aux_loss`` read what its routers saw.

This file imports nothing from parallel3d (only ``documents.py`` beside it, the attention
over packed documents, ``rope.py``, the rotary tables, and the MoE block of ``models/moe``): ``parallelize.py`` beside it swaps in
tensor-parallel layers and cuts pipeline stages. To make that possible without touching
this code:

* attention infers its local head counts from the projection shapes, so a tensor-parallel
  q/k/v projection that outputs ``n_heads/tp`` heads just works;
* layers live in an ``nn.ModuleDict`` keyed by their global index, and ``tok_embeddings``,
  ``norm`` and ``output`` may be set to None; parameter names therefore stay those of the
  unsplit model whatever the pipeline split.

Parameter names follow Hugging Face's ``LlamaForCausalLM`` without the ``model.`` prefix
(``embed_tokens``, ``layers.3.self_attn.q_proj``, ``lm_head``), so conversion is a rename.
"""

from __future__ import annotations

import functools
import math
import torch
import torch.nn.functional as F
from torch import nn

from ..moe import MoEBlock, RouterStats, load_balancing_loss
from .config import PRESETS, ROPE_SCALINGS, LlamaConfig, config_from_preset  # noqa: F401 - re-exported
from .documents import document_mask, varlen_attention, varlen_runs_on
from .rope import apply_rope, rope_tables, scale_rope_frequencies  # noqa: F401 - re-exported


class _RMSNormFn(torch.autograd.Function):
    """``y = w * (x * r).to(x.dtype)`` with ``r = 1/sqrt(mean(x^2) + eps)`` in fp32.

    Keeps only ``x`` (in its own dtype) and ``r`` (one fp32 per row) for the backward,
    where the composition of torch ops would keep fp32 copies of ``x`` and of the
    normalized ``x`` as well: 2 bytes per element under bf16 instead of 10. Backward,
    with ``n = x r``, ``g = (dy w)`` in fp32::

        dw = sum over rows of dy * n        dx = r * (g - n * mean(g * n))
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        x32 = x.to(torch.promote_types(x.dtype, torch.float32))  # fp32 at least
        rstd = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, rstd)
        return weight * (x32 * rstd).to(x.dtype)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x, weight, rstd = ctx.saved_tensors
        n32 = x.to(rstd.dtype) * rstd
        dw = None
        if ctx.needs_input_grad[1]:
            dw = (dy * n32.to(x.dtype)).reshape(-1, x.shape[-1]).sum(0).to(weight.dtype)
        g = (dy * weight).to(rstd.dtype)
        dx = rstd * (g - n32 * (g * n32).mean(-1, keepdim=True))
        return dx.to(x.dtype), dw, None


class RMSNorm(nn.Module):
    """``y = x / sqrt(mean(x^2) + eps) * w``, computed in fp32 and cast back; keeps only its
    input for the backward (:class:`_RMSNormFn`)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _RMSNormFn.apply(x, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        hd = cfg.head_dim
        self.head_dim = hd
        self.q_proj = nn.Linear(cfg.dim, cfg.n_heads * hd, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.dim, cfg.n_kv_heads * hd, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.dim, cfg.n_kv_heads * hd, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.n_heads * hd, cfg.dim, bias=cfg.o_bias)
        # Qwen3: an RMSNorm over each head's q and k (one weight of head_dim for all heads);
        # OLMoE: over the whole projection (weights of its width), before the heads split.
        self.qk_norm_all_heads = cfg.qk_norm_all_heads
        q_width, k_width = (cfg.n_heads * hd, cfg.n_kv_heads * hd) if cfg.qk_norm_all_heads else (hd, hd)
        self.q_norm = RMSNorm(q_width, cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(k_width, cfg.norm_eps) if cfg.qk_norm else None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | tuple | None = None) -> torch.Tensor:
        """``mask``: None, one causal sequence per row; (B, 1, S, S) bool, attend where True
        (packed documents); or ``(cu_seqlens, max_len)``, the documents' spans over the
        B*S flattened tokens (:func:`varlen_attention`); or a callable ``fn(q, k, v)``
        returning (B, h, S, hd), which attends in place of SDPA (``Llama.attention_fn``)."""
        B, S, _ = x.shape
        hd = self.head_dim
        # Head counts come from the projection widths: under tensor parallelism these are
        # the local heads of this rank.
        q, k = self.q_proj(x), self.k_proj(x)  # (B, S, h * hd), (B, S, kvh * hd)
        if self.q_norm is not None and self.qk_norm_all_heads:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.view(B, S, -1, hd), k.view(B, S, -1, hd)  # (B, S, h, hd), (B, S, kvh, hd)
        if self.q_norm is not None and not self.qk_norm_all_heads:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)  # (B, h, S, hd), (B, kvh, S, hd)
        v = self.v_proj(x).view(B, S, -1, hd).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        gqa = q.shape[1] != k.shape[1]
        if callable(mask):  # a replacement attention over the whole window (Llama.attention_fn)
            out = mask(q, k, v)  # (B, h, S, hd)
            return self.o_proj(out.transpose(1, 2).reshape(B, S, -1))
        if isinstance(mask, tuple):
            flat = [t.transpose(1, 2).reshape(B * S, t.shape[1], hd) for t in (q, k, v)]  # (B*S, h, hd)
            out = varlen_attention(*flat, *mask, gqa)
            return self.o_proj(out.reshape(B, S, -1))
        if mask is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
        return self.o_proj(out.transpose(1, 2).reshape(B, S, -1))


class _SwiGLUFn(torch.autograd.Function):
    """``silu(gate) * up``, keeping only ``gate`` and ``up`` for the backward (``silu(gate)``
    is recomputed there, one element-wise pass) where torch's ops would also keep
    ``silu(gate)``. With ``s = sigmoid(gate)``::

        d_up = dy * gate * s        d_gate = dy * up * s * (1 + gate * (1 - s))
    """

    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        gate, up = ctx.saved_tensors
        d_up = dy * F.silu(gate)
        # silu's own backward kernel: one fused pass for the derivative above (the same
        # formula in separate element-wise ops costs ~2.4x the time on CPU)
        d_gate = torch.ops.aten.silu_backward(dy * up, gate)
        return d_gate, d_up


class MLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.up_proj = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.down_proj = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(_SwiGLUFn.apply(self.gate_proj(x), self.up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig, index: int = 0):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.mlp = MoEBlock(cfg.moe, cfg.dim) if cfg.is_sparse(index) else MLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | tuple | None = None) -> torch.Tensor:
        h = x + self.self_attn(self.input_layernorm(x), cos, sin, mask)
        return h + self.mlp(self.post_attention_layernorm(h))


class Llama(nn.Module):
    """Causal LM: tokens (B, S) -> logits (B, S, vocab).

    ``forward`` also accepts hidden states (B, S, dim) when ``embed_tokens`` is None (a
    later pipeline stage) and returns hidden states when ``lm_head`` is None.

    ``positions`` (B, S), the position of each token within its document, packs several
    documents in one window: the rotation restarts at each document (a token at position
    0 starts one) and attention stays inside it (:func:`document_mask`). None: one causal
    sequence at positions 0 .. S-1. Positions cover the whole sequence, also under
    sequence parallelism (attention sees all S positions there). ``cu_seqlens`` and
    ``max_doc_len``, the same documents as spans of the B*S flattened tokens (the data
    loader computes them on the host), let a GPU that runs torch's variable-length flash
    kernel use it instead of the mask (:func:`varlen_runs_on`).
    """

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        cfg.validate()
        self.cfg = cfg
        self.embed_tokens: nn.Module | None = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleDict({str(i): DecoderLayer(cfg, i) for i in range(cfg.n_layers)})
        self.norm: nn.Module | None = RMSNorm(cfg.dim, cfg.norm_eps)
        self.lm_head: nn.Module | None = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        # Under sequence parallelism the hidden states hold 1/sequence_shards of the
        # positions (set by parallelize); the rotary tables still cover the whole sequence.
        self.sequence_shards = 1
        # Attention in place of SDPA / varlen, called fn(q, k, v, positions) with q (B, h, S, hd),
        # k and v (B, kvh, S, hd) after rope and this forward's ``positions`` (or None); it
        # masks by the positions itself. Context parallelism sets it (parallelize.py): the
        # window then holds this rank's chunks of a longer sequence.
        self.attention_fn = None
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Normal(0, init_std) for matrices and embeddings (output projections scaled by
        1/sqrt(2 * n_layers), as in GPT-2), ones for norms, zeros for biases.
        Deterministic given the torch seed, in module order."""
        std = self.cfg.init_std
        out_std = std / math.sqrt(2 * self.cfg.n_layers)
        for name, p in self.named_parameters():
            if name.endswith(".bias"):
                p.zero_()
            elif p.ndim == 1:
                p.fill_(1.0)
            elif name.endswith(("o_proj.weight", "down_proj.weight")):
                p.normal_(0.0, out_std)
            else:
                p.normal_(0.0, std)

    def moe_stats(self) -> list[RouterStats]:
        """The routing statistics of this module's sparse layers in its last forward, in
        layer order (a pipeline stage: its own layers)."""
        return [layer.mlp.last_stats for layer in self.layers.values()
                if isinstance(layer.mlp, MoEBlock) and layer.mlp.last_stats is not None]

    def aux_loss(self, pooled: bool = True) -> torch.Tensor:
        """The load-balancing loss of the last forward, without its coefficient
        (``cfg.moe.aux_loss_coef``); pooled over layers as transformers computes it
        (:func:`load_balancing_loss`). 0 for a dense model."""
        if self.cfg.moe is None:
            return torch.zeros(())
        return load_balancing_loss(self.moe_stats(), self.cfg.moe.n_experts, pooled)

    def rope(self, seq_len: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        return rope_tables(self.cfg.head_dim, seq_len, self.cfg.rope_theta, device, self.cfg.rope_scaling)

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None,
                cu_seqlens: torch.Tensor | None = None, max_doc_len: int | None = None) -> torch.Tensor:
        h = self.embed_tokens(x) if self.embed_tokens is not None else x  # (B, S, dim)
        cos, sin = self.rope(h.shape[1] * self.sequence_shards, h.device)
        cos, sin = cos.to(h.dtype), sin.to(h.dtype)  # (S, hd)
        mask = None
        if positions is not None:
            cos, sin = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)  # (B, 1, S, hd)
        if self.attention_fn is not None:
            mask = functools.partial(self.attention_fn, positions=positions)
        elif positions is not None:
            if cu_seqlens is not None and varlen_runs_on(h, self.cfg.head_dim):
                mask = (cu_seqlens, max_doc_len)
            else:
                mask = document_mask(positions)
        for layer in self.layers.values():
            h = layer(h, cos, sin, mask)
        if self.norm is not None:
            h = self.norm(h)
        if self.lm_head is not None:
            h = self.lm_head(h)  # (B, S, vocab)
        return h
