"""Files written by ``torch.save`` (DeepSpeed ``.pt``, Megatron ``model_optim_rng.pt`` and
``common.pt``, the chunks of a torch DCP ``.distcp`` file), read without executing code and
without loading them whole.

A ``torch.save`` file is a zip archive (entries stored, not compressed): ``<name>/data.pkl``
is a pickle of the object, whose tensors point at storages ``<name>/data/<key>`` holding the
raw bytes. :class:`TorchFile` unpickles ``data.pkl`` with :class:`SafeUnpickler`, which
resolves only the globals of an allow-list: the tensor rebuild functions become
:class:`LazyTensor` records (storage key, offset, shape, stride), storages become
:class:`StorageRef` records, and the few classes a format needs (DeepSpeed's loss scaler,
Megatron's ``argparse.Namespace``, DCP's metadata dataclasses) become inert stand-ins that
only keep their arguments. Any other global is refused by name, so nothing in the file can
run code (the guarantee of ``torch.load(weights_only=True)``, which would also map every
tensor into memory). Tensor bytes are then read with ``pread`` from the storage's offset in
the archive: a reader holds only what it asked for.
"""

from __future__ import annotations

import collections
import io
import math
import os
import pickle
import struct
import zipfile
from pathlib import Path

import torch

from .. import zerocopy
from ..errors import CheckpointError

_STORAGE_DTYPES = {
    "FloatStorage": torch.float32, "DoubleStorage": torch.float64, "HalfStorage": torch.float16,
    "BFloat16Storage": torch.bfloat16, "LongStorage": torch.int64, "IntStorage": torch.int32,
    "ShortStorage": torch.int16, "CharStorage": torch.int8, "ByteStorage": torch.uint8,
    "BoolStorage": torch.bool, "ComplexFloatStorage": torch.complex64,
    "ComplexDoubleStorage": torch.complex128,
}
_DTYPE_NAMES = {str(d).removeprefix("torch."): d for d in (
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128,
    torch.float8_e4m3fn, torch.float8_e5m2)}


class Record:
    """Inert stand-in for an allow-listed class: keeps its constructor arguments and its
    pickled state, runs nothing. ``qualname`` says which class it stands for."""

    qualname = "?"

    def __new__(cls, *args, **kwargs):
        obj = object.__new__(cls)
        obj.args = args
        obj.state = None
        return obj

    def __init__(self, *args, **kwargs):
        pass

    def __setstate__(self, state):
        self.state = state
        if isinstance(state, tuple) and len(state) == 2 and (state[0] is None or isinstance(state[0], dict)):
            state = {**(state[0] or {}), **(state[1] or {})}  # (dict, slots) of a slotted class
        if isinstance(state, dict):
            for k, v in state.items():
                if isinstance(k, str) and k not in ("args", "state", "qualname"):
                    object.__setattr__(self, k, v)

    def get(self, name: str, default=None):
        return getattr(self, name, default)

    def __repr__(self) -> str:
        return f"<{self.qualname} stand-in>"


def record_class(qualname: str) -> type:
    """A :class:`Record` subclass standing for ``qualname``."""
    return type(qualname.rsplit(".", 1)[-1], (Record,), {"qualname": qualname})


class StorageRef:
    """A storage of the archive: its entry key, dtype and size in elements."""

    __slots__ = ("key", "dtype", "numel")

    def __init__(self, key: str, dtype: torch.dtype, numel: int):
        self.key, self.dtype, self.numel = key, dtype, numel


class LazyTensor:
    """A tensor of a :class:`TorchFile`, not yet read: ``shape`` and ``stride`` over
    elements ``offset..`` of ``storage``."""

    __slots__ = ("file", "storage", "offset", "shape", "stride")

    def __init__(self, storage: StorageRef, offset: int, shape, stride):
        self.file: TorchFile | None = None
        self.storage, self.offset = storage, int(offset)
        self.shape, self.stride = tuple(int(s) for s in shape), tuple(int(s) for s in stride)

    @property
    def dtype(self) -> torch.dtype:
        return self.storage.dtype

    def numel(self) -> int:
        return math.prod(self.shape)

    def is_contiguous(self) -> bool:
        want = 1
        for size, stride in zip(reversed(self.shape), reversed(self.stride)):
            if size != 1 and stride != want:
                return False
            want *= size
        return True

    def read_flat(self, lo: int, hi: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Elements ``[lo, hi)`` of the row-major flattened tensor, 1-D."""
        if not 0 <= lo <= hi <= self.numel():
            raise CheckpointError(f"{self.file.path}: range [{lo}, {hi}) outside a tensor of {self.numel()}")
        if self.is_contiguous():
            return self.file.read_storage(self.storage, self.offset + lo, hi - lo, out)
        return self.read().reshape(-1)[lo:hi].clone()

    def read(self) -> torch.Tensor:
        """The whole tensor (a copy in memory, contiguous)."""
        if self.is_contiguous():
            return self.file.read_storage(self.storage, self.offset, self.numel()).reshape(self.shape)
        span = 1 + sum((s - 1) * st for s, st in zip(self.shape, self.stride)) if self.numel() else 0
        flat = self.file.read_storage(self.storage, self.offset, span)
        out = flat.as_strided(self.shape, self.stride).contiguous()
        zerocopy.release(flat)
        return out


def _rebuild_tensor(storage, storage_offset, size, stride, *_ignored):
    if not isinstance(storage, StorageRef):
        raise pickle.UnpicklingError("a tensor without a storage")
    return LazyTensor(storage, storage_offset, size, stride)


def _rebuild_parameter(data, *_ignored):
    return data


def _rebuild_from_type(func, new_type, args, state=None):
    if func is not _rebuild_tensor:
        raise pickle.UnpicklingError("_rebuild_from_type_v2 of something other than a tensor")
    return func(*args)


def _codecs_encode(text, encoding="utf-8"):
    if encoding not in ("latin1", "latin-1", "utf-8", "utf8"):
        raise pickle.UnpicklingError(f"_codecs.encode with encoding {encoding!r}")
    return text.encode(encoding)


def _reconstructor(cls, base, state):
    if not (isinstance(cls, type) and issubclass(cls, Record)) or base is not object:
        raise pickle.UnpicklingError(f"copyreg._reconstructor of {cls!r}")
    return cls.__new__(cls)


def _path(*parts):
    return os.path.join(*[str(p) for p in parts]) if parts else ""


_BASE_GLOBALS = {
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor,
    ("torch._utils", "_rebuild_tensor"): _rebuild_tensor,
    ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
    ("torch._utils", "_rebuild_parameter_with_state"): _rebuild_parameter,
    ("torch._tensor", "_rebuild_from_type_v2"): _rebuild_from_type,
    ("torch._tensor", "Tensor"): None, ("torch", "Tensor"): None,
    ("torch.nn.parameter", "Parameter"): None,
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("torch", "Size"): tuple,
    ("builtins", "set"): set, ("builtins", "frozenset"): frozenset,
    ("builtins", "slice"): slice, ("builtins", "complex"): complex,
    ("builtins", "bytearray"): bytearray,
    ("_codecs", "encode"): _codecs_encode,
    ("copyreg", "_reconstructor"): _reconstructor,
    ("builtins", "object"): object,
    ("pathlib", "PosixPath"): _path, ("pathlib", "WindowsPath"): _path, ("pathlib", "Path"): _path,
    ("torch.serialization", "_get_layout"): lambda name: None,
    ("torch", "strided"): None, ("torch", "contiguous_format"): None,
    ("torch", "channels_last"): None, ("torch", "preserve_format"): None,
}


class SafeUnpickler(pickle.Unpickler):
    """A pickle reader that resolves only allow-listed globals.

    ``extra`` maps ``(module, name)`` to what stands for it (usually a :func:`record_class`);
    ``opaque_prefixes``: modules of the writing framework whose every class becomes an inert
    :class:`Record` (a framework's own enums and configs, which nothing here uses). Anything
    else raises :class:`pickle.UnpicklingError` naming the global."""

    def __init__(self, data: bytes, extra: dict | None = None, opaque_prefixes: tuple[str, ...] = ()):
        super().__init__(io.BytesIO(data), encoding="utf-8")
        self.extra = extra or {}
        self.opaque_prefixes = opaque_prefixes
        self._opaque: dict[tuple[str, str], type] = {}

    def find_class(self, module: str, name: str):
        key = (module, name)
        if key in self.extra:
            return self.extra[key]
        if key in _BASE_GLOBALS:
            return _BASE_GLOBALS[key]
        if module == "torch" and name in _STORAGE_DTYPES:
            return _STORAGE_DTYPES[name]
        if module == "torch" and name in _DTYPE_NAMES:
            return _DTYPE_NAMES[name]
        if any(module == p or module.startswith(p + ".") for p in self.opaque_prefixes):
            if key not in self._opaque:
                self._opaque[key] = record_class(f"{module}.{name}")
            return self._opaque[key]
        raise pickle.UnpicklingError(f"refusing to load the global {module}.{name} (not on the allow-list)")

    def persistent_load(self, pid):
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise pickle.UnpicklingError(f"unknown persistent id {str(pid)[:80]}")
        _, dtype, key, _location, numel = pid
        if not isinstance(dtype, torch.dtype):
            raise pickle.UnpicklingError(f"storage of unknown type {dtype!r}")
        return StorageRef(str(key), dtype, int(numel))


def safe_unpickle(data: bytes, what: Path | str, **kwargs):
    """Unpickle ``data`` with :class:`SafeUnpickler`; a refusal names ``what``."""
    try:
        return SafeUnpickler(data, **kwargs).load()
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, IndexError,
            KeyError, UnicodeDecodeError, struct.error) as e:
        raise CheckpointError(f"{what} cannot be read safely: {str(e)[:300] or type(e).__name__}") from None


class _Slice(io.RawIOBase):
    """Bytes ``[start, start + length)`` of a file descriptor as a seekable stream."""

    def __init__(self, fd: int, start: int, length: int):
        self.fd, self.start, self.length, self.pos = fd, start, length, 0

    def readable(self):
        return True

    def seekable(self):
        return True

    def seek(self, pos, whence=0):
        self.pos = {0: pos, 1: self.pos + pos, 2: self.length + pos}[whence]
        return self.pos

    def tell(self):
        return self.pos

    def readinto(self, buf):
        n = max(0, min(len(buf), self.length - self.pos))
        data = os.pread(self.fd, n, self.start + self.pos)
        buf[:len(data)] = data
        self.pos += len(data)
        return len(data)


class TorchFile:
    """A ``torch.save`` archive at bytes ``[start, start + length)`` of ``path`` (the whole
    file by default): ``obj`` is its unpickled content with :class:`LazyTensor` leaves."""

    def __init__(self, path: str | Path, start: int = 0, length: int | None = None, *,
                 fd: int | None = None, **unpickle_kwargs):
        self.path = Path(path)
        self._own_fd = fd is None
        try:
            self.fd = os.open(self.path, os.O_RDONLY) if fd is None else fd
        except OSError as e:
            raise CheckpointError(f"cannot open {self.path}: {e.strerror}") from None
        try:
            size = os.fstat(self.fd).st_size
            self.start = start
            self.length = size - start if length is None else length
            self._entries = self._read_zip()
            self.obj = self._load(unpickle_kwargs)
        except BaseException:
            self.close()
            raise

    def _bad(self, why: str) -> CheckpointError:
        return CheckpointError(f"{self.path} cannot be read safely: {why}")

    def _read_zip(self) -> dict[str, tuple[int, int]]:
        """Entry name -> (absolute offset of its data, size), stored entries only."""
        try:
            archive = zipfile.ZipFile(_Slice(self.fd, self.start, self.length))
        except (zipfile.BadZipFile, OSError, ValueError) as e:
            raise self._bad(f"not a torch.save zip archive ({e})") from None
        entries = {}
        for info in archive.infolist():
            header = os.pread(self.fd, 30, self.start + info.header_offset)
            if len(header) < 30 or header[:4] != b"PK\x03\x04":
                raise self._bad(f"bad zip entry {info.filename!r}")
            name_len, extra_len = struct.unpack("<HH", header[26:30])
            data = self.start + info.header_offset + 30 + name_len + extra_len
            if info.compress_type != zipfile.ZIP_STORED and not info.filename.endswith(".pkl"):
                raise self._bad(f"entry {info.filename!r} is compressed")
            entries[info.filename] = (data, info.file_size, info.compress_type)
        archive.close()
        return entries

    def _load(self, kwargs):
        pkl = [n for n in self._entries if n.endswith("/data.pkl") or n == "data.pkl"]
        if len(pkl) != 1:
            raise self._bad("no data.pkl entry (not written by torch.save)")
        self._prefix = pkl[0][:-len("data.pkl")]
        order = self._entries.get(self._prefix + "byteorder")
        if order is not None and self._raw(order) != b"little":
            raise self._bad("big-endian tensors")
        obj = safe_unpickle(self._raw(self._entries[pkl[0]]), self.path, **kwargs)
        self._bind(obj)
        return obj

    def _raw(self, entry) -> bytes:
        offset, size, compress = entry
        if compress != zipfile.ZIP_STORED:
            raise self._bad("a compressed data.pkl")
        data = os.pread(self.fd, size, offset)
        if len(data) != size:
            raise self._bad("truncated")
        return data

    def _bind(self, obj, depth: int = 0) -> None:
        """Point every LazyTensor of ``obj`` at this file."""
        if depth > 64:
            return
        if isinstance(obj, LazyTensor):
            obj.file = self
        elif isinstance(obj, dict):
            for v in obj.values():
                self._bind(v, depth + 1)
        elif isinstance(obj, (list, tuple)):
            for v in obj:
                self._bind(v, depth + 1)
        elif isinstance(obj, Record):
            for v in vars(obj).values():
                self._bind(v, depth + 1)

    def read_storage(self, storage: StorageRef, offset: int, count: int,
                     out: torch.Tensor | None = None) -> torch.Tensor:
        """``count`` elements of ``storage`` from element ``offset``, read with pread."""
        entry = self._entries.get(f"{self._prefix}data/{storage.key}")
        if entry is None:
            raise self._bad(f"storage {storage.key} is missing")
        item = torch.empty((), dtype=storage.dtype).element_size()
        if offset < 0 or (offset + count) * item > entry[1]:
            raise self._bad(f"elements [{offset}, {offset + count}) outside storage {storage.key}")
        if out is None and count and zerocopy.enabled():
            if getattr(self, "_mm", None) is None:
                self._mm, self._mm_lead = zerocopy.map_file(self.fd, self.start, self.length)
            at = entry[0] - self.start + self._mm_lead + offset * item
            return zerocopy.view_of(self._mm, at, count, storage.dtype)
        if out is None:
            out = torch.empty(count, dtype=storage.dtype)
        if count:
            buf = memoryview(out.reshape(-1).view(torch.uint8).numpy()).cast("B")
            pos, begin = 0, entry[0] + offset * item
            while pos < buf.nbytes:
                got = os.preadv(self.fd, [buf[pos:]], begin + pos)
                if got <= 0:
                    raise self._bad("unexpected end of file (truncated?)")
                pos += got
        return out

    def close(self) -> None:
        if getattr(self, "_mm", None) is not None:
            zerocopy.unmap(self._mm)
            self._mm = None
        if self._own_fd and getattr(self, "fd", None) is not None:
            os.close(self.fd)
        self.fd = None

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
