"""A block of attention on CUDA through torch's SDPA kernels that return the log-sum-exp:
flash (``aten._scaled_dot_product_flash_attention``) and memory-efficient
(``aten._scaled_dot_product_efficient_attention``), forward and backward; ``blocks.py``
calls these for CUDA tensors.

Shapes as ``blocks.py``: q (B, H, cq, D); k, v (B, Hkv, ck, D); a block is causal (a
chunk, or a row of one, against itself: always square, ``cq == ck``) or full, and may
carry ``visible`` (B or 1, 1, cq, ck) bool, True where a key is visible (documents; the
causal triangle already folded in). Returns: forward (O (B, H, cq, D) fp32, lse (B, H,
cq) fp32, -inf and O = 0 on a row with no visible key); backward (dq, dk, dv) fp32 from
the whole row's output, lse and upstream gradient (the kernels compute the row's
``delta = rowsum(dO * O)`` themselves).

The kernels' differences, as torch 2.13 declares them (``torch/_meta_registrations.py``):

- flash: fp16 / bf16, head dim a multiple of 8 up to 256, no mask, grouped-query heads
  natively (dK/dV come back summed per kv-head); lse (B, H, cq) fp32. Its backward reads
  the lse as a contiguous (B, H, cq) array: a row slice of the merged lse is copied.
- efficient: fp32 / fp16 / bf16 (head dim a multiple of 16 bytes), an additive bias
  (the documents' mask: -inf where hidden, in q's dtype, rows aligned to 16 elements and
  broadcast to (B, H, cq, ck) as SDPA's own ``preprocess_mask`` does); no grouped-query
  heads (K/V repeated per query head, dK/dV summed back over each kv-head's heads in
  fp32); its lse is padded along the queries to a multiple of 32, (B, H, 32 ceil(cq/32)):
  the forward's is sliced, the backward is given the row's lse in that padded layout.
- ``is_causal``: SDPA's is top-left aligned, flash-attn's own bottom-right; they agree
  on a square block, the only kind called causal here (a full block needs no flag; the
  blocks after the diagonal are never computed, ``blocks.ring_plan``). Checked.

Neither kernel runs dropout here; their random-state arguments get placeholders of the
declared shape. No device synchronisation anywhere: the choice of kernel reads only
dtypes, shapes and the device's compute capability (host-side).
"""

from __future__ import annotations

import functools
import types

import torch

LSE_ALIGN = 32  # the efficient kernel's lse rows (``ceil(cq / 32) * 32``)
BIAS_ALIGN = 16  # elements a bias row is padded to (SDPA pads to 8; 16 satisfies both)

# The four kernels, looked up at call time; tests put look-alikes here (same signature, same
# return layout) to run this module on CPU.
OPS = types.SimpleNamespace(
    flash=lambda *a, **k: torch.ops.aten._scaled_dot_product_flash_attention(*a, **k),
    flash_backward=lambda *a, **k: torch.ops.aten._scaled_dot_product_flash_attention_backward(*a, **k),
    efficient=lambda *a, **k: torch.ops.aten._scaled_dot_product_efficient_attention(*a, **k),
    efficient_backward=lambda *a, **k: torch.ops.aten._scaled_dot_product_efficient_attention_backward(*a, **k),
)


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def capability(device: torch.device) -> tuple[int, int]:
    """The device's compute capability (host-side, cached)."""
    return _capability(device.index if device.index is not None else torch.cuda.current_device())


def kernel_for(q: torch.Tensor, masked: bool) -> str | None:
    """``"flash"``, ``"efficient"``, or None (no kernel fits: the explicit math) for a
    block of ``q``'s dtype and head dim, with or without a mask."""
    d, dt = q.shape[-1], q.dtype
    cap = capability(q.device)
    half = dt in (torch.float16, torch.bfloat16)
    if dt == torch.bfloat16 and cap < (8, 0):
        return None
    if half and not masked and d % 8 == 0 and d <= 256 and cap >= (8, 0) and not (
            cap in ((8, 6), (8, 9)) and d > 192):  # sm86/89: flash's backward stops at 192
        return "flash"
    if (half or dt == torch.float32) and d % (16 // q.element_size()) == 0:
        return "efficient"
    return None


def _check_square(q, k, causal: bool) -> None:
    if causal and q.shape[2] != k.shape[2]:  # top-left and bottom-right would differ
        raise AssertionError(f"a causal block must be square: {q.shape[2]} queries, {k.shape[2]} keys")


def _bias(visible: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """(B, H, cq, ck) additive bias in q's dtype from the bool mask, rows padded in memory."""
    ck = visible.shape[-1]
    buf = torch.zeros(*visible.shape[:-1], ck + (-ck % BIAS_ALIGN), dtype=q.dtype, device=q.device)
    bias = buf[..., :ck]
    bias.masked_fill_(~visible, float("-inf"))
    return bias.expand(q.shape[0], q.shape[1], q.shape[2], ck)


def _repeat_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """(B, Hkv, c, D) -> (B, H, c, D), kv-head ``h // G`` for query head ``h``."""
    return x if x.shape[1] == heads else x.repeat_interleave(heads // x.shape[1], dim=1)


def _sum_heads(g: torch.Tensor, hkv: int) -> torch.Tensor:
    """(B, H, c, D) -> (B, Hkv, c, D) fp32, each kv-head's G query heads summed."""
    g = g.float()
    return g if g.shape[1] == hkv else g.unflatten(1, (hkv, g.shape[1] // hkv)).sum(2)


def _rows_contiguous(*xs):
    """The kernels read q, k, v, out and dO with strides but want unit stride along the
    head dim (an upstream gradient can arrive transposed): copied where it is not."""
    return [x if x.stride(-1) == 1 else x.contiguous() for x in xs]


def _philox(device, dtype, shape):
    """Placeholders for a kernel's random state (no dropout: never read)."""
    return torch.empty(shape, dtype=dtype, device=device)


def block_forward(kernel: str, q, k, v, causal: bool, visible, scale: float):
    """(O (B, H, cq, D) fp32, lse (B, H, cq) fp32) of one block (module docstring)."""
    _check_square(q, k, causal)
    q, k, v = _rows_contiguous(q, k, v)
    cq = q.shape[2]
    if kernel == "flash":
        assert visible is None, "the flash kernel takes no mask"
        out, lse = OPS.flash(q, k, v, 0.0, causal, False, scale=scale)[:2]
        return out.float(), lse
    heads = q.shape[1]
    bias = None if visible is None else _bias(visible, q)
    out, lse = OPS.efficient(q, _repeat_heads(k, heads), _repeat_heads(v, heads), bias, True, 0.0,
                             causal and bias is None, scale=scale)[:2]
    out, lse = out.float(), lse[:, :, :cq]  # (B, H, 32 ceil(cq / 32)) -> (B, H, cq)
    if visible is not None:  # a row with no visible key: no mass in the merge, whatever the kernel gave
        empty = ~visible.any(-1)  # (B or 1, 1, cq)
        lse = lse.masked_fill(empty, float("-inf"))
        out = out.masked_fill(empty.unsqueeze(-1), 0.0)
    return out, lse


def block_backward(kernel: str, q, k, v, out, d_out, lse, causal: bool, visible, scale: float):
    """(dq (B, H, cq, D), dk, dv (B, Hkv, ck, D)) fp32 of one block from the whole row's
    ``out`` (q's dtype), ``d_out`` and ``lse`` (B, H, cq) fp32 (module docstring)."""
    _check_square(q, k, causal)
    q, k, v, out, d_out = _rows_contiguous(q, k, v, out, d_out)
    B, H, cq = q.shape[:3]
    if kernel == "flash":
        assert visible is None, "the flash kernel takes no mask"
        seed, offset = _philox(q.device, torch.uint64, (2,)), _philox(q.device, torch.uint64, ())
        dq, dk, dv = OPS.flash_backward(d_out, q, k, v, out, lse.contiguous(), None, None, cq, k.shape[2], 0.0,
                                        causal, seed, offset, scale=scale)
        return dq.float(), dk.float(), dv.float()
    lse_padded = torch.full((B, H, cq + (-cq % LSE_ALIGN)), float("inf"), device=q.device)
    lse_padded[:, :, :cq] = lse
    bias = None if visible is None else _bias(visible, q)
    seed, offset = _philox(q.device, torch.int64, ()), _philox(q.device, torch.int64, ())
    hkv = k.shape[1]
    dq, dk, dv = OPS.efficient_backward(d_out, q, _repeat_heads(k, H), _repeat_heads(v, H), bias, out, lse_padded,
                                        seed, offset, 0.0, [True, True, True, False], causal and bias is None,
                                        scale=scale)[:3]
    return dq.float(), _sum_heads(dk, hkv), _sum_heads(dv, hkv)
