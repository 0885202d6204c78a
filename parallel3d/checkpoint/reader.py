"""Finding checkpoints and reading any region of their logical tensors.

:class:`CheckpointReader` assembles the region a rank asks for (its tensor-parallel block,
or a flat range of it for a ZeRO shard) from whichever pieces intersect it, reading only
the intersecting bytes of each file. Each file is checked against the size and sha256
recorded in the index before its first byte is used, so a truncated or altered file is
refused with an error naming it, never loaded as garbage.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import torch

from . import zerocopy
from .errors import CheckpointError, read_json_object
from .format import INDEX, LATEST, Index, TensorEntry, check_file_name, intersect
from .safetensors_io import SafetensorsFile, file_sha256
from .source import block_flat
from .zerocopy import Tiles

_STEP_DIR = re.compile(r"^step_(\d{8,})$")


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def complete_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """``(step, folder)`` of every finished checkpoint under ``root``, oldest first.
    Temporary folders of interrupted saves (``step_*.tmp-*``) never match."""
    if not root.is_dir():
        return []
    out = []
    for p in root.iterdir():
        m = _STEP_DIR.match(p.name)
        if m and p.is_dir() and (p / INDEX).is_file():
            out.append((int(m.group(1)), p))
    return sorted(out)


def read_latest(root: Path) -> Path | None:
    """The folder ``root/latest`` points at, if the pointer exists."""
    pointer = root / LATEST
    if not pointer.is_file():
        return None
    try:
        text = pointer.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{pointer} cannot be read as a checkpoint name: {e}") from None
    name = check_file_name(text.strip(), str(pointer))
    folder = root / name
    if not (folder / INDEX).is_file():
        raise CheckpointError(f"{pointer} points at {name}, which is not a complete checkpoint")
    return folder


def find_checkpoint(path: Path) -> Path | None:
    """A checkpoint folder from ``path``: the folder itself if it holds an index, else the
    one its ``latest`` points at, else its newest complete checkpoint; None if none."""
    if (path / INDEX).is_file():
        return path
    latest = read_latest(path)
    if latest is not None:
        return latest
    found = complete_checkpoints(path)
    return found[-1][1] if found else None


def model_config_from_identity(model: dict, where: Path):
    """The :class:`LlamaConfig` recorded in an index."""
    from dataclasses import fields

    from parallel3d.models.llama import LlamaConfig

    known = {f.name for f in fields(LlamaConfig)}
    unknown = sorted(set(model) - known)
    if unknown:
        raise CheckpointError(f"{where} records model fields {unknown} that this parallel3d does not know")
    values = dict(model)
    if "rope_scaling" in values:
        values["rope_scaling"] = tuple(tuple(kv) for kv in values["rope_scaling"])
    return LlamaConfig(**values)


class CheckpointReader:
    """Random access to the logical tensors of one checkpoint folder.

    ``verify=True`` checks each file's size and sha256 on first use (sha256 reads the whole
    file once, about 1 s per GB); ``verify=False`` checks sizes only.
    """

    def __init__(self, folder: str | Path, verify: bool = True):
        self.folder = Path(folder)
        self.index = Index.read(self.folder)
        self.verify = verify
        self._open: dict[str, SafetensorsFile] = {}
        self._checked: set[str] = set()
        self._hashed: set[str] = set()  # sha256 checked by some rank (verify_shared)

    # -- files -----------------------------------------------------------------------------
    def _path(self, name: str) -> Path:
        check_file_name(name, str(self.folder / INDEX))
        path = self.folder / name
        if path.is_symlink() and path.resolve().parent != self.folder.resolve():
            raise CheckpointError(f"{path} is a link out of the checkpoint folder: refusing to read it")
        return path

    def check_file(self, name: str) -> Path:
        """Refuse ``name`` unless its size (and sha256) equal the index's record."""
        path = self._path(name)
        if name in self._checked:
            return path
        rec = self.index.files[name]
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            raise CheckpointError(f"{path} is missing (listed in {INDEX})") from None
        if size != rec["size"]:
            raise CheckpointError(f"{path} has {size} bytes but {INDEX} records {rec['size']}: "
                                  "the file is truncated or altered; refusing to load it")
        if self.verify and name not in self._hashed:
            _, digest = file_sha256(path)
            if digest != rec["sha256"]:
                raise CheckpointError(f"{path} does not match the sha256 recorded in {INDEX}: "
                                      "the file is corrupted or altered; refusing to load it")
        self._checked.add(name)
        return path

    def _file(self, name: str) -> SafetensorsFile:
        f = self._open.get(name)
        if f is None:
            f = self._open[name] = SafetensorsFile(self.check_file(name))
        return f

    def rank_meta(self, rank: int) -> dict | None:
        """The per-rank JSON (RNG states) that ``rank`` saved, if any."""
        name = self.index.ranks.get(str(rank))
        if name is None:
            return None
        path = self.check_file(name)
        return read_json_object(path, "the JSON file of a rank")

    # -- tensors ---------------------------------------------------------------------------
    def has(self, name: str) -> bool:
        return name in self.index.tensors

    def entry(self, name: str) -> TensorEntry:
        if name not in self.index.tensors:
            raise CheckpointError(f"{self.folder} has no tensor {name!r}")
        return self.index.tensors[name]

    def names(self, prefix: str = "") -> list[str]:
        return [n for n in self.index.tensors if n.startswith(prefix)]

    def spec(self, name: str) -> tuple[tuple[int, ...], torch.dtype]:
        e = self.entry(name)
        return e.shape, e.dtype

    @property
    def model_config(self):
        return model_config_from_identity(self.index.model, self.folder)

    @property
    def hf_config(self) -> dict | None:
        return self.index.hf_config

    @property
    def step(self) -> int:
        return self.index.step

    @property
    def trainer(self) -> dict | None:
        return self.index.trainer

    def read(self, name: str) -> torch.Tensor:
        e = self.entry(name)
        return self.read_region(name, (0,) * len(e.shape), e.shape)

    def read_region(self, name: str, offsets, shape) -> torch.Tensor:
        """The box ``[offsets, offsets + shape)`` of logical tensor ``name``."""
        e = self.entry(name)
        offsets, shape = tuple(offsets), tuple(shape)
        if len(shape) != len(e.shape) or any(o < 0 or o + s > f for o, s, f in zip(offsets, shape, e.shape)):
            raise CheckpointError(f"{self.folder}: region {list(offsets)}+{list(shape)} is outside "
                                  f"{name} of shape {list(e.shape)}")
        out = torch.empty(shape, dtype=e.dtype)
        covered = 0
        for piece in e.pieces:
            for goff, bshape, flat_start in piece.regions():
                box = intersect(goff, bshape, offsets, shape)
                if box is None:
                    continue
                inner = tuple(b - g for b, g in zip(box[0], goff))
                f = self._file(piece.file)
                view = {} if flat_start is None else {"view_shape": bshape, "flat_start": flat_start}
                if box[1] == shape:  # one piece holds the whole region
                    return f.read_box(piece.key, inner, box[1], **view)
                dest = out[tuple(slice(b - o, b - o + s) for b, o, s in zip(box[0], offsets, box[1]))]
                if dest.is_contiguous():  # read straight into place: no second copy
                    f.read_box(piece.key, inner, box[1], out=dest, **view)
                else:
                    part = f.read_box(piece.key, inner, box[1], **view)
                    dest.copy_(part)
                    zerocopy.release(part)
                covered += math.prod(box[1])
        if covered != math.prod(shape):
            raise CheckpointError(f"{self.folder}: only {covered} of {math.prod(shape)} elements of "
                                  f"{name} region {list(offsets)}+{list(shape)} are stored "
                                  "(a rank's file is missing from the index?)")
        return out

    def read_tiles(self, name: str) -> Tiles | None:
        """Zero-copy conversion (:mod:`.zerocopy`): the tensor as its pieces, when they tile
        it along one dim (a column-parallel weight or a vocabulary-parallel embedding by rows,
        a row-parallel one by columns), each piece read whole (a view of its file); None
        otherwise (flat ZeRO pieces, a split along two dims, one piece)."""
        e = self.entry(name)
        if not zerocopy.enabled() or not e.shape or len(e.pieces) < 2 or any(p.flat is not None for p in e.pieces):
            return None
        split = {d for p in e.pieces for d, (b, s) in enumerate(zip(p.block, e.shape)) if b != s}
        if len(split) != 1:
            return None
        dim = split.pop()
        at, parts = 0, []
        for p in sorted(e.pieces, key=lambda p: p.offsets[dim]):
            if p.offsets[dim] != at or any(o for d, o in enumerate(p.offsets) if d != dim) or at >= e.shape[dim]:
                for t in parts:
                    zerocopy.release(t)
                return None
            box = tuple(min(b, s - at) if d == dim else s for d, (b, s) in enumerate(zip(p.block, e.shape)))
            parts.append(self._file(p.file).read_box(p.key, (0,) * len(e.shape), box))
            at += box[dim]
        if at != e.shape[dim]:
            for t in parts:
                zerocopy.release(t)
            return None
        return Tiles(dim, parts, e.shape, e.dtype)

    def read_block_flat(self, name: str, block_offsets, block_shape, lo: int, hi: int) -> torch.Tensor:
        """Elements ``[lo, hi)`` of the row-major flattened block ``[block_offsets,
        block_offsets + block_shape)`` (what a ZeRO rank owns of a parameter). Elements of
        the block outside the logical tensor (vocabulary padding) are zero."""
        self.entry(name)
        return block_flat(self, name, block_offsets, block_shape, lo, hi)

    def verify_hashes(self) -> None:
        """Check every file's sha256 against the index, whatever was checked before (what
        a conversion that opened with ``verify=False`` runs beside its reads)."""
        for name, rec in self.index.files.items():
            path = self._path(name)
            _, digest = file_sha256(path)
            if digest != rec["sha256"]:
                raise CheckpointError(f"{path} does not match the sha256 recorded in {INDEX}: "
                                      "the file is corrupted or altered; refusing to load it")

    def verify_shared(self, rank: int, world_size: int, group=None) -> None:
        """Check every file once among ``world_size`` ranks, before any is used: rank r
        hashes the files ``sorted(names)[r::world_size]`` (size and sha256), then the ranks
        exchange what they found over ``group`` (a gloo group; all_gather_object) and every
        rank raises the same :class:`CheckpointError` if any file failed. Afterwards a
        rank's reads check sizes only. Each file is hashed once in the world instead of by
        every rank that reads it (at dp 64 a replicated file was hashed 64 times); the
        ranks must see the same folder (a shared filesystem, as the writer requires)."""
        names = sorted(self.index.files)
        error = None
        if self.verify:
            for name in names[rank::world_size]:
                try:
                    self.check_file(name)
                except CheckpointError as e:
                    error = str(e)
                    break
        found = [error]
        if group is not None and world_size > 1:
            import torch.distributed as dist

            found = [None] * world_size
            dist.all_gather_object(found, error, group=group)
        bad = next((e for e in found if e), None)
        if bad is not None:
            raise CheckpointError(bad)
        self._hashed.update(names)

    def verify_all(self) -> None:
        """Check every file of the checkpoint (size and sha256)."""
        for name in self.index.files:
            self.check_file(name)

    def close(self) -> None:
        for f in self._open.values():
            f.close()
        self._open.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
