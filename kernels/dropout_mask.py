"""LoRA dropout's mask, hashed and applied in one pass, fused in Triton.

``out[t, j] = x[t, j] / (1 - p)`` where element (token t, column j) is kept, else 0. The
mask is no random draw: it is a hash of the token's key ``k_t`` (int64, its place in the
token stream), the column's place in the module's whole input ``c = offset + j`` and a
64-bit salt (the module's), so any split of the tokens or the columns draws the same
element's mask (``parallel3d/lora/dropout.py`` says why):

    t = f(f(lo(k_t) ^ lo(salt)) ^ hi(k_t) ^ hi(salt))
    kept  <=>  f(t ^ f((c + 1) * 0x9E3779B1 mod 2^32))  >=  threshold = round(p 2^32)

with ``f`` a 32-bit xor-shift-multiply finaliser (MurmurHash3's form; shifts 16, 15,
15 and multipliers 0x21f0aaad, 0x735a2d97, a low-bias pair from Wellons' hash
prospector, both below 2^31 so that the CPU's int64 products are exact in one step).
The reference (``masked_scale_ref``, the CPU path) computes it in int64 torch ops with
the products split so that nothing overflows, in place, in chunks of tokens small enough
for their temporaries to stay in cache (as fast as torch's own dropout on this CPU); the kernel in uint32 registers, one program per token and block of
columns, reading x once and writing out once, with no temporaries at all. The kept
value is x times 1 / (1 - p) in fp32, rounded once to x's dtype (as torch multiplies
a bf16 tensor by a Python float).

Dispatch (``_backend.use_triton``, as ``cross_entropy.py``): ``backend`` "auto" runs
Triton on CUDA tensors and the reference on CPU, "triton" forces the kernel (on CPU under
``TRITON_INTERPRET=1``), "torch" the reference.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
    _jit = triton.jit
except ImportError:  # pragma: no cover - the torch reference still works without triton
    triton = tl = None

    def _jit(fn):
        return fn

from ._backend import use_triton

__all__ = ["masked_scale", "masked_scale_ref", "keep_mask", "threshold_of"]

_M32 = 0xFFFFFFFF
_GOLDEN = 0x9E3779B1
_CHUNK = 1 << 16  # elements hashed per pass by the reference (measured 3-4x faster than 2^22 on CPU)


# ------------------------------------------------------------------------ the kernel
@_jit
def _fmix(h):
    h = h ^ (h >> 16)
    h = h * 0x21F0AAAD
    h = h ^ (h >> 15)
    h = h * 0x735A2D97
    return h ^ (h >> 15)


@_jit
def _masked_scale_kernel(x_ptr, keys_ptr, out_ptr, n_cols, col_offset, salt_lo, salt_hi, threshold, scale,
                         BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < n_cols
    key = tl.load(keys_ptr + row)
    lo = (key & 0xFFFFFFFF).to(tl.uint32)
    hi = ((key >> 32) & 0xFFFFFFFF).to(tl.uint32)
    t = _fmix(lo ^ salt_lo.to(tl.uint32, bitcast=True))
    t = _fmix(t ^ hi ^ salt_hi.to(tl.uint32, bitcast=True))
    g = _fmix((cols + col_offset + 1).to(tl.uint32) * 0x9E3779B1)
    keep = _fmix(t ^ g).to(tl.int64) >= threshold
    x = tl.load(x_ptr + row * n_cols + cols, mask=inside, other=0.0)
    y = tl.where(keep, x.to(tl.float32) * scale, 0.0)
    tl.store(out_ptr + row * n_cols + cols, y.to(x.dtype), mask=inside)


_INTERPRETED = type(_masked_scale_kernel).__name__ == "InterpretedFunction"


def _signed32(v: int) -> int:
    """A uint32 as the int32 with its bits (a kernel argument that stays 32-bit)."""
    return v - (1 << 32) if v >= 1 << 31 else v


def threshold_of(p: float) -> int:
    """A hash in [0, 2^32) at or above this is kept: a share 1 - p of them."""
    return min(int(round(p * 2.0**32)), _M32)


# ------------------------------------------------------------------------ launcher
def _use_triton(x: torch.Tensor, backend: str) -> bool:
    return use_triton(x, backend, _INTERPRETED)


def masked_scale(x: torch.Tensor, keys: torch.Tensor, salt: int, p: float, offset: int = 0,
                 backend: str = "auto") -> torch.Tensor:
    """x (..., F) with the elements the mask drops zeroed and the rest scaled by
    1 / (1 - p); ``keys`` (...) int64, one per token; ``offset``: x's first column in the
    module's whole input; ``salt`` a 64-bit int."""
    if tuple(keys.shape) != tuple(x.shape[:-1]) or keys.dtype != torch.int64:
        raise ValueError(f"keys must be int64 of shape {tuple(x.shape[:-1])}, got {keys.dtype} {tuple(keys.shape)}")
    if not 0 <= p < 1:
        raise ValueError(f"dropout p {p} outside [0, 1)")
    if not _use_triton(x, backend):
        return masked_scale_ref(x, keys, salt, p, offset)
    x, keys = x.contiguous(), keys.contiguous()
    out = torch.empty_like(x)
    n_cols = x.shape[-1]
    tokens = keys.numel()
    if tokens and n_cols:
        block = 64 if _INTERPRETED else min(1024, triton.next_power_of_2(n_cols))
        grid = (tokens, triton.cdiv(n_cols, block))
        _masked_scale_kernel[grid](x, keys, out, n_cols, offset, _signed32(salt & _M32),
                                   _signed32((salt >> 32) & _M32), threshold_of(p), 1.0 / (1.0 - p), BLOCK=block)
    return out


# ------------------------------------------------------------------------ reference
def _mul32(h: torch.Tensor, c: int) -> torch.Tensor:
    """(h * c) mod 2^32 for h in [0, 2^32), without an int64 overflow."""
    lo = (h & 0xFFFF) * c  # < 2^48
    hi = (((h >> 16) * c) & 0xFFFF) << 16  # < 2^32
    return (lo + hi) & _M32


def _mul32_(h: torch.Tensor, c: int) -> torch.Tensor:
    """:func:`_mul32` in place."""
    lo = (h & 0xFFFF).mul_(c)
    return h.bitwise_right_shift_(16).mul_(c).bitwise_and_(0xFFFF).bitwise_left_shift_(16).add_(lo).bitwise_and_(_M32)


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    """The finaliser on values in [0, 2^32): a bijection that mixes every bit."""
    return _fmix32_(h.clone())


def _fmix32_(h: torch.Tensor) -> torch.Tensor:
    """:func:`_fmix32` in place. Both multipliers are below 2^31, so h * c < 2^63: one
    exact int64 product, then its low 32 bits."""
    h.bitwise_xor_(h >> 16)
    h.mul_(0x21F0AAAD).bitwise_and_(_M32)
    h.bitwise_xor_(h >> 15)
    h.mul_(0x735A2D97).bitwise_and_(_M32)
    return h.bitwise_xor_(h >> 15)


def _hashes(keys: torch.Tensor, salt: int, features: int, offset: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The tokens' (T, 1) and the columns' (1, F) halves of the element hash."""
    k = keys.reshape(-1).to(torch.int64)
    t = _fmix32_((k & _M32) ^ (salt & _M32))
    t = _fmix32_(t.bitwise_xor_((k >> 32) & _M32).bitwise_xor_((salt >> 32) & _M32)).unsqueeze(1)
    cols = torch.arange(offset + 1, offset + features + 1, device=keys.device, dtype=torch.int64)
    return t, _fmix32_(_mul32_(cols & _M32, _GOLDEN)).unsqueeze(0)


def _rows(features: int) -> int:
    # tokens per pass: the pass's int64 temporaries (~512 KiB each) stay in a core's cache
    return max(1, _CHUNK // max(1, features))


@torch.no_grad()
def keep_mask(keys: torch.Tensor, salt: int, p: float, features: int, offset: int = 0) -> torch.Tensor:
    """(*keys.shape, features) bool: which elements of an input whose tokens have
    ``keys`` and whose columns are ``offset`` .. ``offset + features - 1`` survive."""
    t, g = _hashes(keys, salt, features, offset)
    threshold, rows = threshold_of(p), _rows(features)
    out = torch.empty(t.shape[0], features, dtype=torch.bool, device=keys.device)
    for i in range(0, t.shape[0], rows):
        torch.ge(_fmix32_(t[i: i + rows] ^ g), threshold, out=out[i: i + rows])
    return out.reshape(*keys.shape, features)


@torch.no_grad()
def masked_scale_ref(x: torch.Tensor, keys: torch.Tensor, salt: int, p: float, offset: int = 0) -> torch.Tensor:
    features = x.shape[-1]
    t, g = _hashes(keys, salt, features, offset)
    threshold, rows, scale = threshold_of(p), _rows(features), 1.0 / (1.0 - p)
    flat = x.reshape(-1, features)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)  # its own tensor, not a view
    rows_out = out.view(-1, features)
    for i in range(0, flat.shape[0], rows):
        torch.mul(flat[i: i + rows], scale, out=rows_out[i: i + rows])
        rows_out[i: i + rows].masked_fill_(_fmix32_(t[i: i + rows] ^ g) < threshold, 0)
    return out
