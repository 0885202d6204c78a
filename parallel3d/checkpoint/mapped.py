"""Logical tensors assembled from other frameworks' tensors: renames, slices, stacks, fusions.

Every foreign layout parallel3d reads is a tiling of each logical tensor by blocks of raw
tensors in a *store* (anything with ``read_region(key, offsets, shape)``): a rename is one
block; a layer of a stacked tensor (Megatron's ``decoder.layers.*``, shape ``(L, ...)``) is
a block with a leading layer offset; q, k and v of a fused ``linear_qkv`` grouped by
kv-head are one row block per kv-group; gate and up of a fused ``linear_fc1`` its two
halves; a tensor-parallel shard of a legacy file one block per rank; a padded vocabulary
the first ``vocab_size`` rows. :class:`Permuted` undoes the interleaved rotary layout of
Meta/torchtitan q and k projections (pairs ``(2i, 2i+1)`` of a head become ``(i, i+d/2)``,
Hugging Face's rotate-half layout). Reading a region reads only the raw boxes it meets.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from . import zerocopy
from .errors import CheckpointError
from .format import intersect
from .source import Source
from .zerocopy import Tiles


@dataclass(frozen=True)
class Block:
    """Logical box ``[out, out + shape)`` <- raw ``key`` box ``[src, src + lead + shape)``;
    ``src`` may have more dims than ``shape`` (leading dims of size 1: a stacked layer)."""

    key: str
    src: tuple[int, ...]
    out: tuple[int, ...]
    shape: tuple[int, ...]


@dataclass(frozen=True)
class Permuted:
    """The whole logical tensor is raw ``key`` (at ``src``, leading dims as in :class:`Block`)
    with the rows of each of ``n_heads`` heads reordered from interleaved to rotate-half."""

    key: str
    src: tuple[int, ...]
    shape: tuple[int, ...]
    n_heads: int


@dataclass
class Mapping:
    shape: tuple[int, ...]
    dtype: torch.dtype
    parts: list  # Blocks tiling the tensor, or one Permuted


def whole(key: str, shape, lead: tuple[int, ...] = ()) -> list[Block]:
    return [Block(key, tuple(lead) + (0,) * len(shape), (0,) * len(shape), tuple(shape))]


def rows(key: str, shape, start: int, lead: tuple[int, ...] = (), out_row: int = 0) -> Block:
    """Rows ``[start, start + shape[0])`` of raw ``key`` as logical rows from ``out_row``."""
    rest = (0,) * (len(shape) - 1)
    return Block(key, tuple(lead) + (start,) + rest, (out_row,) + rest, tuple(shape))


class MappedSource(Source):
    """A :class:`Source` whose tensors are :class:`Mapping` s over a raw ``store``."""

    def __init__(self, folder, store, mappings: dict[str, Mapping]):
        self.folder, self.store, self.mappings = folder, store, mappings

    def names(self) -> list[str]:
        return list(self.mappings)

    def spec(self, name: str):
        self.check_name(name)
        m = self.mappings[name]
        return m.shape, m.dtype

    def read_flat(self, name: str, lo: int, hi: int) -> torch.Tensor:
        shape, _ = self.spec(name)
        inner = math.prod(shape[1:]) if len(shape) > 1 else 1
        r0, r1 = lo // inner, (hi - 1) // inner + 1 if hi > lo else lo // inner
        part = self.read_region(name, (r0,) + (0,) * (len(shape) - 1), (r1 - r0,) + tuple(shape[1:]))
        return part.reshape(-1)[lo - r0 * inner:hi - r0 * inner].clone()

    def read_region(self, name: str, offsets, shape) -> torch.Tensor:
        full, dtype = self.spec(name)
        offsets, shape = tuple(offsets), tuple(shape)
        if len(shape) != len(full) or any(o < 0 or o + s > f for o, s, f in zip(offsets, shape, full)):
            raise CheckpointError(f"{self.folder}: region {list(offsets)}+{list(shape)} is outside "
                                  f"{name} of shape {list(full)}")
        parts = self.mappings[name].parts
        if len(parts) == 1 and isinstance(parts[0], Permuted):
            return self._permuted(parts[0], offsets, shape).to(dtype)
        out, covered = None, 0  # allocated once a second block is needed
        for b in parts:
            box = intersect(b.out, b.shape, offsets, shape)
            if box is None:
                continue
            lead = len(b.src) - len(b.shape)
            src = b.src[:lead] + tuple(s + x - o for s, x, o in zip(b.src[lead:], box[0], b.out))
            raw_box = (1,) * lead + box[1]
            if box[1] == shape:
                return self.store.read_region(b.key, src, raw_box).reshape(box[1]).to(dtype)
            if out is None:
                out = torch.empty(shape, dtype=dtype)
            dest = out[tuple(slice(x - o, x - o + s) for x, o, s in zip(box[0], offsets, box[1]))]
            if dest.is_contiguous():  # rows of the logical tensor: read straight into place
                got = self.store.read_region(b.key, src, raw_box, out=dest.view(raw_box))
                if got.data_ptr() != dest.data_ptr():
                    dest.copy_(got.reshape(box[1]))
                    zerocopy.release(got)
            else:
                got = self.store.read_region(b.key, src, raw_box)
                dest.copy_(got.reshape(box[1]))
                zerocopy.release(got)
            covered += math.prod(box[1])
        if covered != math.prod(shape) or out is None:
            raise CheckpointError(f"{self.folder}: {name} region {list(offsets)}+{list(shape)} is "
                                  "not covered by the checkpoint's tensors")
        return out

    def read_tiles(self, name: str) -> Tiles | None:
        """Zero-copy conversion (:mod:`.zerocopy`): the tensor as its raw blocks, when they
        tile it along one dim in order (tp shards, fused qkv's row groups, gate / up halves),
        each a contiguous view of its file where the store can give one; None otherwise."""
        full, dtype = self.spec(name)
        parts = self.mappings[name].parts
        if not zerocopy.enabled() or len(parts) < 2 or not all(isinstance(b, Block) for b in parts):
            return None
        split = {d for b in parts for d, (s, f) in enumerate(zip(b.shape, full)) if s != f}
        if len(split) != 1:
            return None
        dim = split.pop()
        at, views = 0, []
        for b in sorted(parts, key=lambda b: b.out[dim]):
            if b.out[dim] != at or any(o for d, o in enumerate(b.out) if d != dim):
                break
            lead = len(b.src) - len(b.shape)
            got = self.store.read_region(b.key, b.src, (1,) * lead + b.shape)
            views.append(got.reshape(b.shape))
            at += b.shape[dim]
            if got.dtype != dtype or not views[-1].is_contiguous():
                break
        else:
            if at == full[dim]:
                return Tiles(dim, views, full, dtype)
        for v in views:
            zerocopy.release(v)
        return None

    def _permuted(self, p: Permuted, offsets, shape) -> torch.Tensor:
        rows_total, cols = p.shape[0], p.shape[1:]
        hd = rows_total // p.n_heads
        h0, h1 = offsets[0] // hd, (offsets[0] + shape[0] - 1) // hd + 1
        lead = len(p.src) - len(p.shape)
        raw = self.store.read_region(p.key, p.src[:lead] + (h0 * hd,) + (0,) * len(cols),
                                     (1,) * lead + ((h1 - h0) * hd,) + tuple(cols))
        rows_hf = raw.reshape((h1 - h0, hd // 2, 2) + tuple(cols)).transpose(1, 2)
        rows_hf = rows_hf.reshape(((h1 - h0) * hd,) + tuple(cols))  # a copy: the rows moved
        zerocopy.release(raw)
        sl = (slice(offsets[0] - h0 * hd, offsets[0] - h0 * hd + shape[0]),)
        sl += tuple(slice(o, o + s) for o, s in zip(offsets[1:], shape[1:]))
        return rows_hf[sl].contiguous()

    def close(self) -> None:
        self.store.close()


class LazyStore:
    """A store over :class:`~parallel3d.checkpoint.foreign.torchfile.LazyTensor` s by key."""

    def __init__(self, tensors: dict, files: list):
        self.tensors, self.files = tensors, files

    def read_region(self, key: str, offsets, shape, out: torch.Tensor | None = None) -> torch.Tensor:
        from .foreign.dcp_read import _box_of

        t = self.tensors[key]
        return _box_of(t, t.shape, tuple(offsets), tuple(shape), out)

    def close(self) -> None:
        for f in self.files:
            f.close()
