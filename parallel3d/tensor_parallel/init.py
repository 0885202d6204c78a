"""Initialising shards directly, without the full tensor existing anywhere.

The trainer builds the whole model on every rank and keeps its slices, which is simple
and exact but needs the full model in memory. For a model too big for that: build it on
the meta device, apply tensor parallelism (shapes only), allocate this rank's shards
(``to_empty``) and fill each with :func:`counter_normal_`.

Every element of the full tensor takes its value from a hash of (seed, parameter name,
its flat index in the full tensor), a counter-based generator (splitmix64, then
Box-Muller), so a shard holds exactly the slice of the full tensor initialised the same
way, whatever the layout, and no rank generates a value it does not keep::

    n      = flat index of the element in the full tensor
    u_k    = (splitmix64(key + (2n + k) * gamma) >> 11 + 1/2) / 2^53,  k = 0, 1   in (0, 1)
    value  = std * sqrt(-2 ln u_0) * cos(2 pi u_1)

This is a different stream from ``torch.manual_seed`` + ``normal_``: a model initialised
this way equals the unsharded model initialised the same way (``counter_normal_`` on
whole tensors), not one from ``Llama.reset_parameters``.
"""

from __future__ import annotations

import hashlib
import math

import torch

_GAMMA = 0x9E3779B97F4A7C15
_C1 = 0xBF58476D1CE4E5B9
_C2 = 0x94D049BB133111EB
_CHUNK = 1 << 22  # elements per pass, to bound the int64/float64 temporaries


def _signed(x: int) -> int:
    """A 64-bit pattern as the int64 torch stores (arithmetic wraps modulo 2^64)."""
    x &= (1 << 64) - 1
    return x - (1 << 64) if x >= 1 << 63 else x


def _srl(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's ``>>`` is arithmetic)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def _mix(z: torch.Tensor) -> torch.Tensor:
    z = (z ^ _srl(z, 30)) * _signed(_C1)
    z = (z ^ _srl(z, 27)) * _signed(_C2)
    return z ^ _srl(z, 31)


def _uniform(key: int, counter: torch.Tensor) -> torch.Tensor:
    h = _mix(key + counter * _signed(_GAMMA))
    return (_srl(h, 11).double() + 0.5) * 2.0 ** -53  # (0, 1), never 0 for the log


def stream_key(seed: int, name: str) -> int:
    """A stable 64-bit key per (seed, parameter name) (Python's ``hash`` is salted)."""
    digest = hashlib.blake2b(f"{seed}/{name}".encode(), digest_size=8).digest()
    return _signed(int.from_bytes(digest, "little"))


def _flat_index(full_shape, offsets, shape, device) -> torch.Tensor:
    """Flat index in ``full_shape`` of every element of the block at ``offsets``."""
    index = torch.zeros((), dtype=torch.int64, device=device)
    stride = 1
    for d in reversed(range(len(full_shape))):
        ar = torch.arange(offsets[d], offsets[d] + shape[d], dtype=torch.int64, device=device)
        index = index + (ar * stride).view(-1, *([1] * (len(full_shape) - 1 - d)))
        stride *= full_shape[d]
    return index


@torch.no_grad()
def counter_normal_(t: torch.Tensor, std: float, *, seed: int, name: str,
                    full_shape=None, dim: int | None = None, start: int = 0) -> torch.Tensor:
    """Fill ``t`` with N(0, std^2) values that depend only on (seed, name, index in the
    full tensor). ``t`` is the block of the full tensor (``full_shape``, default
    ``t.shape``) that starts at ``start`` along ``dim`` (the whole tensor if None)."""
    full_shape = tuple(full_shape or t.shape)
    offsets = [0] * t.dim()
    if dim is not None:
        offsets[dim] = start
    key = stream_key(seed, name)
    rows = max(1, _CHUNK // max(1, t[0].numel() if t.dim() else 1))
    for r0 in range(0, t.shape[0] if t.dim() else 1, rows):
        block = t[r0:r0 + rows] if t.dim() else t
        off = list(offsets)
        if t.dim():
            off[0] += r0
        n = _flat_index(full_shape, off, block.shape, t.device)
        u0, u1 = _uniform(key, 2 * n), _uniform(key, 2 * n + 1)
        z = torch.sqrt(-2.0 * torch.log(u0)) * torch.cos(2.0 * math.pi * u1)
        block.copy_(z * std)
    return t


@torch.no_grad()
def materialize_(module: torch.nn.Module, device) -> torch.nn.Module:
    """Allocate (uninitialised) every meta parameter and buffer of ``module`` on
    ``device``, in place. Unlike ``Module.to_empty`` it keeps tied parameters tied and
    keeps the attributes parameters carry (``p3d_tp_dim`` and the others)."""
    done: dict[int, torch.nn.Parameter] = {}
    for sub in module.modules():
        for key, p in list(sub._parameters.items()):
            if p is None:
                continue
            if id(p) not in done:
                new = torch.nn.Parameter(torch.empty_like(p, device=device), p.requires_grad)
                new.__dict__.update(p.__dict__)
                done[id(p)] = new
            sub._parameters[key] = done[id(p)]
        for key, b in list(sub._buffers.items()):
            if b is not None and b.is_meta:
                sub._buffers[key] = torch.empty_like(b, device=device)
    return module
