"""The ``.metadata`` file of a DCP folder, written without importing
``torch.distributed.checkpoint``.

DCP defines ``.metadata`` as ``pickle.dump`` of its ``Metadata`` dataclass. Importing that
package to build the objects costs 0.6 s of CPU (it brings FSDP, DTensor and the planners),
a fifth of a naive 2 GB load-and-save, for a file of a few kB. The pickle only names the
classes (module and qualified name) and stores their state, so this module pickles
stand-ins that reduce exactly as torch's classes do (a dataclass: ``NEWOBJ`` then its
``__dict__``; ``TensorProperties``: its ``__getstate__`` tuple; ``_StorageInfo``: its
non-None fields; the memory-format enum: ``(cls, (value,))``), naming torch's modules.
``tests/test_checkpoint_writing.py`` checks the bytes equal ``pickle.dumps`` of the same
metadata built from torch's own classes.
"""

from __future__ import annotations

import copyreg
import io
import pickle

import torch

_META = "torch.distributed.checkpoint.metadata"
_FS = "torch.distributed.checkpoint.filesystem"


class _Stand:
    """An instance pickled as one of torch's DCP dataclasses (class named by
    ``module`` / ``qualname``; state: the fields as that class's ``__dict__`` holds them)."""

    module = _META
    qualname = "?"

    def __init__(self, **fields):
        self.fields = fields

    def __reduce_ex__(self, protocol):
        return copyreg.__newobj__, (type(self),), self.state()

    def state(self):
        return dict(self.fields)


def _class(qualname: str, module: str = _META, state=None) -> type:
    body = {"qualname": qualname, "module": module}
    if state is not None:
        body["state"] = state
    return type(qualname, (_Stand,), body)


Metadata = _class("Metadata")
StorageMeta = _class("StorageMeta")
TensorStorageMetadata = _class("TensorStorageMetadata")
ChunkStorageMetadata = _class("ChunkStorageMetadata")
MetadataIndex = _class("MetadataIndex")
# its __getstate__: (dtype, layout, requires_grad, memory-format encoding, pin_memory)
TensorProperties = _class("TensorProperties", state=lambda self: tuple(self.fields.values()))
# its __getstate__ leaves out fields that are None (transform_descriptors)
StorageInfo = _class("_StorageInfo", _FS, lambda self: {k: v for k, v in self.fields.items() if v is not None})
_MemFormat = _class("_MEM_FORMAT_ENCODING")


class _Contiguous:
    """``_MEM_FORMAT_ENCODING.TORCH_CONTIGUOUS_FORMAT`` (an Enum member: ``(cls, (0,))``)."""

    def __reduce_ex__(self, protocol):
        return _MemFormat, (0,)


_CONTIGUOUS = _Contiguous()  # one member, memoized as the real singleton is


class _Pickler(pickle._Pickler):
    """The pure-Python pickler (which lets a class be named without importing it), with
    the stand-in classes written as the globals they stand for."""

    def save_global(self, obj, name=None):
        if isinstance(obj, type) and issubclass(obj, _Stand):
            self.save(obj.module)
            self.save(obj.qualname)
            self.write(pickle.STACK_GLOBAL)
            self.memoize(obj)
            return
        super().save_global(obj, name)


def tensor_properties(dtype: torch.dtype) -> TensorProperties:
    """``TensorProperties(dtype=dtype)``: strided, no grad, contiguous, not pinned."""
    return TensorProperties(dtype=dtype, layout=torch.strided, requires_grad=False,
                            memory_format=_CONTIGUOUS, pin_memory=False)


def metadata_bytes(records: list[tuple[str, str, torch.Size, torch.dtype, int, int]], checkpoint_id: str,
                   save_id: str) -> bytes:
    """``pickle.dumps`` of the ``Metadata`` of whole tensors, one chunk each:
    ``records`` are (key, file, shape, dtype, byte offset, length), built as
    ``dcp_write.write_metadata`` would build torch's objects."""
    state, storage, planner = {}, {}, {}
    for key, file, shape, dtype, start, length in records:
        zeros = torch.Size([0] * len(shape))
        state[key] = TensorStorageMetadata(properties=tensor_properties(dtype), size=torch.Size(shape),
                                           chunks=[ChunkStorageMetadata(offsets=zeros, sizes=torch.Size(shape))])
        # MetadataIndex.__init__ sets fqn, index, then offset (as torch.Size(offset))
        storage[MetadataIndex(fqn=key, index=None, offset=torch.Size(zeros))] = StorageInfo(
            relative_path=file, offset=start, length=length, transform_descriptors=None)
        planner[key] = (key,)
    meta = Metadata(state_dict_metadata=state, planner_data=planner, storage_data=storage,
                    storage_meta=StorageMeta(checkpoint_id=checkpoint_id, save_id=save_id, load_id=None,
                                             modules=[]),
                    version="1.0.0")
    buf = io.BytesIO()
    _Pickler(buf, protocol=pickle.DEFAULT_PROTOCOL).dump(meta)
    return buf.getvalue()
