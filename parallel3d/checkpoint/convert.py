"""``parallel3d convert SRC DST --to {hf,parallel3d}``: streaming, verified conversion.

SRC is recognised by what it holds: a Hugging Face folder (``config.json`` + safetensors),
a parallel3d checkpoint (``index.json``, or a checkpoints folder with ``latest``) at any
layout, or a DeepSpeed checkpoint (``latest`` + ``<tag>/mp_rank_00_model_states.pt``, ZeRO
stages 0 to 2). Every source serves logical tensors (``model/<name>``, and for training
checkpoints ``master/``, ``optim/exp_avg/``, ``optim/exp_avg_sq/``) by region, so the
conversion reads, casts and writes one tensor at a time: peak memory stays near the
largest tensor, whatever the model size. After writing, every tensor is read back from
DST and compared with SRC in chunks of at most 64 MiB (bit for bit, after the cast), and
for a parallel3d DST every file's sha256 is checked.
"""

from __future__ import annotations

import math
import os
import shutil
import sys
import time
from pathlib import Path

import torch

from parallel3d.errors import UserError

from .errors import CheckpointError
from .format import INDEX, LATEST, Index, Piece, TensorEntry, model_identity
from .hf import HFFolder, is_hf_folder, plan_shards, write_hf_folder
from .reader import CheckpointReader, find_checkpoint, step_dir_name
from .safetensors_io import StreamingWriter

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_VERIFY_CHUNK = 64 * 2**20


def open_source(path: str | Path, config: str | Path | None = None):
    """The source at ``path`` (see the module docstring), or a one-line UserError."""
    path = Path(path)
    if not path.is_dir():
        raise UserError(f"convert: {path} is not a folder")
    if config is not None and not Path(config).is_file():
        raise UserError(f"convert --config '{config}' is not a file: give the model's config.json")
    from .deepspeed import find_deepspeed_dir

    ds = None if is_hf_folder(path) else find_deepspeed_dir(path)
    if ds is not None:
        from .deepspeed import DeepSpeedCheckpoint

        return DeepSpeedCheckpoint(ds, config)
    if config is not None:
        raise UserError(f"convert --config is for a DeepSpeed source; {path} carries its own "
                        "model config: leave --config out")
    if is_hf_folder(path):
        return HFFolder(path)
    found = find_checkpoint(path)  # a broken ``latest`` is this folder's error, said as such
    if found is not None:
        return CheckpointReader(found)
    if (path / "config.json").is_file():
        return HFFolder(path)  # a model folder without usable weights: its own clear error
    raise UserError(f"convert: {path} is neither a Hugging Face folder (config.json + "
                    "model.safetensors[.index.json]), a parallel3d checkpoint (index.json or "
                    "latest) nor a DeepSpeed checkpoint (latest + mp_rank_00_model_states.pt)")


class Progress:
    """Bytes done of a total: a tqdm bar on a terminal, else a line per 10%."""

    def __init__(self, total: int, what: str, enabled: bool = True):
        self.total, self.done, self.what, self.enabled = max(total, 1), 0, what, enabled
        self.bar, self._next, self._t0 = None, 0.1, time.monotonic()
        if enabled and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, unit="B", unit_scale=True, desc=what, file=sys.stderr)

    def __call__(self, nbytes: int) -> None:
        self.done += nbytes
        if self.bar is not None:
            self.bar.update(nbytes)
        elif self.enabled and self.done / self.total >= self._next - 1e-9:
            self._next = math.floor(self.done / self.total * 10 + 1) / 10
            rate = self.done / max(time.monotonic() - self._t0, 1e-9) / 2**20
            print(f"{self.what}: {self.done / 2**30:.2f} / {self.total / 2**30:.2f} GiB "
                  f"({100 * self.done / self.total:.0f}%, {rate:.0f} MiB/s)", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _nbytes(shape, dtype) -> int:
    return math.prod(shape) * torch.empty((), dtype=dtype).element_size()


def write_parallel3d(dst: Path, source, *, dtype: torch.dtype | None = None,
                     max_shard_bytes: int = 5 * 2**30, progress=None) -> Path:
    """``source``'s tensors as a parallel3d checkpoint (layout 1x1x1, whole tensors) at
    ``dst/step_<step>``, with ``dst/latest``; returns the checkpoint folder. ``dtype``
    casts the ``model/`` tensors only (master weights and moments stay fp32)."""
    names = sorted(source.names())
    specs = []
    for n in names:
        shape, src_dtype = source.spec(n)
        specs.append((n, tuple(shape), dtype if dtype is not None and n.startswith("model/") else src_dtype))
    shards = plan_shards(specs, max_shard_bytes)
    step = int(source.step)
    final = dst / step_dir_name(step)
    tmp = dst / f"{final.name}.tmp-convert{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    files, tensors = {}, {}
    for s, members in enumerate(shards):
        file = f"part_{s:05d}.safetensors"
        writer = StreamingWriter(tmp / file, [(specs[i][0], specs[i][2], specs[i][1]) for i in members],
                                 metadata={"format": "parallel3d"})
        for i in members:
            name, shape, want = specs[i]
            t = source.read(name).to(want)
            writer.write(name, t)
            zeros = (0,) * len(shape)
            tensors[name] = TensorEntry(shape, want, [Piece(file, name, zeros, shape)])
            if progress is not None:
                progress(t.numel() * t.element_size())
            del t
        size, sha = writer.close()
        files[file] = {"size": size, "sha256": sha}
    cfg = source.model_config
    index = Index(step=step, model=model_identity(cfg), tensors=tensors, files=files, ranks={},
                  layout={"tp": 1, "pp": 1, "dp": 1, "world_size": 1, "zero": 0},
                  trainer=getattr(source, "trainer", None), hf_config=getattr(source, "hf_config", None),
                  config=getattr(getattr(source, "index", None), "config", None))
    index.write(tmp / INDEX)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    (dst / LATEST).write_text(final.name + "\n")
    return final


def _verify(source, written, names: list[str], dtype_of) -> None:
    """Every tensor of ``written`` equals ``source``'s (cast to ``dtype_of(name)``), read
    in row chunks of at most 64 MiB."""
    for name in names:
        shape, src_dtype = source.spec(name)
        shape = tuple(shape)
        row_bytes = _nbytes(shape[1:], src_dtype) if shape else _nbytes((), src_dtype)
        rows = max(1, _VERIFY_CHUNK // max(row_bytes, 1))
        for r0 in range(0, max(shape[0], 1) if shape else 1, rows):
            if shape:
                off = (r0,) + (0,) * (len(shape) - 1)
                box = (min(rows, shape[0] - r0),) + shape[1:]
            else:
                off, box = (), ()
            want = source.read_region(name, off, box).to(dtype_of(name))
            got = written.read_region(name, off, box)
            if got.dtype != want.dtype or not torch.equal(got, want):
                raise CheckpointError(f"verify: {name} rows {r0}.. in {written.folder} differ from "
                                      f"{source.folder}: the written file is wrong")


def convert(src: str | Path, dst: str | Path, to: str, *, config: str | Path | None = None,
            dtype: str | None = None, verify: bool = True, progress: bool = True,
            max_shard_bytes: int = 5 * 2**30, overwrite: bool = False) -> dict:
    """Convert ``src`` to format ``to`` ("hf" or "parallel3d") at ``dst``; returns a summary.

    A ``dst`` that exists and is not empty is refused before anything is read or written,
    unless ``overwrite`` (the trainer's ``checkpoint.export_hf`` rewrites its own export)."""
    if to not in ("hf", "parallel3d"):
        raise UserError(f"convert --to '{to}': choose hf or parallel3d")
    if dtype is not None and dtype not in DTYPES:
        raise UserError(f"convert --dtype '{dtype}': choose one of {sorted(DTYPES)}")
    cast = DTYPES.get(dtype) if dtype else None
    dst = Path(dst)
    if dst.exists() and not dst.is_dir():
        raise UserError(f"convert: {dst} exists and is a file: choose a new DST folder")
    if dst.exists() and any(dst.iterdir()):
        if not overwrite:
            raise UserError(f"convert: {dst} exists and is not empty: choose a new DST "
                            "(or --overwrite to replace it)")
        if to == "hf" and not is_hf_folder(dst):
            raise UserError(f"convert: {dst} exists and is not a Hugging Face folder: choose a new DST")
    source = open_source(src, config)
    names = [n for n in source.names() if to == "parallel3d" or n.startswith("model/")]
    total = sum(_nbytes(*source.spec(n)) for n in names)
    bar = Progress(total, f"convert -> {to}", enabled=progress)
    t0 = time.monotonic()
    try:
        if to == "hf":
            write_hf_folder(dst, source, source.model_config, hf_config=source.hf_config,
                            dtype=cast, max_shard_bytes=max_shard_bytes, progress=bar)
            out_folder = dst
        else:
            out_folder = write_parallel3d(dst, source, dtype=cast, max_shard_bytes=max_shard_bytes,
                                          progress=bar)
    finally:
        bar.close()
    written_s = time.monotonic() - t0
    if verify:
        written = HFFolder(dst) if to == "hf" else CheckpointReader(out_folder)
        if to == "parallel3d":
            written.verify_all()

        def dtype_of(name):
            return cast if cast is not None and name.startswith("model/") else source.spec(name)[1]

        _verify(source, written, names, dtype_of)
        written.close()
    source.close()
    summary = {"tensors": len(names), "bytes": total, "seconds": written_s, "dst": str(out_folder),
               "verified": verify}
    if progress:
        print(f"convert: wrote {len(names)} tensors ({total / 2**30:.2f} GiB) to {out_folder} in "
              f"{written_s:.1f} s{', verified' if verify else ''}", file=sys.stderr, flush=True)
    return summary
