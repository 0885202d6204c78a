"""LoRA's dropout on the adapters' input, the same at every layout.

PEFT computes ``B(A(dropout(x)))``: each element of the adapter's input is zeroed with
probability p and the rest scaled by 1 / (1 - p), a fresh mask per module and step. A
mask drawn from a random generator would depend on which rank holds which tokens and
features, so losses would change with the layout. Here the mask is a hash instead:
element (token, feature) of module ``name`` is kept when

    h = fmix(fmix(fmix(key_lo ^ salt_lo) ^ key_hi ^ salt_hi) ^ g(feature))  >=  p 2^32

with ``key`` the token's place in the run's token stream (its sample's position in the
sampler's stream times the window length, plus its index in the window:
``data.batch.stream_token_keys``), ``salt`` a 64-bit hash of ``train.seed`` and the
module's name, ``feature`` the global input column (a row-parallel rank adds its
offset), ``fmix`` MurmurHash3's 32-bit finaliser and ``g`` a per-column hash. The key
grows with the stream, so every step, epoch and micro-batch draws a new mask, and a
resumed run draws the one the straight run would have. The arithmetic is exact in int64
on any device (products split so that nothing exceeds 2^49).

The pipeline runtime makes the keys of the micro-batch whose action it runs current
(``data.batch.running``): a forward, its recomputation inside the backward, a W.
Validation batches carry none, so evaluation runs without dropout, as ``model.eval()``
does in PEFT.
"""

from __future__ import annotations

import torch

from parallel3d.data.batch import current_token_keys
from parallel3d.tensor_parallel.init import stream_key

_M32 = 0xFFFFFFFF
_GOLDEN = 0x9E3779B1
_CHUNK = 1 << 22  # elements hashed per pass: bounds the int64 temporaries (~32 MiB each)


def _mul32(h: torch.Tensor, c: int) -> torch.Tensor:
    """(h * c) mod 2^32 for h in [0, 2^32), without an int64 overflow."""
    lo = (h & 0xFFFF) * c  # < 2^48
    hi = (((h >> 16) * c) & 0xFFFF) << 16  # < 2^32
    return (lo + hi) & _M32


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's finaliser on values in [0, 2^32): a bijection that mixes every bit."""
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2AE35)
    return h ^ (h >> 16)


def dropout_salt(seed: int, name: str) -> int:
    """The 64-bit salt of module ``name``'s mask (the same name at every layout:
    ``layers.<global index>.self_attn.q_proj``)."""
    return stream_key(seed, f"lora_dropout/{name}") & ((1 << 64) - 1)


@torch.no_grad()
def keep_mask(keys: torch.Tensor, salt: int, p: float, features: int, offset: int = 0) -> torch.Tensor:
    """(*keys.shape, features) bool: which elements of an input whose tokens have
    ``keys`` (int64 stream positions) and whose columns are ``offset`` .. ``offset +
    features - 1`` of the module's input survive a dropout of rate ``p``."""
    k = keys.to(torch.int64)
    t = _fmix32((k & _M32) ^ (salt & _M32))
    t = _fmix32(t ^ ((k >> 32) & _M32) ^ ((salt >> 32) & _M32)).reshape(-1, 1)  # (T, 1)
    cols = torch.arange(offset + 1, offset + features + 1, device=keys.device, dtype=torch.int64)
    g = _fmix32(_mul32(cols & _M32, _GOLDEN)).unsqueeze(0)  # (1, F)
    threshold = min(int(round(p * 2.0**32)), 2**32)
    out = torch.empty(t.shape[0], features, dtype=torch.bool, device=keys.device)
    rows = max(1, _CHUNK // max(1, features))
    for i in range(0, t.shape[0], rows):
        out[i: i + rows] = _fmix32(t[i: i + rows] ^ g) >= threshold
    return out.reshape(*keys.shape, features)


def drop_input(layer, x: torch.Tensor, token_shard: tuple[int, int] | None = None,
               offset: int = 0) -> torch.Tensor:
    """``x`` (B, S, F) as ``layer``'s adapter reads it: dropped and rescaled while a
    micro-batch's keys are current and ``layer.lora_dropout`` > 0, else ``x`` itself.
    ``token_shard`` (rank, p): ``x`` holds that rank's run of the B*S tokens, viewed
    (B, S/p) (sequence parallelism's shard, ``tensor_parallel.comm``); ``offset``: ``x``'s first column in the module's
    whole input (a row-parallel rank's)."""
    p = getattr(layer, "lora_dropout", 0.0)
    keys = current_token_keys()
    if p == 0.0 or keys is None:
        return x
    if token_shard is not None:  # sequence parallelism: the rank's run of the B*S tokens
        rank, parts = token_shard
        n = keys.numel() // parts
        keys = keys.reshape(-1)[rank * n:(rank + 1) * n].view(keys.shape[0], keys.shape[1] // parts)
    if tuple(keys.shape) != tuple(x.shape[:-1]):
        raise ValueError(f"LoRA dropout: the micro-batch's token keys {tuple(keys.shape)} do not match the "
                         f"adapter's input {tuple(x.shape)}")
    return _Dropout.apply(x, keys.to(x.device), layer.lora_salt, p, offset)


class _Dropout(torch.autograd.Function):
    """x * mask / (1 - p), the mask hashed again in the backward from the keys it saves
    (B*S int64) rather than kept: what autograd holds for the adapter is A's input only."""

    @staticmethod
    def forward(ctx, x, keys, salt, p, offset):
        ctx.save_for_backward(keys)
        ctx.salt, ctx.p, ctx.offset = salt, p, offset
        return _apply_mask(x, keys, salt, p, offset)

    @staticmethod
    def backward(ctx, grad):
        (keys,) = ctx.saved_tensors
        return _apply_mask(grad, keys, ctx.salt, ctx.p, ctx.offset), None, None, None, None


def _apply_mask(x: torch.Tensor, keys: torch.Tensor, salt: int, p: float, offset: int) -> torch.Tensor:
    keep = keep_mask(keys, salt, p, x.shape[-1], offset)
    return torch.where(keep, x * (1.0 / (1.0 - p)), torch.zeros((), dtype=x.dtype, device=x.device))
