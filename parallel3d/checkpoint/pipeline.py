"""The conversion pipeline: tensors read ahead by a thread pool, written in order, hashed as
written, within a memory budget.

Reading (read-only mappings of the source files, prefetched with ``madvise``, see
:mod:`.zerocopy`; ``pread`` where a tensor must be gathered), casting, writing and hashing
all release the GIL on large buffers, so ``threads`` readers fetch the next tensors while
the writer writes the current one and a helper thread hashes it. Tensor-parallel pieces
come as :class:`~parallel3d.checkpoint.zerocopy.Tiles` and are written in place, never
concatenated. A tensor is submitted only
while the bytes in flight (read and not yet written, counting a cast's second copy) stay
within ``budget`` bytes; one tensor is always allowed, so a tensor larger than the budget
goes through alone. Peak memory is therefore about ``max(budget, largest tensor (x2 when
cast))`` plus the writer's one buffer, whatever the checkpoint's size.

Each output file is written by a writer with ``write(key, tensor)`` (and, optionally,
``write_tiles(key, tiles)``) and ``close() -> (size, digest)``: the digest of the bytes as they went to the file, so a reader can check
the file later without this process reading anything back.
"""

from __future__ import annotations

import math
import os
import sys
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from . import zerocopy

DEFAULT_BUDGET = 512 << 20
DEFAULT_THREADS = 4


@dataclass(frozen=True)
class Item:
    """One tensor to convert: logical ``name`` in the source, ``key`` in the output file."""

    name: str
    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype  # in the output
    src_dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * _size(self.dtype)

    @property
    def cost(self) -> int:
        """Memory while in flight: the read tensor, plus its cast copy."""
        src = math.prod(self.shape) * _size(self.src_dtype)
        return src + (self.nbytes if self.dtype != self.src_dtype else 0)


def _size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def return_freed_memory() -> None:
    """Make glibc serve every allocation of 1 MiB or more by its own ``mmap``, so a freed
    tensor goes back to the system at once. By default glibc raises that threshold to the
    size of each large block freed (up to 32 MiB) and then keeps later blocks in per-thread
    heaps, where the reader threads' freed tensors stay resident. No-op off glibc."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        if libc is not None and hasattr(libc, "mallopt"):
            libc.mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD
    except OSError:
        pass


def read_ahead(source, items: list[Item], budget: int = DEFAULT_BUDGET, threads: int = DEFAULT_THREADS):
    """Yield ``(item, tensor)`` in the order of ``items``, reading ahead within ``budget``.
    ``tensor`` may be :class:`~parallel3d.checkpoint.zerocopy.Tiles` (a source's
    ``read_tiles``: tensor-parallel pieces, written where they go without assembling them).
    Zero-copy views are prefetched (read into the page cache) here, on the reader threads."""
    return_freed_memory()
    read_tiles = getattr(source, "read_tiles", None)

    def load(item: Item):
        if read_tiles is not None and item.dtype == item.src_dtype:
            tiles = read_tiles(item.name)  # views of the pieces: nothing copied
            if tiles is not None:
                for part in tiles.parts:
                    zerocopy.prefetch(part)
                return tiles
        t = source.read(item.name)
        if t.dtype == item.dtype:
            zerocopy.prefetch(t)
            return t
        cast = t.to(item.dtype)
        zerocopy.release(t)
        return cast

    pending: deque = deque()
    inflight, i = 0, 0
    with ThreadPoolExecutor(max(1, threads), thread_name_prefix="p3d-read") as pool:
        try:
            while True:
                while i < len(items) and (not pending or inflight + items[i].cost <= budget):
                    pending.append((items[i], pool.submit(load, items[i])))
                    inflight += items[i].cost
                    i += 1
                if not pending:
                    return
                item, fut = pending.popleft()
                tensor = fut.result()
                del fut  # the future holds the tensor too: it must not outlive the accounting
                yield item, tensor
                del tensor
                inflight -= item.cost
        finally:
            for _, fut in pending:
                fut.cancel()


def write_files(stream, files: list[tuple[str, list[Item]]], open_writer, progress=None) -> dict:
    """Consume ``stream`` (from :func:`read_ahead`, in the order of ``files``' items) into
    ``open_writer(file, items)``; returns ``{file: {"size", "digest"}}``. A finished file is
    closed (fsynced) on a thread while the next one is written; all are closed on return."""
    closing: dict = {}
    it = iter(stream)
    with ThreadPoolExecutor(1, thread_name_prefix="p3d-close") as closer:  # waits for every close
        for file, members in files:
            writer = open_writer(file, members)
            try:
                for want in members:
                    item, tensor = next(it)
                    assert item is want, (item.name, want.name)
                    _write_one(writer, item, tensor)
                    if progress is not None:
                        progress(item.nbytes)
                    del tensor
            except BaseException:
                abort = getattr(writer, "abort", None)
                if abort is not None:
                    abort()
                raise
            closing[file] = closer.submit(writer.close)
    records = {}
    for file, fut in closing.items():
        size, digest = fut.result()  # raises the close's error (a failed fsync)
        records[file] = {"size": size, "digest": digest}
    return records


def _write_one(writer, item: Item, tensor) -> None:
    """Write one tensor; a view's pages are dropped once the writer is done with them
    (``then``: by the writer's hashing thread, once it has hashed them)."""
    parts = tensor.parts if isinstance(tensor, zerocopy.Tiles) else [tensor]

    def release() -> None:
        for part in parts:
            zerocopy.release(part)

    if not isinstance(tensor, zerocopy.Tiles):
        writer.write(item.key, tensor, then=release)
    elif hasattr(writer, "write_tiles"):
        writer.write_tiles(item.key, tensor, then=release)
    else:
        writer.write(item.key, tensor.assemble(), then=release)


class Progress:
    """Bytes done of a total: a tqdm bar on a terminal, else a line per 10%."""

    def __init__(self, total: int, what: str, enabled: bool = True):
        self.total, self.done, self.what, self.enabled = max(total, 1), 0, what, enabled
        self.bar, self._next, self._t0 = None, 0.1, time.monotonic()
        if enabled and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, unit="B", unit_scale=True, desc=what, file=sys.stderr)

    def __call__(self, nbytes: int) -> None:
        self.done += nbytes
        if self.bar is not None:
            self.bar.update(nbytes)
        elif self.enabled and self.done / self.total >= self._next - 1e-9:
            self._next = math.floor(self.done / self.total * 10 + 1) / 10
            rate = self.done / max(time.monotonic() - self._t0, 1e-9) / 2**20
            unit, scale = ("GiB", 2**30) if self.total >= 2**30 else ("MiB", 2**20)  # no "0.00 / 0.00 GiB"
            print(f"{self.what}: {self.done / scale:.2f} / {self.total / scale:.2f} {unit} "
                  f"({100 * self.done / self.total:.0f}%, {rate:.0f} MiB/s)", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def default_threads() -> int:
    return max(2, min(DEFAULT_THREADS, (os.cpu_count() or 2)))
