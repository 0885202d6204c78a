"""``parallel3d convert SRC DST --to {hf,parallel3d,dcp}``: streaming, verified conversion.

A Hugging Face SRC converted ``--to hf`` keeps its tokenizer files and
generation_config.json (:data:`.hf.COMPANION_FILES`), as the training export does.

SRC is recognised by what it holds (:func:`open_source`): a Hugging Face folder, a
parallel3d checkpoint at any layout, DeepSpeed (ZeRO 0-3), a torch DCP folder (Hugging
Face or torchtitan naming), Megatron-Core (``torch_dist`` or legacy ``mp_rank_XX``). Every
source serves logical tensors (``model/<name>``, and for training checkpoints
``master/``, ``optim/exp_avg/``, ``optim/exp_avg_sq/``) by region.

The conversion streams (:mod:`.pipeline`): reader threads fetch the next tensors while the
current one is written and hashed, with at most ``budget`` bytes in flight, so peak memory
is about ``max(budget, largest tensor)`` whatever the model size. Output goes to a
temporary folder renamed into place only after verification:

- ``verify="hash"`` (default): every output file's checksum is computed while it is written
  and recorded (sha256 in ``index.json``; CRC-32 in ``CRC32SUMS`` for Hugging Face and DCP,
  see :mod:`.writers`), and the written headers / index /
  metadata are re-read and checked against the plan (every key, shape, dtype, file size).
  No tensor is read back; a parallel3d source's files are checked by size (their sha256
  costs one more read and hash of the whole source: ``full``).
- ``verify="full"``: also checks a parallel3d source's files against their recorded
  sha256 (on a thread beside the conversion) and reads every tensor back from DST to
  compare it with SRC.
- ``verify="none"``: neither.
"""

from __future__ import annotations

import math
import os
import shutil
import sys
import threading
import time
from pathlib import Path

import torch

from parallel3d.errors import UserError

from . import zerocopy
from .errors import CheckpointError
from .format import LATEST
from .foreign.hf import HFFolder, copy_companion_files, is_hf_folder
from .pipeline import DEFAULT_BUDGET, Progress, default_threads
from .reader import CheckpointReader, find_checkpoint, step_dir_name

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
FORMATS = ("hf", "parallel3d", "dcp")
VERIFY = ("hash", "full", "none")
_VERIFY_CHUNK = 64 * 2**20


def open_source(path: str | Path, config: str | Path | None = None, *, verify: bool = True):
    """The source at ``path`` (see the module docstring), or a one-line UserError.
    ``verify=False`` opens a parallel3d checkpoint without hashing its files first."""
    path = Path(path)
    if not path.is_dir():
        raise UserError(f"convert: {path} is not a folder")
    if config is not None and not Path(config).is_file():
        raise UserError(f"convert --config '{config}' is not a file: give the model's config.json")
    from .foreign.dcp_read import is_dcp_folder
    from .foreign.deepspeed import find_deepspeed_dir
    from .foreign.megatron import find_megatron

    foreign = None
    if not is_hf_folder(path):
        meg = find_megatron(path)
        ds = find_deepspeed_dir(path) if meg is None else None
        if meg is not None:
            from .foreign.megatron_layouts import open_megatron

            foreign = lambda: open_megatron(meg, config)  # noqa: E731
        elif ds is not None:
            from .foreign.deepspeed import DeepSpeedCheckpoint

            foreign = lambda: DeepSpeedCheckpoint(ds, config)  # noqa: E731
        elif is_dcp_folder(path):
            from .foreign.dcp import DCPCheckpoint

            foreign = lambda: DCPCheckpoint(path, config)  # noqa: E731
    if foreign is not None:
        return foreign()
    if config is not None:
        raise UserError(f"convert --config is for a DeepSpeed, DCP or Megatron source; {path} carries "
                        "its own model config: leave --config out")
    if is_hf_folder(path):
        return HFFolder(path)
    found = find_checkpoint(path)  # a broken ``latest`` is this folder's error, said as such
    if found is not None:
        return CheckpointReader(found, verify=verify)
    if (path / "config.json").is_file():
        return HFFolder(path)  # a model folder without usable weights: its own clear error
    raise UserError(f"convert: {path} is neither a Hugging Face folder (config.json + "
                    "model.safetensors[.index.json]), a parallel3d checkpoint (index.json or "
                    "latest), a DeepSpeed checkpoint (latest + *model_states.pt), a torch DCP "
                    "folder (.metadata) nor a Megatron checkpoint (iter_*/, mp_rank_*/ or "
                    "metadata.json)")


def _nbytes(shape, dtype) -> int:
    return math.prod(shape) * torch.empty((), dtype=dtype).element_size()


def _verify_full(source, written, names: list[str], dtype_of) -> None:
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


class _SourceCheck:
    """The source's recorded hashes checked on a thread beside the conversion."""

    def __init__(self, source):
        self.error: BaseException | None = None
        self.thread = None
        if isinstance(source, CheckpointReader) and not source.verify:
            self.thread = threading.Thread(target=self._run, args=(source,), daemon=True)
            self.thread.start()

    def _run(self, source) -> None:
        try:
            source.verify_hashes()
        except BaseException as e:  # noqa: BLE001 - re-raised by join
            self.error = e

    def join(self) -> None:
        if self.thread is not None:
            self.thread.join()
        if self.error is not None:
            raise self.error


def _check_args(to, dtype, verify, dst: Path, overwrite: bool) -> None:
    if to not in FORMATS:
        raise UserError(f"convert --to '{to}': choose one of {', '.join(FORMATS)}")
    if dtype is not None and dtype not in DTYPES:
        raise UserError(f"convert --dtype '{dtype}': choose one of {sorted(DTYPES)}")
    if verify not in VERIFY:
        raise UserError(f"convert --verify '{verify}': choose one of {', '.join(VERIFY)}")
    if dst.exists() and not dst.is_dir():
        raise UserError(f"convert: {dst} exists and is a file: choose a new DST folder")
    if dst.exists() and any(dst.iterdir()):
        if not overwrite:
            raise UserError(f"convert: {dst} exists and is not empty: choose a new DST "
                            "(or --overwrite to replace it)")
        if to == "hf" and not is_hf_folder(dst):
            raise UserError(f"convert: {dst} exists and is not a Hugging Face folder: choose a new DST")


def _publish(tmp: Path, final: Path) -> None:
    """Rename ``tmp`` to ``final``, replacing what was there only once ``tmp`` is complete."""
    if final.exists():
        old = final.with_name(f".{final.name}.old-{os.getpid()}")
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)


def convert(src: str | Path, dst: str | Path, to: str, *, config: str | Path | None = None,
            dtype: str | None = None, verify: str | bool = "hash", progress: bool = True,
            max_shard_bytes: int = 5 * 2**30, overwrite: bool = False,
            budget_bytes: int = DEFAULT_BUDGET, threads: int | None = None, merge_lora: bool = False) -> dict:
    """Convert ``src`` to format ``to`` at ``dst``; returns a summary.

    A ``dst`` that exists and is not empty is refused before anything is read or written,
    unless ``overwrite`` (the trainer's ``checkpoint.export_hf`` rewrites its own export).
    ``budget_bytes``: the most bytes of tensors read ahead (memory: about this or the
    largest tensor, whichever is larger). A LoRA run's checkpoint goes to ``hf`` or ``dcp``
    as its base model, or with ``merge_lora`` as the merged one (:mod:`.peft`)."""
    verify = {True: "hash", False: "none"}.get(verify, verify)
    dst = Path(dst)
    _check_args(to, dtype, verify, dst, overwrite)
    if budget_bytes <= 0:
        raise UserError(f"convert: the memory budget must be positive, got {budget_bytes} bytes")
    cast = DTYPES.get(dtype) if dtype else None
    from . import writers

    source = raw = open_source(src, config, verify=False)
    try:
        if to != "parallel3d":
            from .foreign.peft import lora_export_view

            source = lora_export_view(source, merge_lora)
        step = int(source.step)
        final = dst / step_dir_name(step) if to == "parallel3d" else dst
        tmp = final.with_name(f".{final.name}.tmp-convert{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        created = not dst.exists()  # removed again if the conversion fails
        cleanup = dst if created and to == "parallel3d" else tmp
        tmp.mkdir(parents=True)
        try:  # whatever fails from here on leaves no temporary folder behind
            check = _SourceCheck(raw) if verify == "full" else None
            names = [n for n in source.names() if to == "parallel3d" or n.startswith("model/")]
            total = sum(_nbytes(*source.spec(n)) for n in names)
            bar = Progress(total, f"convert -> {to}", enabled=progress)
            t0 = time.monotonic()
            write = {"hf": writers.write_hf, "parallel3d": writers.write_parallel3d, "dcp": writers.write_dcp}[to]
            _write_checked(write, writers.check_output, source, tmp, to, names, cast=cast, verify=verify,
                           check=check, bar=bar, max_shard_bytes=max_shard_bytes, budget=budget_bytes,
                           threads=threads)
            companions = []
            if to == "hf" and isinstance(source, HFFolder):  # the tokenizer and generation config go along
                companions = copy_companion_files(src, tmp)
            _publish(tmp, final)
        except BaseException:
            shutil.rmtree(cleanup, ignore_errors=True)
            raise
        if to == "parallel3d":
            (dst / LATEST).write_text(final.name + "\n")
        seconds = time.monotonic() - t0
    finally:
        source.close()
    summary = {"tensors": len(names), "bytes": total, "seconds": seconds, "dst": str(final),
               "verified": verify, "copied": companions}
    if progress:
        _print_summary(summary)
    return summary


def _write_checked(write, check_output, source, tmp: Path, to: str, names, *, cast, verify: str,
                   check, bar, max_shard_bytes: int, budget: int, threads) -> None:
    """Write ``source`` into ``tmp`` with ``write`` (one of :mod:`.writers`) and verify it as
    ``verify`` says (the caller removes ``tmp`` on a failure). ``bar`` is closed either way."""
    try:
        with zerocopy.zero_copy_reads():
            out = write(tmp, source, cast=cast, max_shard_bytes=max_shard_bytes, progress=bar,
                        budget=budget, threads=threads or default_threads())
        if verify != "none":
            check_output(out, to)
        if verify == "full":
            check.join()
            _verify_written(source, tmp, to, names, cast)
    finally:
        bar.close()


def _print_summary(summary: dict) -> None:
    """The one closing line on stderr for :func:`convert`'s ``summary``."""
    how = {"hash": "verified (checksums while writing; headers and sizes re-read)",
           "full": "verified (source hashes checked, every tensor read back)",
           "none": "not verified"}[summary["verified"]]
    total, companions = summary["bytes"], summary["copied"]
    size = f"{total / 2**30:.2f} GiB" if total >= 2**30 else f"{total / 2**20:.2f} MiB"
    also = f"; with the source's {', '.join(companions)}" if companions else ""
    print(f"convert: wrote {summary['tensors']} tensors ({size}) to {summary['dst']} in "
          f"{summary['seconds']:.1f} s, {how}{also}", file=sys.stderr, flush=True)


def _verify_written(source, folder: Path, to: str, names, cast) -> None:
    if to == "hf":
        written = HFFolder(folder)
    elif to == "dcp":
        from .foreign.dcp import DCPCheckpoint

        written = DCPCheckpoint(folder, folder / "config.json")
    else:
        written = CheckpointReader(folder)
        written.verify_all()
    try:
        _verify_full(source, written, names,
                     lambda n: cast if cast is not None and n.startswith("model/") else source.spec(n)[1])
    finally:
        written.close()
