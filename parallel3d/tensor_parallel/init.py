"""Initialising shards directly, without the full tensor existing anywhere.

The trainer builds the model on the meta device, applies tensor and pipeline parallelism
(shapes only), allocates this rank's shards in their storage dtype on the training device
(:func:`materialize_`) and fills each with :func:`counter_normal_`.

Every element of a full tensor takes its value from a counter-based generator keyed by
(seed, parameter name) and indexed by the element's flat position ``n`` in the full
tensor, so a shard holds exactly the slice of the full tensor initialised the same way,
whatever the layout, and no rank generates a value it does not keep::

    key    = blake2b-128(f"{seed}/{name}")                       Philox-4x64 key
    d_i    = i-th 64-bit output of Philox(key) (counter i // 4, word i % 4)
    u_k    = ((d_{2n+k} >> 40) + 1/2) / 2^24,  k = 0, 1          in (0, 1)
    value  = std * sqrt(-2 ln u_0) * cos(2 pi u_1)               (Box-Muller, in float64)

Philox is a counter-based generator (Salmon et al., SC 2011): any element's draws are
computed from its counter without generating the ones before it, so a contiguous run of
the full tensor (a block of rows, or one row's columns under a row-parallel split) costs
only its own elements. numpy's ``Philox`` bit generator produces the raw words; the
transform runs in torch, element-wise, so a value does not depend on which slice it was
computed in (a test checks this). Values are generated on the host in bounded chunks
(:data:`_CHUNK` elements, about 12 MB of temporaries), several at once on
``torch.get_num_threads()`` threads, and copied into the shard, on whatever device (through
pinned memory) and in whatever dtype it is stored: the host holds at most two chunks per
thread beyond the shard.

This is not the stream of ``torch.manual_seed`` + ``normal_``: a model initialised this
way equals the unsharded model initialised the same way (``counter_normal_`` on whole
tensors, :func:`parallel3d.models.llama.sharded_init.init_llama_`), not one from
``Llama.reset_parameters``.
"""

from __future__ import annotations

import hashlib
import math

import numpy as np
import torch

_CHUNK = 1 << 18  # elements generated per pass: bounds the host temporaries (~12 MB)
_MAX_WORKERS = 16  # threads generating chunks at once (2 chunks each in flight: ~400 MB)


def stream_key(seed: int, name: str) -> int:
    """A stable 128-bit Philox key per (seed, parameter name) (Python's ``hash`` is salted)."""
    return int.from_bytes(hashlib.blake2b(f"{seed}/{name}".encode(), digest_size=16).digest(), "little")


def _draws(gen: np.random.Philox, start: int, count: int) -> np.ndarray:
    """The raw 64-bit draws ``2 start .. 2 (start + count) - 1`` of ``gen``'s stream (its
    key), the generator moved to their counter (as ``Philox(key, counter)`` would start)."""
    first = 2 * start  # element n uses draws 2n and 2n + 1
    state = gen.state
    state["state"]["counter"][:] = (first // 4, 0, 0, 0)
    state["buffer_pos"] = 4  # nothing buffered: the next draw is word 0 of the counter
    gen.state = state
    return gen.random_raw(first % 4 + 2 * count)[first % 4:]


def _to_normal(raw: np.ndarray) -> torch.Tensor:
    """Box-Muller of the raw draws (pairs per element) in place, as float64 values."""
    count = raw.size // 2
    np.right_shift(raw, np.uint64(40), out=raw)  # the top 24 bits of each draw
    u = torch.from_numpy(raw.view(np.int64)).double().view(count, 2)
    u.add_(0.5).mul_(2.0 ** -24)
    u0, u1 = u[:, 0], u[:, 1]
    u0.log_().mul_(-2.0).sqrt_()
    u1.mul_(2.0 * math.pi).cos_()
    return u0.mul_(u1)


def normal_run(key: int, start: int, count: int) -> torch.Tensor:
    """The N(0, 1) values of flat elements ``[start, start + count)`` of the stream
    ``key``, as float64 (see the module docstring). Works in place on two buffers of
    ``2 * count`` words (the raw draws, then the uniforms): 32 bytes per element."""
    return _to_normal(_draws(np.random.Philox(key=key, counter=0), start, count))


def _runs(full_shape, dim, start, shape):
    """``(flat start in the full tensor, count, flat start in the block)`` of the
    contiguous runs that make up the block ``shape`` starting at ``start`` along
    ``dim`` (the whole tensor if ``dim`` is None)."""
    inner = math.prod(full_shape[1:]) if len(full_shape) > 1 else 1
    if dim is None or dim == 0:
        offset = start * inner if dim == 0 else 0
        yield offset, math.prod(shape), 0
        return
    if dim != len(full_shape) - 1 or len(full_shape) != 2:
        raise ValueError(f"counter_normal_: a split along dim {dim} of a {len(full_shape)}-D tensor")
    width = shape[1]
    for r in range(shape[0]):
        yield r * full_shape[1] + start, width, r * width


def _groups(runs, chunk: int):
    """The runs cut into pieces of at most ``chunk`` elements, grouped: a group is a list of
    ``(flat start in the full tensor, count)`` pieces that land one after the other in the
    block from the group's start, at most ``chunk`` elements in all; yields ``(start in the
    block, pieces, count)``."""
    pieces, at, queued = [], 0, 0
    for src, count, dst in runs:
        for lo in range(0, count, chunk):
            n = min(chunk, count - lo)
            if dst + lo != at + queued or queued + n > chunk:
                if pieces:
                    yield at, pieces, queued
                pieces, at, queued = [], dst + lo, 0
            pieces.append((src + lo, n))
            queued += n
    if pieces:
        yield at, pieces, queued


def _group_values(key: int, pieces, std: float, dtype: torch.dtype) -> torch.Tensor:
    """One group's values, scaled and in ``dtype`` (host): ``(N(0, 1) * std).to(dtype)``
    in float64, element by element as :func:`normal_run` computes them (bit for bit). The
    pieces' raw draws (one per row of a row-parallel block) are gathered first and
    transformed together: one generator and one pass of torch operations per group."""
    gen = np.random.Philox(key=key, counter=0)
    if len(pieces) == 1:
        raw = _draws(gen, *pieces[0])
    else:
        raw = np.concatenate([_draws(gen, src, n) for src, n in pieces])
    return _to_normal(raw).mul_(std).to(dtype)


def _workers() -> int:
    return max(1, min(_MAX_WORKERS, torch.get_num_threads()))


@torch.no_grad()
def counter_normal_(t: torch.Tensor, std: float, *, seed: int, name: str,
                    full_shape=None, dim: int | None = None, start: int = 0) -> torch.Tensor:
    """Fill ``t`` with N(0, std^2) values that depend only on (seed, name, index in the
    full tensor). ``t`` is the block of the full tensor (``full_shape``, default
    ``t.shape``) that starts at ``start`` along ``dim`` (the whole tensor if None);
    a row-parallel block (``dim`` = 1 of a matrix) is generated row by row.

    Groups of up to :data:`_CHUNK` elements are generated on up to ``torch.get_num_threads()``
    threads at once (numpy's Philox and torch's element-wise ops release the GIL), at most
    two groups per thread in flight: each value is a function of its index alone, so the
    order in which groups are computed changes nothing. A device shard gets each group
    through pinned host memory, copied without blocking the host."""
    from concurrent.futures import ThreadPoolExecutor

    full_shape = tuple(full_shape or t.shape)
    key = stream_key(seed, name)
    flat = t.view(-1)
    pinned = t.device.type == "cuda"

    def land(at: int, values: torch.Tensor) -> None:
        if pinned:
            values = values.pin_memory()  # the caching host allocator keeps it until copied
        flat[at:at + values.numel()].copy_(values, non_blocking=pinned)

    groups = _groups(_runs(full_shape, dim, start, tuple(t.shape)), _CHUNK)
    workers = _workers()
    if workers == 1 or t.numel() <= _CHUNK:
        for at, pieces, _ in groups:
            land(at, _group_values(key, pieces, std, t.dtype))
        return t
    with ThreadPoolExecutor(workers, thread_name_prefix="p3d-init") as pool:
        inflight = []
        for at, pieces, _ in groups:
            inflight.append((at, pool.submit(_group_values, key, pieces, std, t.dtype)))
            if len(inflight) >= 2 * workers:  # bounds the host temporaries
                at0, done = inflight.pop(0)
                land(at0, done.result())
        for at, done in inflight:
            land(at, done.result())
    return t


@torch.no_grad()
def materialize_(module: torch.nn.Module, device, dtype: torch.dtype | None = None,
                 storage: dict | None = None, only_storage: bool = False) -> dict[int, torch.nn.Parameter]:
    """Allocate (uninitialised) every meta parameter and buffer of ``module`` on
    ``device`` (floating-point ones in ``dtype`` when given), in place; a parameter
    whose ``id`` is in ``storage`` becomes that tensor instead (a view of a flat buffer,
    say). Unlike ``Module.to_empty`` it keeps tied parameters tied and keeps the
    attributes parameters carry (``p3d_tp_dim`` and the others). ``only_storage``: the
    parameters in ``storage`` only (others and buffers stay on meta). Returns ``{id(old):
    new}`` for the parameters it replaced."""
    done: dict[int, torch.nn.Parameter] = {}
    storage = storage or {}
    for sub in module.modules():
        for key, p in list(sub._parameters.items()):
            if p is None or not p.is_meta:
                continue
            if only_storage and id(p) not in storage:
                continue
            if id(p) not in done:
                if id(p) in storage:
                    view = storage[id(p)]
                    # a parameter of its own, then pointed at the view: a Parameter made
                    # from the view itself would share the whole buffer's version counter,
                    # and every write into the buffer (a ZeRO all-gather landing during the
                    # forward) would invalidate what autograd saved of every parameter
                    new = torch.nn.Parameter(torch.empty(0, dtype=view.dtype, device=view.device),
                                             p.requires_grad)
                    new.data = view
                else:
                    kind = dtype if dtype is not None and p.is_floating_point() else p.dtype
                    new = torch.nn.Parameter(torch.empty_like(p, device=device, dtype=kind), p.requires_grad)
                new.__dict__.update(p.__dict__)
                done[id(p)] = new
            sub._parameters[key] = done[id(p)]
        for key, b in list(sub._buffers.items()):
            if b is not None and b.is_meta and not only_storage:
                sub._buffers[key] = torch.empty_like(b, device=device)
    return done
