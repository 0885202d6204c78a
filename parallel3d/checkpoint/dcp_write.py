"""Writing a torch DCP folder that ``torch.distributed.checkpoint.load`` reads into a Hugging
Face ``LlamaForCausalLM`` (or the same model wrapped by FSDP2, which keeps its keys).

The folder is what ``dcp.save(model.state_dict(), checkpoint_id=DST)`` writes from one
rank: each tensor whole, as one chunk (a ``torch.save`` archive appended to a
``__0_<i>.distcp`` file), keys in Hugging Face's state-dict naming, and ``.metadata``
(torch's ``Metadata`` dataclasses, pickled: the one file DCP defines that way). Loading
reshards: an FSDP2 model reads its own rows of each chunk. Files are hashed as they are
written (:class:`~parallel3d.checkpoint.safetensors_io.HashedFile`); ``CRC32SUMS`` records them.
"""

from __future__ import annotations

import os
import pickle
import uuid
from pathlib import Path

import torch

from .safetensors_io import HashedFile

METADATA = ".metadata"


class DCPFileWriter:
    """One ``.distcp`` file: tensors appended as ``torch.save`` archives."""

    def __init__(self, folder: Path, name: str, algorithm: str = "sha256"):
        self.name = name
        self.file = HashedFile(folder / name, algorithm)
        self.records: list[tuple[str, torch.Tensor, int, int]] = []  # key, meta tensor, offset, length

    def write(self, key: str, tensor: torch.Tensor) -> None:
        start = self.file.size
        torch.save(tensor.contiguous(), self.file)
        self.records.append((key, torch.empty(tensor.shape, dtype=tensor.dtype, device="meta"),
                             start, self.file.size - start))

    def close(self) -> tuple[int, str]:
        return self.file.close()


def write_metadata(folder: Path, writers: list[DCPFileWriter]) -> None:
    """``.metadata`` for the tensors the writers wrote (each whole, one chunk)."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, MetadataIndex,
                                                       StorageMeta, TensorProperties,
                                                       TensorStorageMetadata)

    state, storage, planner = {}, {}, {}
    for w in writers:
        for key, meta, start, length in w.records:
            zeros = torch.Size([0] * meta.ndim)
            state[key] = TensorStorageMetadata(TensorProperties(dtype=meta.dtype), meta.shape,
                                               [ChunkStorageMetadata(zeros, meta.shape)])
            storage[MetadataIndex(key, zeros)] = _StorageInfo(w.name, start, length)
            planner[key] = (key,)
    metadata = Metadata(state_dict_metadata=state, planner_data=planner, storage_data=storage,
                        storage_meta=StorageMeta(checkpoint_id=str(folder), save_id=str(uuid.uuid4())),
                        version="1.0.0")
    tmp = folder / (METADATA + ".tmp")
    with open(tmp, "wb") as f:
        pickle.dump(metadata, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, folder / METADATA)
