"""One rank's files in a checkpoint folder, and rank 0's index merged from every rank's.

Each rank writes ``rank_RRRRR.safetensors`` (its slots, tensor by tensor, hashed as they
are written) and ``rank_RRRRR.json`` (its metadata), and returns their records: sizes and
sha256 of the files, and the pieces of each logical tensor it holds. :func:`build_index`
merges every rank's records into the :class:`.format.Index` and refuses a logical tensor
the pieces do not cover exactly. The protocol around them (room, waits, rename,
``latest``) is :mod:`.save`'s.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .errors import CheckpointError
from .format import Index, Piece, TensorEntry
from .safetensors_io import StreamingWriter
from .state import Slot, clip_to_shape


@dataclass
class RankPayload:
    """Everything one rank writes for one checkpoint (tensors already snapshotted)."""

    step: int
    rank: int
    slots: list[Slot]
    meta: dict  # per-rank JSON: RNG states, coordinates
    index_fields: dict = field(default_factory=dict)  # rank 0: model, config, trainer, layout


def rank_file_names(rank: int) -> tuple[str, str]:
    """(tensor file, metadata file) that ``rank`` writes into a checkpoint folder."""
    stem = f"rank_{rank:05d}"
    return f"{stem}.safetensors", f"{stem}.json"


def rank_file_sizes(payload: RankPayload) -> list[int]:
    """The sizes of the files :func:`write_rank_files` will write (its safetensors header
    estimated generously), known before writing anything."""
    tensor_bytes = sum(s.tensor.numel() * s.tensor.element_size() for s in payload.slots)
    sizes = [len(json.dumps(payload.meta).encode("utf-8"))]
    if payload.slots:
        sizes.append(8 + 64 + 256 * len(payload.slots) + tensor_bytes)
    return sizes


# A test seam, as ``save._phase`` is: called before each tensor is written; the
# kill-mid-save test replaces it to stop the process half-way. A no-op otherwise.
def _phase(name: str) -> None:
    pass


def write_rank_files(folder: Path, payload: RankPayload) -> dict:
    """Write this rank's tensors and metadata into ``folder``; returns its records:
    ``{"files": {name: {size, sha256}}, "tensors": {name: (shape, dtype, [piece json])},
    "rank_file": name}``."""
    tensor_file, meta_file = rank_file_names(payload.rank)
    specs, data, tensors = [], [], {}
    for slot in payload.slots:
        pl = slot.placement
        if slot.flat is None:
            t = clip_to_shape(slot.tensor, pl)
            piece = Piece(tensor_file, slot.name, pl.offsets, tuple(t.shape))
        else:
            t = slot.tensor.reshape(-1)
            piece = Piece(tensor_file, slot.name, pl.offsets, pl.block, slot.flat)
            assert t.numel() == slot.flat[1] - slot.flat[0], (slot.name, slot.flat, t.numel())
        key = slot.name if slot.name not in {k for k, _, _ in specs} else f"{slot.name}#{len(specs)}"
        piece = Piece(piece.file, key, piece.offsets, piece.block, piece.flat)
        specs.append((key, t.dtype, tuple(t.shape)))
        data.append((key, t))
        rec = tensors.setdefault(slot.name, [list(pl.shape), str(t.dtype).removeprefix("torch."), []])
        rec[2].append(piece.to_json())
    files = {}
    if specs:
        writer = StreamingWriter(folder / tensor_file, specs, metadata={"format": "parallel3d"})
        try:
            for key, t in data:
                _phase("write_tensor")
                writer.write(key, t)
        except BaseException:
            writer.abort()
            raise
        size, sha = writer.close()
        files[tensor_file] = {"size": size, "sha256": sha}
    text = json.dumps(payload.meta)
    with open(folder / meta_file, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    raw = text.encode("utf-8")
    files[meta_file] = {"size": len(raw), "sha256": hashlib.sha256(raw).hexdigest()}
    return {"files": files, "tensors": tensors, "rank_file": meta_file}


def build_index(step: int, records: list[dict], fields: dict) -> Index:
    """Merge the ranks' records into the index; every logical tensor must be covered."""
    tensors: dict[str, TensorEntry] = {}
    files: dict[str, dict] = {}
    ranks: dict[str, str] = {}
    for rank, rec in enumerate(records):
        files.update(rec["files"])
        ranks[str(rank)] = rec["rank_file"]
        for name, (shape, dtype, pieces) in rec["tensors"].items():
            entry = tensors.get(name)
            if entry is None:
                entry = tensors[name] = TensorEntry(tuple(shape), getattr(torch, dtype), [])
            elif list(entry.shape) != list(shape) or entry.dtype != getattr(torch, dtype):
                raise CheckpointError(f"ranks disagree on the shape or dtype of {name}")
            entry.pieces += [Piece.from_json(p) for p in pieces]
    for name, entry in tensors.items():
        have, want = entry.covered_numel(), 1
        for s in entry.shape:
            want *= s
        if have != want:
            raise CheckpointError(f"internal error: the ranks' pieces of {name} hold {have} of "
                                  f"{want} elements (overlapping or missing shards)")
    return Index(step=step, model=fields["model"], tensors=tensors, files=files, ranks=ranks,
                 layout=fields.get("layout", {}), trainer=fields.get("trainer"),
                 config=fields.get("config"), hf_config=fields.get("hf_config"))
