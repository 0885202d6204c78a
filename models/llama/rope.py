"""Rotary position embeddings (the "rotate half" layout of Hugging Face's Llama), with the
context-extension schemes of ``rope_scaling``."""

from __future__ import annotations

import math

import torch


def scale_rope_frequencies(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Rotary frequencies under a context-extension scheme (``rope_type`` of Hugging Face's
    ``rope_scaling``):

    * ``linear``: every frequency divided by ``factor`` (positions compressed).
    * ``llama3``: wavelengths ``2 pi / f`` longer than ``L / low_freq_factor`` are divided by
      ``factor``, those shorter than ``L / high_freq_factor`` kept, and those between
      interpolated with ``s = (L / wavelength - low) / (high - low)``:
      ``f' = (1 - s) f / factor + s f`` (``L`` = ``original_max_position_embeddings``).
    """
    kind = scaling.get("rope_type", "default")
    if kind == "default":
        return inv_freq
    factor = float(scaling["factor"])
    if kind == "linear":
        return inv_freq / factor
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    context = float(scaling["original_max_position_embeddings"])
    wavelength = 2 * math.pi / inv_freq
    smooth = (context / wavelength - low) / (high - low)
    scaled = torch.where(wavelength > context / low, inv_freq / factor, inv_freq)
    between = (wavelength >= context / high) & (wavelength <= context / low)
    return torch.where(between, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled)


def rope_tables(head_dim: int, seq_len: int, theta: float, device=None,
                scaling: tuple = ()) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables, each (seq_len, head_dim), in fp32."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim)
    inv_freq = scale_rope_frequencies(inv_freq, dict(scaling))
    t = torch.arange(seq_len, device=device, dtype=torch.float32)
    freqs = torch.outer(t, inv_freq)  # (S, hd/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (S, hd): the "rotate half" layout
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate (B, h, S, hd) by position: x*cos + rotate_half(x)*sin. cos, sin: (S, hd), or
    (B, 1, S, hd) for per-document positions."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x * cos + rotated * sin).to(x.dtype)
