"""The three output formats of ``parallel3d convert``: Hugging Face, parallel3d, torch DCP.

Each writes into a temporary folder through :mod:`.pipeline` (reads ahead, writes in order,
hashes while writing) and returns an :class:`Output`; :func:`check_output` then re-reads
only the written headers / index / metadata and file sizes (cheap), and the caller renames
the folder into place. A checksum of every file, computed while writing, is recorded: its
sha256 in ``index.json`` (parallel3d, whose readers check it), its CRC-32 in ``CRC32SUMS``
(Hugging Face and DCP, which define no checksum: a CRC catches corruption at a quarter of
sha256's cost, which on a busy machine is the conversion's largest CPU cost after copying).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from parallel3d.models.llama.hf import config_from_hf, config_to_hf, name_to_hf

from .foreign.dcp_read import read_metadata
from .foreign.dcp_write import DCPFileWriter, write_metadata
from .errors import CheckpointError
from .format import INDEX, Index, Piece, TensorEntry, model_identity
from .foreign.hf import INDEX_NAME, SINGLE_NAME, hf_order, plan_shards
from .pipeline import Item, read_ahead, write_files
from .safetensors_io import SafetensorsFile, StreamingWriter

SUMS = "CRC32SUMS"
SUMS_ALGORITHM = "crc32"


@dataclass
class Output:
    folder: Path  # the temporary folder written
    items: list[Item]
    files: dict[str, dict]  # file -> {"size", "digest"} (sha256 or CRC-32, see the module)
    layout: dict[str, list[str]]  # file -> keys, in order


def make_items(source, names: list[str], key_of, cast: torch.dtype | None) -> list[Item]:
    out = []
    for n in names:
        shape, src_dtype = source.spec(n)
        want = cast if cast is not None and n.startswith("model/") else src_dtype
        out.append(Item(n, key_of(n), tuple(shape), want, src_dtype))
    return out


def _shards(items: list[Item], max_bytes: int, name_of) -> list[tuple[str, list[Item]]]:
    groups = plan_shards([(it.key, it.shape, it.dtype) for it in items], max_bytes)
    return [(name_of(s, len(groups)), [items[i] for i in g]) for s, g in enumerate(groups)]


def _hf_config(source, cast) -> dict:
    model_cfg = source.model_config
    config = dict(source.hf_config) if source.hf_config else config_to_hf(model_cfg)
    if source.hf_config:  # keep the source's own fields (token ids, ...), checked against ours
        ours = config_from_hf(config)
        if ours.tie_embeddings != model_cfg.tie_embeddings or ours.vocab_size != model_cfg.vocab_size:
            config = config_to_hf(model_cfg)
    if cast is not None:
        config["torch_dtype"] = str(cast).removeprefix("torch.")
        config.pop("dtype", None)
    return config


def _write_sums(folder: Path, files: dict) -> None:
    (folder / SUMS).write_text("".join(f"{r['digest']}  {f}\n" for f, r in sorted(files.items())))


def write_hf(tmp: Path, source, *, cast=None, max_shard_bytes: int, progress=None, budget: int,
             threads: int) -> Output:
    names = hf_order([n for n in source.names() if n.startswith("model/")])
    config = _hf_config(source, cast)
    model_type = config.get("model_type", "llama")  # Mixtral names its experts its own way
    items = make_items(source, names, lambda n: name_to_hf(n[6:], model_type), cast)
    files = _shards(items, max_shard_bytes, lambda s, k: SINGLE_NAME if k == 1
                    else f"model-{s + 1:05d}-of-{k:05d}.safetensors")

    def open_writer(file, members):
        return StreamingWriter(tmp / file, [(it.key, it.dtype, it.shape) for it in members],
                               metadata={"format": "pt"}, algorithm=SUMS_ALGORITHM)

    records = write_files(read_ahead(source, items, budget, threads), files, open_writer, progress)
    if len(files) > 1:
        weight_map = {it.key: f for f, members in files for it in members}
        total = sum(it.nbytes for it in items)
        (tmp / INDEX_NAME).write_text(json.dumps({"metadata": {"total_size": total},
                                                  "weight_map": weight_map}, indent=2))
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    _write_sums(tmp, records)
    return Output(tmp, items, records, {f: [it.key for it in m] for f, m in files})


def write_dcp(tmp: Path, source, *, cast=None, max_shard_bytes: int, progress=None, budget: int,
              threads: int) -> Output:
    """A DCP folder with Hugging Face keys (see :mod:`.dcp_write`), plus config.json. A
    tied head is written under ``lm_head.weight`` too: Hugging Face's ``state_dict()``
    lists it, and ``dcp.load`` wants every key it is given."""
    names = hf_order([n for n in source.names() if n.startswith("model/")])
    items = make_items(source, names, lambda n: name_to_hf(n[6:]), cast)
    if source.model_config.tie_embeddings:
        emb = next(it for it in items if it.name == "model/embed_tokens.weight")
        items.append(Item(emb.name, "lm_head.weight", emb.shape, emb.dtype, emb.src_dtype))
    files = _shards(items, max_shard_bytes, lambda s, k: f"__0_{s}.distcp")
    writers = []

    def open_writer(file, members):
        writers.append(DCPFileWriter(tmp, file, SUMS_ALGORITHM))
        return writers[-1]

    records = write_files(read_ahead(source, items, budget, threads), files, open_writer, progress)
    write_metadata(tmp, writers)
    (tmp / "config.json").write_text(json.dumps(_hf_config(source, cast), indent=2))
    _write_sums(tmp, records)
    return Output(tmp, items, records, {f: [it.key for it in m] for f, m in files})


def write_parallel3d(tmp: Path, source, *, cast=None, max_shard_bytes: int, progress=None,
                     budget: int, threads: int) -> Output:
    """``source``'s tensors as a parallel3d checkpoint folder (layout 1x1x1, whole
    tensors). ``cast`` applies to the ``model/`` tensors only (masters and moments stay)."""
    items = make_items(source, sorted(source.names()), lambda n: n, cast)
    files = _shards(items, max_shard_bytes, lambda s, k: f"part_{s:05d}.safetensors")

    def open_writer(file, members):
        return StreamingWriter(tmp / file, [(it.key, it.dtype, it.shape) for it in members],
                               metadata={"format": "parallel3d"})

    records = write_files(read_ahead(source, items, budget, threads), files, open_writer, progress)
    records = {f: {"size": r["size"], "sha256": r["digest"]} for f, r in records.items()}
    tensors = {}
    for file, members in files:
        for it in members:
            tensors[it.name] = TensorEntry(it.shape, it.dtype, [Piece(file, it.key, (0,) * len(it.shape), it.shape)])
    index = Index(step=int(source.step), model=model_identity(source.model_config), tensors=tensors,
                  files=records, ranks={}, layout={"tp": 1, "pp": 1, "dp": 1, "world_size": 1, "zero": 0},
                  trainer=source.trainer, hf_config=source.hf_config,
                  config=getattr(getattr(source, "index", None), "config", None))
    index.write(tmp / INDEX)
    return Output(tmp, items, records, {f: [it.key for it in m] for f, m in files})


def check_output(out: Output, to: str) -> None:
    """The written folder holds what was planned: every file at the size written, every
    key with its shape and dtype (headers, index or metadata re-read; no tensor data)."""
    where = {}
    for file, rec in out.files.items():
        size = os.stat(out.folder / file).st_size
        if size != rec["size"]:
            raise CheckpointError(f"verify: {out.folder / file} has {size} bytes, {rec['size']} were written")
    if to == "dcp":
        entries, _ = read_metadata(out.folder)
        for it in out.items:
            e = entries.get(it.key)
            if e is None or e.shape != it.shape or e.dtype != it.dtype:
                raise CheckpointError(f"verify: {out.folder} metadata lacks {it.key} {list(it.shape)} {it.dtype}")
        return
    if to == "parallel3d":
        index = Index.read(out.folder)
        for it in out.items:
            e = index.tensors.get(it.name)
            if e is None or e.shape != it.shape or e.dtype != it.dtype or index.files != out.files:
                raise CheckpointError(f"verify: {out.folder / INDEX} does not record {it.name} as written")
    for file, keys in out.layout.items():
        with SafetensorsFile(out.folder / file) as f:
            where.update({k: (f.tensors.get(k), file) for k in keys})
    for it in out.items:
        info, file = where[it.key]
        if info is None or tuple(info.shape) != it.shape or info.dtype != it.dtype:
            raise CheckpointError(f"verify: {out.folder / file} does not hold {it.key} {list(it.shape)} {it.dtype}")
