"""Zero-copy reads for the converter.

Inside :func:`zero_copy_reads` (the conversion pipeline), a read of one contiguous run of a
file (a safetensors tensor or row block, a ``torch.save`` storage, a DCP chunk) returns a
tensor viewing the page cache through a read-only shared mapping: no copy, no fresh pages
to zero. The pipeline calls :func:`release` once a tensor is written, which drops its
pages from this process (``MADV_DONTNEED``; a later touch re-reads the file), so resident
memory stays bounded as with copies. Off by default: a trainer that loads a checkpoint
keeps no mapping alive (mapped pages count as resident until released). Nothing writes
to these tensors: the mapping is read-only.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import threading
import warnings

import torch

_ZERO_COPY = False
_MAPPINGS: list[tuple[int, int, "mmap.mmap"]] = []  # (address, size, mapping)
_MAP_LOCK = threading.Lock()


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


def release(t: torch.Tensor) -> None:
    """Drop the pages of ``t`` from this process if it views a mapping (else nothing)."""
    if t.numel() == 0:
        return
    lo = t.data_ptr()
    hi = lo + t.numel() * t.element_size()
    with _MAP_LOCK:
        hits = [(base, mm) for base, size, mm in _MAPPINGS if base <= lo and hi <= base + size]
    for base, mm in hits:
        page = mmap.PAGESIZE
        start = (lo - base) // page * page
        try:
            mm.madvise(mmap.MADV_DONTNEED, start, hi - base - start)
        except (ValueError, OSError):
            pass
