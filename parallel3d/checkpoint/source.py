"""What every checkpoint source serves: logical tensors by name, any region of them.

A source (a parallel3d checkpoint, a Hugging Face folder, DeepSpeed, torch DCP, Megatron)
names its tensors in parallel3d's terms (``model/<param>``, ``master/<param>``,
``optim/exp_avg/<param>``, ``optim/exp_avg_sq/<param>``, ``<param>`` the name in the
unsplit model) and says its ``model_config``, ``hf_config``, ``step`` and ``trainer``
(``{"step", "optimizer": {"kind", "step", ...}}`` when it holds optimizer state). Readers of
formats that store parameters as flat ranges (ZeRO partitions) implement :meth:`read_flat`;
:class:`Source` derives boxes from it, reading only the rows a box spans.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from parallel3d.errors import UserError

from .errors import CheckpointError, read_json_object
from .format import flat_boxes, intersect


class Source:
    folder = None
    model_config = None
    hf_config: dict | None = None
    step = 0
    trainer: dict | None = None

    # -- what a source implements ----------------------------------------------------------------
    def names(self) -> list[str]:
        raise NotImplementedError

    def spec(self, name: str) -> tuple[tuple[int, ...], torch.dtype]:
        raise NotImplementedError

    def read_flat(self, name: str, lo: int, hi: int) -> torch.Tensor:
        """Elements ``[lo, hi)`` of the row-major flattened tensor (1-D)."""
        raise NotImplementedError

    def close(self) -> None:
        pass

    # -- derived -----------------------------------------------------------------------------------
    def has(self, name: str) -> bool:
        return name in self._name_set()

    def _name_set(self) -> set[str]:
        cached = getattr(self, "_names_cache", None)
        if cached is None:
            cached = self._names_cache = set(self.names())
        return cached

    def check_name(self, name: str) -> None:
        if not self.has(name):
            raise CheckpointError(f"{self.folder} has no tensor {name!r}")

    def read(self, name: str) -> torch.Tensor:
        shape, _ = self.spec(name)
        return self.read_region(name, (0,) * len(shape), shape)

    def read_region(self, name: str, offsets, shape) -> torch.Tensor:
        """The box ``[offsets, offsets + shape)``: the flat span from its first to its last
        row, sliced (one read when the box spans whole trailing dims)."""
        full, _ = self.spec(name)
        offsets, shape = tuple(offsets), tuple(shape)
        if len(shape) != len(full) or any(o < 0 or o + s > f for o, s, f in zip(offsets, shape, full)):
            raise CheckpointError(f"{self.folder}: region {list(offsets)}+{list(shape)} is outside "
                                  f"{name} of shape {list(full)}")
        if not full:
            return self.read_flat(name, 0, 1).reshape(())
        strides = [math.prod(full[d + 1:]) for d in range(len(full))]
        lo = sum(o * s for o, s in zip(offsets, strides))
        hi = sum((o + s - 1) * st for o, s, st in zip(offsets, shape, strides)) + 1 if math.prod(shape) else lo
        span = self.read_flat(name, lo, hi)
        if span.numel() == math.prod(shape):
            return span.reshape(shape)
        return span.as_strided(shape, strides).clone()

    def read_block_flat(self, name: str, block_offsets, block_shape, lo: int, hi: int) -> torch.Tensor:
        """Elements ``[lo, hi)`` of the row-major flattened block ``[block_offsets,
        block_offsets + block_shape)`` (a ZeRO rank's part of a tensor-parallel block);
        elements outside the logical tensor (vocabulary padding) are zero."""
        return block_flat(self, name, block_offsets, block_shape, lo, hi)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def block_flat(source, name: str, block_offsets, block_shape, lo: int, hi: int) -> torch.Tensor:
    """:meth:`Source.read_block_flat` for any object with ``spec`` and ``read_region``."""
    shape, dtype = source.spec(name)
    out = torch.zeros(hi - lo, dtype=dtype)
    whole = ((0,) * len(shape), tuple(shape))
    for start, bshape, pos in flat_boxes(tuple(block_shape), lo, hi):
        goff = tuple(o + s for o, s in zip(block_offsets, start))
        box = intersect(goff, bshape, *whole)
        if box is None:
            continue
        part = source.read_region(name, *box)
        n = math.prod(bshape)
        if box[1] == tuple(bshape):
            out[pos:pos + n] = part.reshape(-1)
        else:
            tmp = torch.zeros(bshape, dtype=dtype)
            tmp[tuple(slice(b - g, b - g + s) for b, g, s in zip(box[0], goff, box[1]))] = part
            out[pos:pos + n] = tmp.reshape(-1)
    return out


def find_config(folder: Path, config: str | Path | None, what: str) -> dict:
    """The Hugging Face config.json given, or beside / above ``folder`` (a foreign
    checkpoint's model description; remote-code configs refused)."""
    candidates = [Path(config)] if config else [folder / "config.json", folder.parent / "config.json"]
    for c in candidates:
        if c.is_file():
            hf = read_json_object(c, "a model config")
            from .foreign.hf import check_no_remote_code

            check_no_remote_code(hf, c)
            return hf
    raise UserError(f"convert: the {what} checkpoint {folder} has no config.json beside or above "
                    "it: give the model's Hugging Face config.json with --config")


def model_config_of(hf: dict, where: Path):
    from parallel3d.models.llama.hf import config_from_hf

    try:
        return config_from_hf(hf)
    except (KeyError, ValueError) as e:
        raise CheckpointError(f"config.json of {where}: {e}") from None
