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
offset), ``fmix`` a 32-bit xor-shift-multiply finaliser and ``g`` a per-column hash. The key
grows with the stream, so every step, epoch and micro-batch draws a new mask, and a
resumed run draws the one the straight run would have.

The pipeline runtime makes the keys of the micro-batch whose action it runs current
(``data.batch.running``): a forward, its recomputation inside the backward, a W.
Validation batches carry none, so evaluation runs without dropout, as ``model.eval()``
does in PEFT. The hash and its application are one pass, ``kernels/dropout_mask.py``
(Triton on CUDA, its torch reference on the CPU).
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from parallel3d.data.batch import current_token_keys
from parallel3d.kernels.dropout_mask import keep_mask, masked_scale
from parallel3d.tensor_parallel.init import stream_key


def dropout_salt(seed: int, name: str) -> int:
    """The 64-bit salt of module ``name``'s mask (the same name at every layout:
    ``layers.<global index>.self_attn.q_proj``)."""
    return stream_key(seed, f"lora_dropout/{name}") & ((1 << 64) - 1)


def drop_input(layer, x: torch.Tensor, token_shard: tuple[int, int] | None = None,
               offset: int = 0) -> torch.Tensor:
    """``x`` (B, S, F) as ``layer``'s adapter reads it: dropped and rescaled while a
    micro-batch's keys are current and ``layer.lora_dropout`` > 0, else ``x`` itself.
    ``token_shard`` (rank, p): ``x`` holds that rank's run of the B*S tokens, viewed
    (B, S/p) (sequence parallelism's shard, ``tensor_parallel.comm``); ``offset``:
    ``x``'s first column in the module's whole input (a row-parallel rank's)."""
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


def dropped_a(layer, x: torch.Tensor, **where) -> torch.Tensor:
    """``layer.lora_A`` of ``x`` dropped (:func:`drop_input`; ``where``: its
    ``token_shard`` / ``offset``). With dropout on, the pair runs under a checkpoint that
    keeps only its input (``x``, the base layer's own saved input) and rebuilds the dropped
    copy in the backward for A's weight gradient: dropout costs no activation memory
    beyond the micro-batch's keys, at one more (tokens, r) GEMM and mask pass a backward."""
    if getattr(layer, "lora_dropout", 0.0) == 0.0 or current_token_keys() is None:
        return layer.lora_A(x)
    return checkpoint(_dropped_a, layer, x, where, use_reentrant=False, preserve_rng_state=False)


def _dropped_a(layer, x: torch.Tensor, where: dict) -> torch.Tensor:
    return layer.lora_A(drop_input(layer, x, **where))


def _keeps_mask(x: torch.Tensor) -> bool:
    return not x.is_cuda


class _Dropout(torch.autograd.Function):
    """x * mask / (1 - p). On CUDA the backward hashes the mask again from the keys it
    saves (B*S int64; the fused kernel costs one read and one write); on the CPU, where
    the int64 hash costs more than a byte a element, it saves the boolean mask. Under
    :func:`dropped_a`'s checkpoint either lives only from the rebuild to this backward."""

    @staticmethod
    def forward(ctx, x, keys, salt, p, offset):
        ctx.salt, ctx.p, ctx.offset = salt, p, offset
        if not _keeps_mask(x):
            ctx.save_for_backward(keys)
            return masked_scale(x, keys, salt, p, offset)
        keep = keep_mask(keys, salt, p, x.shape[-1], offset)
        ctx.save_for_backward(keep)
        return (x * (1.0 / (1.0 - p))).masked_fill_(~keep, 0)

    @staticmethod
    def backward(ctx, grad):
        (saved,) = ctx.saved_tensors
        if saved.dtype == torch.bool:
            return (grad * (1.0 / (1.0 - ctx.p))).masked_fill_(~saved, 0), None, None, None, None
        return masked_scale(grad, saved, ctx.salt, ctx.p, ctx.offset), None, None, None, None
