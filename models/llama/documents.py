"""Attention inside each document of a packed window: the block-diagonal causal mask the
model hands to SDPA, and torch's variable-length flash kernel (``torch.nn.attention.varlen``,
torch >= 2.9, CUDA only) over the documents' spans where the device runs it.

The kernel's module is imported on first use on a GPU: it pulls in torch._dynamo (1.7 s and
140 MiB of resident memory), which a CPU run, ``convert`` and ``plan`` never need.
"""

from __future__ import annotations

import functools

import torch


@functools.cache
def _varlen_kernel():
    """torch's ``varlen_attn``, or None on a torch without it (packed documents then take
    the mask path)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:  # pragma: no cover - older torch
        return None
    return varlen_attn


def document_mask(positions: torch.Tensor) -> torch.Tensor:
    """Block-diagonal causal mask (B, 1, S, S), True where query i may attend to key j:
    ``j <= i`` and both in the same document. A document starts wherever its position is
    0 (positions (B, S) restart at each document of a packed window)."""
    doc = (positions == 0).cumsum(-1)  # (B, S): document number of each token
    same = doc.unsqueeze(-1) == doc.unsqueeze(-2)  # (B, S, S)
    S = positions.shape[-1]
    causal = torch.ones(S, S, dtype=torch.bool, device=positions.device).tril()
    return (same & causal).unsqueeze(1)


def varlen_runs_on(x: torch.Tensor, head_dim: int) -> bool:
    """Whether torch's variable-length flash kernel takes ``x``: CUDA, fp16 / bf16, an
    Ampere or newer GPU, a head width of at most 256 (flash attention's limits)."""
    return (x.is_cuda and x.dtype in (torch.float16, torch.bfloat16) and head_dim <= 256
            and torch.cuda.get_device_capability(x.device)[0] >= 8 and _varlen_kernel() is not None)


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                     max_len: int, gqa: bool) -> torch.Tensor:
    """Causal attention inside each document of the flattened tokens: q (T, h, hd), k and
    v (T, kvh, hd), document d spans tokens ``cu_seqlens[d] .. cu_seqlens[d+1]-1`` (int32,
    (N+1,), on q's device), ``max_len`` the longest (a host int: no device read). Returns
    (T, h, hd). The same attention as :func:`document_mask`'s on the (B, S) window, without
    the (B, S, S) mask and the masked-out products."""
    return _varlen_kernel()(q, k, v, cu_seqlens, cu_seqlens, max_len, max_len,
                        window_size=(-1, 0), enable_gqa=gqa)  # (-1, 0): causal
