"""torch distributed checkpoints (DCP, ``torch.distributed.checkpoint.save``) read by region.

A DCP folder holds ``.metadata`` (a pickle of ``Metadata``: for every flattened state-dict
key, its global size, dtype and chunks; for every chunk, the file, byte offset and length)
and the data files (``__<rank>_<i>.distcp``), where each chunk is one ``torch.save``
archive at its offset and a non-tensor value (a learning rate, a step count) a
``torch.save``'d object. torch's own reader unpickles ``.metadata`` with plain ``pickle``
(executes anything); here it goes through
:class:`~parallel3d.checkpoint.foreign.torchfile.SafeUnpickler` with DCP's metadata classes mapped
to inert records (and the writing framework's own classes: Megatron adds its planner's),
and chunks are :class:`~parallel3d.checkpoint.foreign.torchfile.TorchFile` archives read with
``pread``. :class:`DCPStore` serves any box of any key from whichever chunks it meets.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import CheckpointError
from ..format import check_file_name, intersect
from .. import zerocopy
from .torchfile import LazyTensor, Record, TorchFile, record_class, safe_unpickle

METADATA = ".metadata"
_DCP = "torch.distributed.checkpoint"
_CLASSES = {(f"{_DCP}.metadata", n): record_class(f"{_DCP}.metadata.{n}") for n in (
    "Metadata", "TensorStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
    "BytesStorageMetadata", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")}
_CLASSES[(f"{_DCP}.filesystem", "_StorageInfo")] = record_class(f"{_DCP}.filesystem._StorageInfo")


def is_dcp_folder(path: Path) -> bool:
    return (path / METADATA).is_file()


_MISSING = object()


def _field(rec, name: str, index: int, default=_MISSING):
    """Field ``name`` of a dataclass record, pickled as a dict or (frozen, slotted) a tuple;
    ``default`` for a field left out because it held its default."""
    if hasattr(rec, name):
        return getattr(rec, name)
    if isinstance(rec, Record):
        if isinstance(rec.state, tuple) and index < len(rec.state):
            return rec.state[index]
        if index < len(rec.args):
            return rec.args[index]
    if default is not _MISSING:
        return default
    raise CheckpointError(f"DCP metadata record {rec!r} has no {name}")


@dataclass
class Chunk:
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file: str
    start: int
    length: int


@dataclass
class Entry:
    shape: tuple[int, ...]
    dtype: torch.dtype | None  # None: a non-tensor value
    chunks: list[Chunk]


def read_metadata(folder: Path, opaque_prefixes: tuple[str, ...] = ()) -> tuple[dict[str, Entry], object]:
    """Every key of the checkpoint as an :class:`Entry`, and the raw metadata record."""
    path = folder / METADATA
    try:
        data = path.read_bytes()
    except OSError as e:
        raise CheckpointError(f"cannot read {path}: {e.strerror}") from None
    # DCP's own planner records (a SavePlan in planner_data) are data: inert records too
    meta = safe_unpickle(data, path, extra=_CLASSES, opaque_prefixes=opaque_prefixes + (_DCP,))
    try:
        sd_meta = _field(meta, "state_dict_metadata", 0)
        storage = _field(meta, "storage_data", 2)
        where = {}
        for index, info in storage.items():
            fqn, offset = _field(index, "fqn", 0), _field(index, "offset", 1, None)
            if getattr(info, "transform_descriptors", None):
                raise CheckpointError(f"{path}: {fqn} is stored with transforms "
                                      f"{info.transform_descriptors} (compressed?): not supported")
            file = check_file_name(_field(info, "relative_path", 0), str(path))
            where[(fqn, tuple(offset) if offset is not None else None)] = (
                file, int(_field(info, "offset", 1)), int(_field(info, "length", 2)))
        entries = {}
        for fqn, md in sd_meta.items():
            if md.qualname.endswith("BytesStorageMetadata"):
                entries[fqn] = Entry((), None, [Chunk((), (), *where[(fqn, None)])] if (fqn, None) in where else [])
                continue
            props = _field(md, "properties", 0)
            dtype = _field(props, "dtype", 0)
            shape = tuple(int(s) for s in _field(md, "size", 1))
            chunks = []
            for ch in _field(md, "chunks", 2):
                off = tuple(int(x) for x in _field(ch, "offsets", 0))
                sizes = tuple(int(x) for x in _field(ch, "sizes", 1))
                if (fqn, off) not in where:
                    raise CheckpointError(f"{path}: chunk {list(off)} of {fqn} has no storage record")
                chunks.append(Chunk(off, sizes, *where[(fqn, off)]))
            entries[fqn] = Entry(shape, dtype, chunks)
    except (AttributeError, TypeError, ValueError, KeyError) as e:
        if isinstance(e, CheckpointError):
            raise
        raise CheckpointError(f"{path} is not DCP metadata: {type(e).__name__} {e}") from None
    return entries, meta


class DCPStore:
    """Random access to the keys of one DCP folder, by box."""

    def __init__(self, folder: str | Path, opaque_prefixes: tuple[str, ...] = ()):
        self.folder = Path(folder)
        self.opaque_prefixes = opaque_prefixes
        self.entries, self.metadata = read_metadata(self.folder, opaque_prefixes)
        self._fds: dict[str, int] = {}
        self._chunks: dict[tuple[str, int], TorchFile] = {}

    def tensors(self) -> dict[str, Entry]:
        return {k: e for k, e in self.entries.items() if e.dtype is not None}

    def _fd(self, file: str) -> int:
        fd = self._fds.get(file)
        if fd is None:
            path = self.folder / file
            if path.is_symlink() and path.resolve().parent != self.folder.resolve():
                raise CheckpointError(f"{path} is a link out of the checkpoint folder: refusing to read it")
            try:
                fd = self._fds[file] = os.open(path, os.O_RDONLY)
            except OSError as e:
                raise CheckpointError(f"{path} is missing or unreadable ({e.strerror}): the "
                                      "checkpoint lacks a shard file") from None
        return fd

    def _archive(self, chunk: Chunk) -> TorchFile:
        key = (chunk.file, chunk.start)
        f = self._chunks.get(key)
        if f is None:
            f = self._chunks[key] = TorchFile(self.folder / chunk.file, chunk.start, chunk.length,
                                              fd=self._fd(chunk.file), opaque_prefixes=self.opaque_prefixes)
        return f

    def _chunk_tensor(self, key: str, chunk: Chunk) -> LazyTensor:
        t = self._archive(chunk).obj
        if not isinstance(t, LazyTensor) or t.shape != chunk.sizes:
            raise CheckpointError(f"{self.folder / chunk.file}: the chunk of {key} at byte {chunk.start} "
                                  f"does not hold a tensor of {list(chunk.sizes)}")
        return t

    def value(self, key: str):
        """A non-tensor value (unpickled safely), or a scalar tensor as a Python number."""
        e = self.entries[key]
        if e.dtype is not None:
            return self.read_region(key, (0,) * len(e.shape), e.shape).reshape(-1)[0].item() \
                if math.prod(e.shape) == 1 else None
        if not e.chunks:
            return None
        obj = self._archive(e.chunks[0]).obj
        return obj.read() if isinstance(obj, LazyTensor) else obj

    def read_region(self, key: str, offsets, shape, out: torch.Tensor | None = None) -> torch.Tensor:
        """The box of ``key``; with ``out`` (contiguous, of the box's shape and dtype), read
        into it where the chunks allow (no intermediate copy)."""
        e = self.entries[key]
        offsets, shape = tuple(offsets), tuple(shape)
        result, covered = None, 0  # allocated (or ``out``) once a second chunk is needed
        for ch in e.chunks:
            box = intersect(ch.offsets, ch.sizes, offsets, shape) if shape else ((), ())
            if box is None:
                continue
            inner = tuple(b - c for b, c in zip(box[0], ch.offsets))
            if box[1] == shape:
                return _box_of(self._chunk_tensor(key, ch), ch.sizes, inner, box[1], out)
            if result is None:
                result = out if out is not None else torch.empty(shape, dtype=e.dtype)
            dest = result[tuple(slice(b - o, b - o + s) for b, o, s in zip(box[0], offsets, box[1]))]
            got = _box_of(self._chunk_tensor(key, ch), ch.sizes, inner, box[1],
                          dest if dest.is_contiguous() else None)
            if got.data_ptr() != dest.data_ptr():
                dest.copy_(got)
                zerocopy.release(got)
            covered += math.prod(box[1])
        if covered != math.prod(shape) or result is None:
            raise CheckpointError(f"{self.folder}: only {covered} of {math.prod(shape)} elements of "
                                  f"{key} region {list(offsets)}+{list(shape)} are in the chunks "
                                  "(a rank's shard is missing?)")
        return result

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        self._chunks.clear()


def _box_of(t: LazyTensor, full, offsets, shape, out: torch.Tensor | None = None) -> torch.Tensor:
    """Box ``[offsets, offsets + shape)`` of the chunk ``t`` of shape ``full``: the flat span
    from its first to its last element, then a strided view. ``out``: a contiguous
    destination the box is read straight into when the box is one flat span."""
    if not full:
        return t.read()
    strides = [math.prod(full[d + 1:]) for d in range(len(full))]
    lo = sum(o * s for o, s in zip(offsets, strides))
    hi = sum((o + s - 1) * st for o, s, st in zip(offsets, shape, strides)) + 1
    if out is not None and hi - lo == math.prod(shape) and out.is_contiguous() and out.dtype == t.dtype:
        t.read_flat(lo, hi, out=out.reshape(-1))
        return out
    span = t.read_flat(lo, hi)
    if span.numel() == math.prod(shape):
        return span.reshape(shape)
    box = span.as_strided(shape, strides).clone()
    zerocopy.release(span)
    return box
