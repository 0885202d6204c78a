"""Pure-torch look-alikes of torch's CUDA SDPA kernels that return the log-sum-exp, for
running ``parallel3d.context_parallel.cuda_blocks`` on CPU: the signatures of
``aten._scaled_dot_product_flash_attention`` / ``_efficient_attention`` and their
backwards in torch 2.13, and their return layouts (``torch/_meta_registrations.py``),
with what the real kernels demand checked and their awkward parts reproduced:

- both: unit stride along the head dim of every input (checked);
- flash: grouped-query heads natively; ``is_causal`` bottom-right aligned (flash-attn's:
  query ``i`` sees keys ``j <= i + Sk - Sq``); the backward reads the lse as a raw
  contiguous (B, H, Sq) array (a strided one is refused here).
- efficient: no grouped-query heads (refused); ``is_causal`` top-left aligned (SDPA's);
  the bias exactly (B, H, Sq, Sk) in q's dtype, rows aligned to 8 elements, last dim
  contiguous (SDPA's ``preprocess_mask``); its lse padded to (B, H, 32 ceil(Sq / 32)) with
  NaN in the padding (a caller that does not slice it gets NaN), the backward requiring
  that layout; a row with no visible key gives NaN output (0 / 0).

The math is fp32 on the given values (out and the gradients cast to the inputs' dtype):
``S = s q k^T (+ bias)``, ``lse = logsumexp S``, ``O = exp(S - lse) V``; backward from the
given ``O``, ``lse`` and ``dO``: ``P = exp(S - lse)``, ``delta = rowsum(dO O)``,
``dS = P (dO V^T - delta)``, ``dQ = s dS K``, ``dK = s dS^T Q``, ``dV = P^T dO``.
"""

from __future__ import annotations

import math
import types

import torch


def _scores(q, k, scale, causal_shift, bias):
    """fp32 (B, H, Sq, Sk) scores, -inf where hidden; ``causal_shift`` None (no causal
    mask) or the shift of the diagonal (0 top-left, Sk - Sq bottom-right)."""
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if causal_shift is not None:
        i = torch.arange(q.shape[2]).unsqueeze(-1)
        j = torch.arange(k.shape[2])
        s = s.masked_fill(j > i + causal_shift, float("-inf"))
    if bias is not None:
        s = s + bias.float()
    return s


def _expand(x, heads):
    return x.repeat_interleave(heads // x.shape[1], dim=1)


def _shrink(g, hkv):
    return g.unflatten(1, (hkv, g.shape[1] // hkv)).sum(2)


def _forward(q, k, v, scale, shift, bias):
    s = _scores(q, _expand(k, q.shape[1]), scale, shift, bias)
    lse = torch.logsumexp(s, -1)
    out = torch.matmul(torch.exp(s - lse.unsqueeze(-1)), _expand(v, q.shape[1]).float())  # NaN on empty rows
    return out, lse


def _backward(d_out, q, k, v, out, lse, scale, shift, bias):
    H, hkv = q.shape[1], k.shape[1]
    ke, ve = _expand(k, H).float(), _expand(v, H).float()
    p = torch.exp(_scores(q, ke, scale, shift, bias) - lse.unsqueeze(-1))
    do = d_out.float()
    delta = (do * out.float()).sum(-1, keepdim=True)
    ds = p * (torch.matmul(do, ve.transpose(-1, -2)) - delta)
    dq = torch.matmul(ds, ke) * scale
    dk = _shrink(torch.matmul(ds.transpose(-1, -2), q.float()) * scale, hkv)
    dv = _shrink(torch.matmul(p.transpose(-1, -2), do), hkv)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _unit_stride(*xs):
    assert all(x.stride(-1) == 1 for x in xs), "the kernels want unit stride along the head dim"


def _scale(q, scale):
    return q.shape[-1] ** -0.5 if scale is None else scale


def flash(query, key, value, dropout_p=0.0, is_causal=False, return_debug_mask=False, *, scale=None):
    assert dropout_p == 0.0 and not return_debug_mask
    _unit_stride(query, key, value)
    assert query.shape[1] % key.shape[1] == 0 and key.shape == value.shape
    shift = key.shape[2] - query.shape[2] if is_causal else None
    out, lse = _forward(query, key, value, _scale(query, scale), shift, None)
    seed = torch.zeros(2, dtype=torch.uint64)
    return (out.to(query.dtype), lse, None, None, query.shape[2], key.shape[2], seed,
            torch.zeros((), dtype=torch.uint64), torch.empty(0, dtype=query.dtype))


def flash_backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k,
                   dropout_p, is_causal, philox_seed, philox_offset, *, scale=None):
    assert dropout_p == 0.0 and cum_seq_q is None and cum_seq_k is None
    _unit_stride(grad_out, query, key, value, out)
    assert (max_q, max_k) == (query.shape[2], key.shape[2])
    assert logsumexp.dtype == torch.float32 and logsumexp.shape == query.shape[:3], logsumexp.shape
    assert logsumexp.is_contiguous(), "flash's backward reads the lse as a contiguous array"
    shift = key.shape[2] - query.shape[2] if is_causal else None
    return _backward(grad_out, query, key, value, out, logsumexp, _scale(query, scale), shift, None)


def _check_bias(bias, query, key):
    if bias is None:
        return
    assert bias.dtype == query.dtype, (bias.dtype, query.dtype)
    assert bias.shape == (*query.shape[:3], key.shape[2]), (bias.shape, query.shape, key.shape)
    assert bias.stride(-1) == 1 and all(st % 8 == 0 for st in bias.stride()[:-1]), bias.stride()


def efficient(query, key, value, attn_bias, compute_log_sumexp, dropout_p=0.0, is_causal=False, *, scale=None):
    assert compute_log_sumexp and dropout_p == 0.0
    _unit_stride(query, key, value)
    assert key.shape[1] == query.shape[1] == value.shape[1], "the efficient kernel has no grouped-query heads"
    _check_bias(attn_bias, query, key)
    out, lse = _forward(query, key, value, _scale(query, scale), 0 if is_causal else None, attn_bias)
    B, H, M = lse.shape
    padded = torch.full((B, H, math.ceil(M / 32) * 32), float("nan"))
    padded[:, :, :M] = lse
    out = out.to(query.dtype).transpose(1, 2).contiguous().transpose(1, 2)  # BMHK in memory
    return out, padded, torch.zeros((), dtype=torch.int64), torch.zeros((), dtype=torch.int64)


def efficient_backward(grad_out_, query, key, value, attn_bias, out, logsumexp, philox_seed, philox_offset,
                       dropout_p, grad_input_mask, is_causal=False, *, scale=None):
    assert dropout_p == 0.0 and list(grad_input_mask) == [True, True, True, False]
    _unit_stride(grad_out_, query, key, value, out)
    assert key.shape[1] == query.shape[1], "the efficient kernel has no grouped-query heads"
    _check_bias(attn_bias, query, key)
    M = query.shape[2]
    assert logsumexp.shape == (*query.shape[:2], math.ceil(M / 32) * 32) and logsumexp.is_contiguous(), \
        "the efficient kernel's backward takes its forward's padded lse"
    grads = _backward(grad_out_, query, key, value, out, logsumexp[:, :, :M], _scale(query, scale),
                      0 if is_causal else None, attn_bias)
    return (*grads, None)


OPS = types.SimpleNamespace(flash=flash, flash_backward=flash_backward, efficient=efficient,
                            efficient_backward=efficient_backward)
