"""Zero-copy reads for the converter.

Inside :func:`zero_copy_reads` (the conversion pipeline), a read of one contiguous run of a
file (a safetensors tensor or row block, a ``torch.save`` storage, a DCP chunk) returns a
tensor viewing the page cache through a read-only shared mapping: no copy, no fresh pages
to zero. The pipeline calls :func:`release` once a tensor is written, which drops its
pages from this process (``MADV_DONTNEED``; a later touch re-reads the file), so resident
memory stays bounded as with copies. Off by default: a trainer that loads a checkpoint
keeps no mapping alive (mapped pages count as resident until released). Nothing writes
to these tensors: the mapping is read-only.

The pipeline's reader threads :func:`prefetch` each view before handing it on
(``madvise(MADV_WILLNEED)``: the kernel reads the range into the page cache in the
background if it is not there yet, mapping nothing), so reading a cold source overlaps
writing. The pages are mapped by the writer's own ``write``, which is the cheapest way
(mapping them first, by ``MADV_POPULATE_READ`` or by touching them from user space, made
the kernel's copy into the output over twice as expensive here). A source's
tensor-parallel blocks come as :class:`Tiles`, written without being assembled.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import threading
import warnings
from dataclasses import dataclass

import torch

_ZERO_COPY = False
_MAPPINGS: list[tuple[int, int, "mmap.mmap"]] = []  # (address, size, mapping)
_MAP_LOCK = threading.Lock()


@dataclass
class Tiles:
    """A tensor of ``shape`` given as contiguous blocks ``parts`` along dim ``dim``, in order
    (their concatenation along ``dim`` is the tensor): a checkpoint's tensor-parallel pieces,
    handed to a writer that writes them where they go without assembling them."""

    dim: int
    parts: list[torch.Tensor]
    shape: tuple[int, ...]
    dtype: torch.dtype

    def __post_init__(self):
        self.shape = tuple(self.shape)
        ok = bool(self.parts) and sum(p.shape[self.dim] for p in self.parts) == self.shape[self.dim]
        for p in self.parts:
            ok = ok and p.dtype == self.dtype and p.is_contiguous() and p.dim() == len(self.shape) \
                and all(a == b for d, (a, b) in enumerate(zip(p.shape, self.shape)) if d != self.dim)
        if not ok:
            raise ValueError(f"tiles {[tuple(p.shape) for p in self.parts]} along dim {self.dim} do not "
                             f"make a contiguous {self.dtype} {list(self.shape)}")

    def assemble(self) -> torch.Tensor:
        return torch.cat(self.parts, self.dim)


@contextlib.contextmanager
def zero_copy_reads():
    global _ZERO_COPY
    before, _ZERO_COPY = _ZERO_COPY, True
    try:
        yield
    finally:
        _ZERO_COPY = before


def enabled() -> bool:
    return _ZERO_COPY


def map_file(fd: int, start: int = 0, length: int | None = None) -> tuple["mmap.mmap", int]:
    """A read-only shared mapping of ``[start, start + length)`` of ``fd`` (widened to a page
    boundary); returns it and the offset of ``start`` inside it."""
    lead = start % mmap.ALLOCATIONGRANULARITY
    size = (os.fstat(fd).st_size - start if length is None else length) + lead
    mm = mmap.mmap(fd, size, access=mmap.ACCESS_READ, offset=start - lead)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # read-only buffer: nothing here writes to it
        base = torch.frombuffer(mm, dtype=torch.uint8, count=1).data_ptr()
    with _MAP_LOCK:
        _MAPPINGS.append((base, size, mm))
    return mm, lead


def view_of(mm: "mmap.mmap", offset: int, count: int, dtype: torch.dtype) -> torch.Tensor:
    """``count`` elements of ``dtype`` at byte ``offset`` of the mapping, without a copy."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.frombuffer(mm, dtype=dtype, count=count, offset=offset)


def unmap(mm: "mmap.mmap") -> None:
    with _MAP_LOCK:
        _MAPPINGS[:] = [m for m in _MAPPINGS if m[2] is not mm]


def _ranges(t: torch.Tensor) -> list[tuple["mmap.mmap", int, int]]:
    """(mapping, page-aligned start, length) of ``t``'s bytes, if ``t`` views a mapping."""
    if t.numel() == 0:
        return []
    lo = t.data_ptr()
    hi = lo + t.numel() * t.element_size()
    with _MAP_LOCK:
        hits = [(base, mm) for base, size, mm in _MAPPINGS if base <= lo and hi <= base + size]
    page = mmap.PAGESIZE
    return [(mm, (lo - base) // page * page, hi - base - (lo - base) // page * page) for base, mm in hits]


def release(t: torch.Tensor) -> None:
    """Drop the pages of ``t`` from this process if it views a mapping (else nothing)."""
    for mm, start, length in _ranges(t):
        try:
            mm.madvise(mmap.MADV_DONTNEED, start, length)
        except (ValueError, OSError):
            pass


def prefetch(t: torch.Tensor) -> None:
    """Ask the kernel to read the pages of ``t`` into the page cache now, in the background,
    if ``t`` views a mapping (else nothing; see the module)."""
    for mm, start, length in _ranges(t):
        try:
            mm.madvise(mmap.MADV_WILLNEED, start, length)
        except (ValueError, OSError):
            pass
