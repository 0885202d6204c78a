"""safetensors files written tensor by tensor and read box by box, never whole.

The format (https://github.com/huggingface/safetensors): an 8-byte little-endian header
length ``N``, ``N`` bytes of JSON ``{key: {"dtype", "shape", "data_offsets": [begin, end]},
"__metadata__": {str: str}}`` (padded with spaces to a multiple of 8), then the data,
each tensor row-major at ``[begin, end)`` of the data region.

Why not ``safetensors.torch.save_file`` / ``safe_open``: saving needs every tensor of a
file in memory at once, and reading through a memory map counts every page touched in
the process's resident memory until the map closes. :class:`StreamingWriter` writes one
tensor at a time (peak memory: that tensor) with a running sha256 of the bytes, so the
checksum costs no second pass; :class:`SafetensorsFile` reads any rectangular box of a
tensor with ``preadv`` into the output tensor, touching only the bytes it needs. Both
produce and accept standard files (``transformers`` and ``safe_open`` read ours).

Every malformed input raises :class:`~parallel3d.checkpoint.errors.CheckpointError`
naming the file.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
from pathlib import Path

import torch

from . import zerocopy
from .errors import CheckpointError
from .hashed_file import HashedFile
from .zerocopy import Tiles

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
CODES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}
MAX_HEADER = 100 * 2**20  # what the reference implementation accepts

# Reading a box whose rows are short runs: one pread of the covering span, then a slice,
# when the span is at most this many times the box (fewer syscalls than one per run).
_SPAN_FACTOR = 4


def dtype_code(dtype: torch.dtype) -> str:
    if dtype not in CODES:
        raise CheckpointError(f"dtype {dtype} cannot be stored in safetensors")
    return CODES[dtype]


class StreamingWriter:
    """Write a safetensors file whose keys, dtypes and shapes are known up front.

    ``specs`` lists ``(key, dtype, shape)`` in the order the tensors will be written::

        w = StreamingWriter(path, [("a", torch.float32, (4, 3)), ...])
        w.write("a", tensor_a)        # in the order of specs
        size, sha256 = w.close()      # flushed and fsynced

    The file is written where it is told; atomicity is the caller's (a temporary
    directory renamed when complete).
    """

    def __init__(self, path: str | Path, specs: list[tuple[str, torch.dtype, tuple[int, ...]]],
                 metadata: dict[str, str] | None = None, algorithm: str = "sha256"):
        self.path = Path(path)
        header: dict = {}
        if metadata:
            header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
        self._order: list[tuple[str, torch.dtype, tuple[int, ...], int]] = []
        at = 0
        for key, dtype, shape in specs:
            if key in header:
                raise ValueError(f"duplicate key {key!r} in {self.path.name}")
            shape = tuple(int(s) for s in shape)
            nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
            header[key] = {"dtype": dtype_code(dtype), "shape": list(shape),
                           "data_offsets": [at, at + nbytes]}
            self._order.append((key, dtype, shape, nbytes))
            at += nbytes
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)
        self._next = 0
        self._file = HashedFile(self.path, algorithm)
        self._file.write(struct.pack("<Q", len(text)))
        self._file.write(text)

    def write(self, key: str, tensor: torch.Tensor, then=None) -> None:
        """Write tensor ``key`` (the next in ``specs``); ``then``: see :meth:`HashedFile.write_tensor`."""
        if self._next >= len(self._order):
            raise ValueError(f"{self.path.name}: unexpected tensor {key!r}, all were written")
        want_key, dtype, shape, nbytes = self._order[self._next]
        if key != want_key or tensor.dtype != dtype or tuple(tensor.shape) != shape:
            raise ValueError(f"{self.path.name}: expected {want_key} {dtype} {shape}, got "
                             f"{key} {tensor.dtype} {tuple(tensor.shape)}")
        self._file.write_tensor(tensor, then=then)
        self._next += 1

    def write_tiles(self, key: str, tiles: Tiles, then=None) -> None:
        """Write tensor ``key`` given as blocks along one dim (see :class:`Tiles`)."""
        want_key, dtype, shape, _ = self._order[self._next] if self._next < len(self._order) else (None,) * 4
        if key != want_key or tiles.dtype != dtype or tuple(tiles.shape) != shape:
            raise ValueError(f"{self.path.name}: expected {want_key} {dtype} {shape}, got {key} "
                             f"{tiles.dtype} as {[tuple(p.shape) for p in tiles.parts]}")
        self._file.write_tiles(tiles, then=then)
        self._next += 1

    def close(self) -> tuple[int, str]:
        """Flush to disk; returns (size in bytes, sha256 hex digest)."""
        if self._next != len(self._order):
            missing = [k for k, *_ in self._order[self._next:]]
            self.abort()
            raise ValueError(f"{self.path.name}: closed before writing {missing[:3]}")
        return self._file.close()

    def abort(self) -> None:
        self._file.abort()


def write_file(path: str | Path, tensors: dict[str, torch.Tensor],
               metadata: dict[str, str] | None = None) -> tuple[int, str]:
    """Write ``tensors`` (already in memory) as one file; returns (size, sha256)."""
    writer = StreamingWriter(path, [(k, t.dtype, tuple(t.shape)) for k, t in tensors.items()], metadata)
    for k, t in tensors.items():
        writer.write(k, t)
    return writer.close()


class TensorInfo:
    __slots__ = ("dtype", "shape", "begin", "end")

    def __init__(self, dtype: torch.dtype, shape: tuple[int, ...], begin: int, end: int):
        self.dtype, self.shape, self.begin, self.end = dtype, shape, begin, end


class SafetensorsFile:
    """Random access to the tensors of one safetensors file, by box or by flat range.

    The header is parsed and checked against the file size when opened, so a truncated
    file or a header pointing outside the file is refused before anything is read.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            self._fd = os.open(self.path, os.O_RDONLY)
        except OSError as e:
            raise CheckpointError(f"cannot open {self.path}: {e.strerror}") from None
        try:
            self.size = os.fstat(self._fd).st_size
            self.tensors, self.metadata, self._data_start = self._parse_header()
        except BaseException:
            os.close(self._fd)
            raise

    def _bad(self, why: str) -> CheckpointError:
        return CheckpointError(f"{self.path} is not a valid safetensors file: {why}")

    def _parse_header(self):
        if self.size < 8:
            raise self._bad(f"only {self.size} bytes")
        (n,) = struct.unpack("<Q", os.pread(self._fd, 8, 0))
        if n > MAX_HEADER or 8 + n > self.size:
            raise self._bad(f"header of {n} bytes in a file of {self.size} (truncated?)")
        try:
            header = json.loads(os.pread(self._fd, n, 8))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise self._bad(f"header is not JSON ({e})") from None
        if not isinstance(header, dict):
            raise self._bad("header is not a JSON object")
        metadata = header.pop("__metadata__", None) or {}
        data_start, data_size = 8 + n, self.size - 8 - n
        tensors: dict[str, TensorInfo] = {}
        for key, entry in header.items():
            try:
                dtype = DTYPES[entry["dtype"]]
                shape = tuple(int(s) for s in entry["shape"])
                begin, end = (int(x) for x in entry["data_offsets"])
            except (KeyError, TypeError, ValueError):
                raise self._bad(f"bad entry for tensor {key!r}: {entry!r}") from None
            nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
            if any(s < 0 for s in shape) or end - begin != nbytes or begin < 0 or end > data_size:
                raise self._bad(f"tensor {key!r} at bytes [{begin}, {end}) of a {data_size}-byte "
                                f"data region does not hold {entry['dtype']} {list(shape)} (truncated?)")
            tensors[key] = TensorInfo(dtype, shape, begin, end)
        return tensors, metadata, data_start

    def info(self, key: str) -> TensorInfo:
        if key not in self.tensors:
            raise CheckpointError(f"{self.path} has no tensor {key!r}")
        return self.tensors[key]

    # -- reading ---------------------------------------------------------------------------
    def _pread_into(self, out: torch.Tensor, offset: int) -> None:
        """Fill the contiguous tensor ``out`` with the bytes at ``offset`` of the data region."""
        buf = memoryview(out.reshape(-1).view(torch.uint8).numpy()).cast("B")
        pos, total = 0, buf.nbytes
        while pos < total:
            got = os.preadv(self._fd, [buf[pos:]], self._data_start + offset + pos)
            if got <= 0:
                raise CheckpointError(f"{self.path}: unexpected end of file (truncated?)")
            pos += got

    def _view(self, offset: int, count: int, dtype: torch.dtype) -> torch.Tensor:
        """Zero-copy (see :mod:`.zerocopy`): ``count`` elements at ``offset`` of the data region."""
        if getattr(self, "_mm", None) is None:
            self._mm, _ = zerocopy.map_file(self._fd)
        return zerocopy.view_of(self._mm, self._data_start + offset, count, dtype)

    def read(self, key: str) -> torch.Tensor:
        info = self.info(key)
        if zerocopy.enabled() and math.prod(info.shape):
            return self._view(info.begin, math.prod(info.shape), info.dtype).reshape(info.shape)
        out = torch.empty(info.shape, dtype=info.dtype)
        if out.numel():
            self._pread_into(out, info.begin)
        return out

    def read_flat(self, key: str, lo: int, hi: int) -> torch.Tensor:
        """Elements ``[lo, hi)`` of the row-major flattened tensor, as a 1-D tensor."""
        info = self.info(key)
        numel = math.prod(info.shape)
        if not 0 <= lo <= hi <= numel:
            raise CheckpointError(f"{self.path}: range [{lo}, {hi}) outside {key!r} of {numel} elements")
        out = torch.empty(hi - lo, dtype=info.dtype)
        if hi > lo:
            self._pread_into(out, info.begin + lo * out.element_size())
        return out

    def read_box(self, key: str, offsets, shape, *, view_shape=None, flat_start: int = 0,
                 out: torch.Tensor | None = None) -> torch.Tensor:
        """The box ``[offsets, offsets + shape)`` of tensor ``key``.

        With ``view_shape``, the elements ``[flat_start, flat_start + prod(view_shape))`` of
        the flattened tensor are read as a row-major tensor of that shape first (how a flat
        ZeRO piece is addressed as a block). ``out``: a contiguous tensor of that shape and
        dtype to read into (no intermediate copy)."""
        info = self.info(key)
        full, offsets, shape = self._check_box(key, info, offsets, shape, view_shape, flat_start)
        if out is None and zerocopy.enabled() and math.prod(shape) and self._one_run(full, offsets, shape):
            item = torch.empty((), dtype=info.dtype).element_size()
            first = sum(o * math.prod(full[d + 1:]) for d, o in enumerate(offsets))
            return self._view(info.begin + (flat_start + first) * item, math.prod(shape),
                              info.dtype).reshape(shape)
        if out is None:
            out = torch.empty(shape, dtype=info.dtype)
        elif tuple(out.shape) != shape or out.dtype != info.dtype or not out.is_contiguous():
            raise ValueError(f"read_box out: need a contiguous {info.dtype} {shape}")
        if out.numel() == 0:
            return out
        base = info.begin + flat_start * out.element_size()
        if not full:  # a scalar
            self._pread_into(out, base)
            return out
        return self._pread_box(out, base, full, offsets, shape)

    def _check_box(self, key: str, info: TensorInfo, offsets, shape, view_shape, flat_start: int):
        """``(full, offsets, shape)`` as tuples, ``full`` being the shape the box is taken
        from; a box or flat range outside tensor ``key`` is a CheckpointError."""
        full = tuple(view_shape) if view_shape is not None else info.shape
        if view_shape is not None and not 0 <= flat_start <= flat_start + math.prod(full) <= math.prod(info.shape):
            raise CheckpointError(f"{self.path}: {key!r} has no elements [{flat_start}, +{math.prod(full)})")
        offsets, shape = tuple(offsets), tuple(shape)
        if len(offsets) != len(full) or any(o < 0 or o + s > f for o, s, f in zip(offsets, shape, full)):
            raise CheckpointError(f"{self.path}: box {offsets}+{shape} outside {key!r} of shape {full}")
        return full, offsets, shape

    def _pread_box(self, out: torch.Tensor, base: int, full, offsets, shape) -> torch.Tensor:
        """Fill the contiguous, non-empty ``out`` of shape ``shape`` (at least 1-D) with the
        box ``[offsets, offsets + shape)`` of the row-major tensor of shape ``full`` whose
        first element is at ``base`` of the data region: one pread if the box is one run or
        its covering span is at most ``_SPAN_FACTOR`` times the box (then sliced), else one
        pread per run."""
        item = out.element_size()
        strides = [math.prod(full[d + 1:]) for d in range(len(full))]
        # Dims after `split` are whole, so each index of dims [0, split) names one
        # contiguous run of shape[split] * strides[split] elements.
        split = len(full) - 1
        while split > 0 and shape[split] == full[split]:
            split -= 1
        run_numel = shape[split] * strides[split]
        first = sum(o * s for o, s in zip(offsets, strides))
        n_runs = math.prod(shape[:split])
        if n_runs == 1:
            self._pread_into(out, base + first * item)
            return out
        last = sum((o + s - 1) * st for o, s, st in zip(offsets, shape, strides))
        span = last - first + 1
        if span <= _SPAN_FACTOR * out.numel():
            block = torch.empty(span, dtype=out.dtype)
            self._pread_into(block, base + first * item)
            view = block.as_strided(shape, strides)
            return out.copy_(view)
        flat_out = out.reshape(n_runs, run_numel)
        lead = shape[:split]
        for i in range(n_runs):
            idx, rest = [], i
            for s in reversed(lead):
                rest, r = divmod(rest, s)
                idx.append(r)
            idx.reverse()
            start = first + sum(j * strides[d] for d, j in enumerate(idx))
            self._pread_into(flat_out[i], base + start * item)
        return out

    @staticmethod
    def _one_run(full, offsets, shape) -> bool:
        """Whether the box is one contiguous run of the row-major tensor."""
        d = len(full) - 1
        while d > 0 and shape[d] == full[d]:
            d -= 1
        return all(s == 1 for s in shape[:d])

    def close(self) -> None:
        if getattr(self, "_mm", None) is not None:
            zerocopy.unmap(self._mm)  # the mapping itself goes when no tensor views it any more
            self._mm = None
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


def file_sha256(path: str | Path, chunk: int = 16 * 2**20) -> tuple[int, str]:
    """(size, sha256) of a file, read in chunks (memory: one chunk)."""
    h = hashlib.sha256()
    size = 0
    buf = bytearray(chunk)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while True:
            n = f.readinto(buf)
            if not n:
                break
            h.update(view[:n])
            size += n
    return size, h.hexdigest()
