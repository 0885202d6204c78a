"""The on-disk format: a global index of logical tensors, each assembled from pieces.

A checkpoint is one folder (``step_00000010/``) holding safetensors files written by the
ranks, small per-rank JSON files (RNG states), and ``index.json``, written last::

    {"format": "parallel3d-checkpoint", "version": 1, "step": 10,
     "model": {...LlamaConfig fields...}, "config": {...job config...},
     "layout": {"tp": 2, "pp": 2, "dp": 2, "zero": 2, "world_size": 8},
     "trainer": {"step": 10, "sampler": {...}, "optimizer": {"step": 10}},
     "files": {"rank_00003.safetensors": {"size": 123, "sha256": "..."}, ...},
     "ranks": {"3": "rank_00003.json", ...},
     "tensors": {"model/layers.0.mlp.up_proj.weight": {
         "shape": [352, 128], "dtype": "F32",
         "pieces": [{"file": "rank_00000.safetensors", "key": "...",
                     "offsets": [0, 0], "block": [176, 128], "flat": [0, 11264]}, ...]}}}

The piece model. A rank holds a *block* of each logical tensor: the box
``[offsets, offsets + block)`` (its tensor-parallel shard; the whole tensor when it is
not split). A block may reach past the logical shape (vocabulary padding: those elements
are not part of the tensor). A piece stores either the block itself (clipped to the
logical shape) or, with ``flat = [lo, hi)``, elements ``lo..hi-1`` of the row-major
flattened block: what a ZeRO rank owns of a parameter is such a range. A flat range is
read as at most ``2*ndim - 1`` boxes (:func:`flat_boxes`), so any region of any tensor
can be assembled from any mix of pieces by box intersection, reading only the bytes that
intersect.

Logical tensor names: ``model/<param>`` (the weights in their training dtype),
``master/<param>`` (fp32 master weights, only when they are not the parameters),
``optim/exp_avg/<param>``, ``optim/exp_avg_sq/<param>``. ``<param>`` is the name in the
unsplit model, so every layout agrees on it.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from .errors import CheckpointError, read_json_object
from .safetensors_io import DTYPES, dtype_code

FORMAT = "parallel3d-checkpoint"
VERSION = 1
INDEX = "index.json"
LATEST = "latest"

Box = tuple[tuple[int, ...], tuple[int, ...]]


def flat_boxes(shape: tuple[int, ...], lo: int, hi: int) -> list[tuple[tuple[int, ...], tuple[int, ...], int]]:
    """Cover elements ``[lo, hi)`` of a row-major ``shape`` with boxes, in flat order.

    Returns ``(start, box_shape, pos)`` triples: the box ``[start, start + box_shape)``
    holds flat elements ``[lo + pos, lo + pos + numel(box))``, contiguous and in order.
    """
    out: list[tuple[tuple[int, ...], tuple[int, ...], int]] = []

    def cover(prefix: tuple[int, ...], dims: tuple[int, ...], a: int, b: int) -> None:
        if len(dims) == 1:
            out.append((prefix + (a,), (b - a,), 0))
            return
        inner = math.prod(dims[1:])
        r0, r1 = a // inner, b // inner
        if r0 == r1:  # inside one row
            row(prefix, dims, r0, a - r0 * inner, b - r0 * inner)
            return
        if a % inner:  # the tail of a first, partial row
            row(prefix, dims, r0, a % inner, inner)
            r0 += 1
        if r1 > r0:  # whole rows
            out.append((prefix + (r0,) + (0,) * (len(dims) - 1), (r1 - r0,) + dims[1:], 0))
        if b % inner:  # the head of a last, partial row
            row(prefix, dims, r1, 0, b % inner)

    def row(prefix, dims, r, a, b):
        start = len(out)
        cover(prefix + (r,), dims[1:], a, b)
        for i in range(start, len(out)):  # boxes of the row get size 1 along this dim
            s, shp, p = out[i]
            out[i] = (s, (1,) + shp, p)

    if lo < hi:
        if not shape:
            out.append(((), (), 0))
        else:
            cover((), tuple(shape), lo, hi)
    pos = 0
    for i, (s, shp, _) in enumerate(out):
        out[i] = (s, shp, pos)
        pos += math.prod(shp)
    assert pos == hi - lo, (shape, lo, hi, out)
    return out


def intersect(a_off, a_shape, b_off, b_shape) -> Box | None:
    """The intersection of boxes a and b, or None if empty."""
    lo = tuple(max(x, y) for x, y in zip(a_off, b_off))
    hi = tuple(min(x + s, y + t) for x, s, y, t in zip(a_off, a_shape, b_off, b_shape))
    if any(h <= l for l, h in zip(lo, hi)):
        return None
    return lo, tuple(h - l for l, h in zip(lo, hi))


@dataclass(frozen=True)
class Piece:
    """Part of a logical tensor stored as tensor ``key`` of ``file`` (see module docstring)."""

    file: str
    key: str
    offsets: tuple[int, ...]
    block: tuple[int, ...]
    flat: tuple[int, int] | None = None

    def regions(self) -> list[tuple[tuple[int, ...], tuple[int, ...], int | None]]:
        """``(global_offsets, box_shape, flat_start)``: the boxes of the logical tensor this
        piece stores. ``flat_start`` is None for a stored block (read the box directly at
        ``global_offsets - offsets``), else the index in the stored 1-D tensor where the
        box's elements start (row-major within the box)."""
        if self.flat is None:
            return [(self.offsets, self.block, None)]
        lo, hi = self.flat
        return [(tuple(o + s for o, s in zip(self.offsets, start)), shape, pos)
                for start, shape, pos in flat_boxes(self.block, lo, hi)]

    def to_json(self) -> dict:
        d = {"file": self.file, "key": self.key, "offsets": list(self.offsets), "block": list(self.block)}
        if self.flat is not None:
            d["flat"] = list(self.flat)
        return d

    @classmethod
    def from_json(cls, d: dict) -> "Piece":
        flat = d.get("flat")
        return cls(d["file"], d["key"], tuple(int(x) for x in d["offsets"]),
                   tuple(int(x) for x in d["block"]), tuple(int(x) for x in flat) if flat else None)


@dataclass
class TensorEntry:
    shape: tuple[int, ...]
    dtype: torch.dtype
    pieces: list[Piece]

    def to_json(self) -> dict:
        return {"shape": list(self.shape), "dtype": dtype_code(self.dtype),
                "pieces": [p.to_json() for p in self.pieces]}

    def covered_numel(self) -> int:
        """Elements of the logical tensor the pieces hold (pieces never overlap: each
        element is written by exactly one rank)."""
        whole = (tuple(0 for _ in self.shape), self.shape)
        n = 0
        for piece in self.pieces:
            for off, shape, _ in piece.regions():
                box = intersect(off, shape, *whole)
                n += math.prod(box[1]) if box else 0
        return n if self.shape else min(n, 1)


def check_file_name(name: str, where: str) -> str:
    """A file named by an index must be a plain name inside the checkpoint folder."""
    if not isinstance(name, str) or not name or "/" in name or "\\" in name or name in (".", "..") \
            or name.startswith("."):
        raise CheckpointError(f"{where} names the file {name!r}: only plain file names inside "
                              "the checkpoint folder are allowed")
    return name


# -- model identity ---------------------------------------------------------------------------
# Fields of the model config that the weights depend on (init_std only shapes a fresh
# initialisation; max_seq_len only bounds the sequence length).
_IDENTITY_SKIP = {"init_std", "max_seq_len"}


def model_identity(cfg) -> dict:
    """The model config as it reads back from JSON (tuples become lists, the MoE section a
    dict), every field; see :func:`check_same_model`."""
    return json.loads(json.dumps(asdict(cfg)))


def check_same_model(saved: dict, ours: dict, path: Path) -> None:
    """Refuse a checkpoint of another model, naming each field that differs."""
    diffs = []
    for key in sorted(set(saved) | set(ours)):
        if key in _IDENTITY_SKIP:
            continue
        a, b = saved.get(key), ours.get(key)
        if key not in saved and not b:
            continue  # a field added since the checkpoint was written, at its "off" value
        if a != b and not (isinstance(a, (int, float)) and isinstance(b, (int, float)) and float(a) == float(b)):
            diffs.append(f"{key} {a!r} in the checkpoint vs {b!r} here")
    if diffs:
        raise CheckpointError(f"{path} holds a different model: {'; '.join(diffs)} "
                              "(use the checkpoint's model.* settings, another checkpoint, or "
                              "checkpoint.resume=never to start fresh)")


# -- the index file ---------------------------------------------------------------------------
@dataclass
class Index:
    step: int
    model: dict
    tensors: dict[str, TensorEntry]
    files: dict[str, dict]
    ranks: dict[str, str]
    layout: dict
    trainer: dict | None = None
    config: dict | None = None
    hf_config: dict | None = None

    def to_json(self) -> dict:
        return {"format": FORMAT, "version": VERSION, "step": self.step, "layout": self.layout,
                "model": self.model, "config": self.config, "hf_config": self.hf_config,
                "trainer": self.trainer, "files": self.files, "ranks": self.ranks,
                "tensors": {k: v.to_json() for k, v in sorted(self.tensors.items())}}

    def write(self, path: Path) -> None:
        text = json.dumps(self.to_json(), indent=1)
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())

    @classmethod
    def read(cls, folder: Path) -> "Index":
        path = folder / INDEX
        try:
            data = read_json_object(path, "a checkpoint index")
        except FileNotFoundError:
            raise CheckpointError(f"{folder} is not a parallel3d checkpoint: no {INDEX} "
                                  "(an interrupted save leaves no index)") from None
        try:
            return cls._parse(data, path)
        except (KeyError, TypeError, ValueError) as e:
            if isinstance(e, CheckpointError):
                raise
            raise CheckpointError(f"{path} is malformed: {type(e).__name__} {e}") from None

    @classmethod
    def _parse(cls, data: dict, path: Path) -> "Index":
        if data.get("format") != FORMAT:
            raise CheckpointError(f"{path} is not a parallel3d checkpoint index (format {data.get('format')!r})")
        if data.get("version") != VERSION:
            raise CheckpointError(f"{path} has format version {data.get('version')}; this "
                                  f"parallel3d reads version {VERSION}")
        files = {check_file_name(k, str(path)): v for k, v in data["files"].items()}
        for rec in files.values():
            if not isinstance(rec.get("size"), int) or not isinstance(rec.get("sha256"), str):
                raise CheckpointError(f"{path}: file record {rec!r} lacks size or sha256")
        tensors = {}
        for name, t in data["tensors"].items():
            if t["dtype"] not in DTYPES:
                raise CheckpointError(f"{path}: tensor {name} has unknown dtype {t['dtype']!r}")
            shape = tuple(int(s) for s in t["shape"])
            pieces = [Piece.from_json(p) for p in t["pieces"]]
            for p in pieces:
                if p.file not in files:
                    raise CheckpointError(f"{path}: tensor {name} names {p.file!r}, which the index does not list")
                if len(p.offsets) != len(shape) or len(p.block) != len(shape):
                    raise CheckpointError(f"{path}: a piece of {name} has the wrong rank for shape {list(shape)}")
                if p.flat is not None and not 0 <= p.flat[0] <= p.flat[1] <= math.prod(p.block):
                    raise CheckpointError(f"{path}: a piece of {name} has flat range {p.flat} outside its block")
            tensors[name] = TensorEntry(shape, DTYPES[t["dtype"]], pieces)
        ranks = {str(k): check_file_name(v, str(path)) for k, v in (data.get("ranks") or {}).items()}
        return cls(step=int(data["step"]), model=data["model"], tensors=tensors, files=files,
                   ranks=ranks, layout=data.get("layout") or {}, trainer=data.get("trainer"),
                   config=data.get("config"), hf_config=data.get("hf_config"))

