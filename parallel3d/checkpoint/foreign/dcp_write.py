"""Writing a torch DCP folder that ``torch.distributed.checkpoint.load`` reads into a Hugging
Face ``LlamaForCausalLM`` (or the same model wrapped by FSDP2, which keeps its keys).

The folder is what ``dcp.save(model.state_dict(), checkpoint_id=DST)`` writes from one
rank: each tensor whole, as one chunk (a ``torch.save`` archive appended to a
``__0_<i>.distcp`` file), keys in Hugging Face's state-dict naming, and ``.metadata``
(torch's ``Metadata`` dataclasses, pickled: the one file DCP defines that way). Loading
reshards: an FSDP2 model reads its own rows of each chunk. ``.metadata`` is pickled by
:mod:`.dcp_metadata` without importing torch's DCP package.

Each chunk is the archive ``torch.save(tensor)`` writes (what DCP's reader hands to
``torch.load(weights_only=True)``), built here rather than by ``torch.save``, which
serializes through a Python file object and needs the tensor assembled in memory: a zip
of stored entries (``archive/data.pkl``, the pickle of the tensor's rebuild call exactly as
torch writes it; ``data/0``, the raw bytes, 64-byte aligned; the small version records),
each entry's CRC-32 in a data descriptor after it, zip64 records as torch writes them. The
tensor's bytes go to the file by :class:`~parallel3d.checkpoint.hashed_file.HashedFile`
(straight from the source's pages, tensor-parallel tiles in place), whose CRC-32 of them
is both the entry's CRC and, combined, part of the file's checksum (``CRC32SUMS``).
"""

from __future__ import annotations

import collections
import io
import math
import os
import pickle
import struct
import uuid
import zlib
from pathlib import Path

import torch

from .dcp_metadata import metadata_bytes
from ..hashed_file import HashedFile
from ..zerocopy import Tiles

METADATA = ".metadata"
ARCHIVE = "archive/"
ALIGN = 64  # torch's storage alignment: data/0 starts at a multiple of it in the file
ZIP64_LIMIT = 0xFFFFFFFF  # sizes and offsets from this on need zip64 fields
_MARK = 0xFFFFFFFF  # a 4-byte field whose value is in the zip64 extra field
_PAD_ID = 0x4246  # "FB": the extra field torch pads with


class _Storage:
    """The tensor's storage in the pickle: written as a persistent id, as torch does."""

    def __init__(self, storage_type, numel: int):
        self.pid = ("storage", storage_type, "0", "cpu", numel)


class _Rebuild:
    """Pickles as ``torch._utils._rebuild_tensor_v2(storage, 0, size, stride, False, OrderedDict())``."""

    def __init__(self, storage: _Storage, shape: tuple[int, ...]):
        self.storage, self.shape = storage, tuple(shape)

    def __reduce__(self):
        stride = tuple(math.prod(self.shape[d + 1:]) for d in range(len(self.shape)))
        return (torch._utils._rebuild_tensor_v2,
                (self.storage, 0, self.shape, stride, False, collections.OrderedDict()))


class _Pickler(pickle.Pickler):
    def persistent_id(self, obj):
        return obj.pid if isinstance(obj, _Storage) else None


def tensor_pickle(dtype: torch.dtype, shape) -> bytes | None:
    """``data.pkl`` of ``torch.save`` of a contiguous tensor; None for a dtype without a
    typed storage class (written by ``torch.save`` itself then)."""
    name = torch.storage._dtype_to_storage_type_map().get(dtype)
    if name is None:
        return None
    buf = io.BytesIO()
    _Pickler(buf, protocol=2).dump(_Rebuild(_Storage(getattr(torch, name), math.prod(shape)), shape))
    return buf.getvalue()


class _Archive:
    """One ``torch.save`` zip archive written entry by entry into a :class:`HashedFile`
    from its current end; offsets inside it count from its start."""

    def __init__(self, file: HashedFile):
        self.file, self.start, self.entries = file, file.size, []

    def _local(self, name: bytes, zip64: bool, align: bool) -> bytes:
        extra = struct.pack("<HHQQ", 1, 16, 0, 0) if zip64 else b""
        if align:
            at = self.file.size + 30 + len(name) + len(extra) + 4
            extra += struct.pack("<HH", _PAD_ID, -at % ALIGN) + b"\0" * (-at % ALIGN)
        return struct.pack("<IHHHHHIIIHH", 0x04034B50, 45 if zip64 else 20, 0x808, 0, 0, 0, 0, 0, 0,
                           len(name), len(extra)) + name + extra

    def entry(self, name: str, data: bytes | None = None, tensor=None) -> None:
        """Entry ``name``: ``data``, or the bytes of ``tensor`` (a tensor or :class:`Tiles`)."""
        raw = (ARCHIVE + name).encode()
        size = len(data) if data is not None else _nbytes(tensor)
        zip64 = size >= ZIP64_LIMIT
        offset = self.file.size - self.start
        self.file.write(self._local(raw, zip64, align=tensor is not None))
        if data is not None:
            self.file.write(data)
            crc = zlib.crc32(data)
        elif isinstance(tensor, Tiles):
            crc = self.file.write_tiles(tensor, crc=True)
        else:
            crc = self.file.write_tensor(tensor, crc=True)
        sizes = struct.pack("<QQ" if zip64 else "<II", size, size)
        self.file.write(struct.pack("<II", 0x08074B50, crc) + sizes)
        self.entries.append((raw, crc, size, offset))

    def finish(self) -> None:
        """The central directory and the (zip64) end records, as torch writes them."""
        cd_start, cd = self.file.size - self.start, []
        for raw, crc, size, offset in self.entries:
            big = [v for v in (size, size) if v >= ZIP64_LIMIT] + ([offset] if offset >= ZIP64_LIMIT else [])
            extra = struct.pack(f"<HH{len(big)}Q", 1, 8 * len(big), *big) if big else b""
            cd.append(struct.pack("<IHHHHHHIIIHHHHHII", 0x02014B50, 45, 45 if big else 20, 0x808, 0, 0, 0,
                                  crc, _small(size), _small(size), len(raw), len(extra),
                                  0, 0, 0, 0, _small(offset)) + raw + extra)
        cd_bytes = b"".join(cd)
        n, eocd64 = len(self.entries), cd_start + len(cd_bytes)
        self.file.write(cd_bytes + struct.pack("<IQHHIIQQQQ", 0x06064B50, 44, 45, 45, 0, 0, n, n, len(cd_bytes),
                                               cd_start)
                        + struct.pack("<IIQI", 0x07064B50, 0, eocd64, 1)
                        + struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, n, n, _small(len(cd_bytes)),
                                      _small(cd_start), 0))


def _small(value: int) -> int:
    return value if value < ZIP64_LIMIT else _MARK


def _nbytes(tensor) -> int:
    return math.prod(tensor.shape) * torch.empty((), dtype=tensor.dtype).element_size()


class DCPFileWriter:
    """One ``.distcp`` file: tensors appended as ``torch.save`` archives (see the module)."""

    def __init__(self, folder: Path, name: str, algorithm: str = "sha256"):
        self.name = name
        self.file = HashedFile(folder / name, algorithm)
        self.records: list[tuple[str, torch.Tensor, int, int]] = []  # key, meta tensor, offset, length

    def write(self, key: str, tensor, then=None) -> None:
        """Append ``tensor`` (a tensor, or :class:`Tiles`) as one archive; ``then()`` after."""
        start = self.file.size
        pkl = tensor_pickle(tensor.dtype, tensor.shape)
        if pkl is None:
            buf = io.BytesIO()
            torch.save(tensor.assemble() if isinstance(tensor, Tiles) else tensor.contiguous(), buf)
            self.file.write(buf.getbuffer())
        else:
            archive = _Archive(self.file)
            archive.entry("data.pkl", pkl)
            archive.entry(".format_version", b"1")
            archive.entry(".storage_alignment", str(ALIGN).encode())
            archive.entry("byteorder", b"little")
            archive.entry("data/0", tensor=tensor)
            archive.entry("version", b"3\n")
            archive.entry(".data/serialization_id", f"{uuid.uuid4().int:040d}".encode())
            archive.finish()
        self.records.append((key, torch.empty(tuple(tensor.shape), dtype=tensor.dtype, device="meta"),
                             start, self.file.size - start))
        if then is not None:
            then()

    write_tiles = write

    def close(self) -> tuple[int, str]:
        return self.file.close()

    def abort(self) -> None:
        self.file.abort()


def write_metadata(folder: Path, writers: list[DCPFileWriter]) -> None:
    """``.metadata`` for the tensors the writers wrote (each whole, one chunk): torch's
    ``Metadata`` pickled (:mod:`.dcp_metadata`), fsynced, renamed into place."""
    records = [(key, w.name, meta.shape, meta.dtype, start, length)
               for w in writers for key, meta, start, length in w.records]
    data = metadata_bytes(records, str(folder), str(uuid.uuid4()))
    tmp = folder / (METADATA + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, folder / METADATA)
