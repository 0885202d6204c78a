"""Hugging Face model folders: read any region of any weight (writing: :mod:`.writers`).

A folder holds ``config.json`` and the weights as ``model.safetensors`` or as shards
listed in ``model.safetensors.index.json``. :class:`HFFolder` serves them under our
logical names (``model/<parallel3d name>``) with the same ``read_region`` as a parallel3d
checkpoint, so fine-tuning initialisation (``model.hf_checkpoint``) and conversion read
them exactly like our own checkpoints: each rank only the slices it needs.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import torch

from parallel3d.models.llama.hf import config_from_hf, name_from_hf

from ..errors import CheckpointError, read_json_object
from ..safetensors_io import SafetensorsFile
from ..state import logical_shapes

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


def is_hf_folder(path: Path) -> bool:
    return (path / "config.json").is_file() and ((path / SINGLE_NAME).is_file() or (path / INDEX_NAME).is_file())


def read_hf_config(folder: Path) -> dict:
    """``config.json`` as a dict; refused if it asks for the folder's own code."""
    path = folder / "config.json"
    try:
        hf = read_json_object(path, "a model config")
    except FileNotFoundError:
        raise CheckpointError(f"{folder} has no config.json: not a Hugging Face model folder") from None
    check_no_remote_code(hf, path)
    return hf


def check_no_remote_code(hf: dict, path: Path) -> None:
    """Refuse a config that defines its model by code shipped with the folder
    (``auto_map``, as read with ``trust_remote_code``): parallel3d never imports such code,
    and weights meant for another implementation would load into ours silently wrong."""
    if hf.get("auto_map") or hf.get("trust_remote_code"):
        where = sorted(hf["auto_map"]) if isinstance(hf.get("auto_map"), dict) else "trust_remote_code"
        raise CheckpointError(f"{path} defines its model by the folder's own code (auto_map {where}): "
                              "parallel3d never runs code from a model folder; use a folder of a "
                              "supported architecture (remove auto_map only if the model is a plain one)")


def model_config_from_folder(folder: Path):
    """The :class:`LlamaConfig` of a Hugging Face folder (one line naming what is refused)."""
    try:
        return config_from_hf(read_hf_config(folder))
    except (KeyError, ValueError) as e:
        if isinstance(e, CheckpointError):
            raise
        raise CheckpointError(f"{folder / 'config.json'}: {e}") from None


class HFFolder:
    """The weights of a Hugging Face folder as logical tensors ``model/<name>``."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        self.hf_config = read_hf_config(self.folder)
        self.model_config = model_config_from_folder(self.folder)
        self.step, self.trainer = 0, None
        self._files: dict[str, SafetensorsFile] = {}
        self._where: dict[str, tuple[str, str]] = {}  # logical name -> (file, key)
        for file in self._weight_files():
            f = self._open(file)
            for key in f.tensors:
                self._where["model/" + name_from_hf(key)] = (file, key)
        self._shapes = {"model/" + n: s for n, s in logical_shapes(self.model_config).items()}
        if self.model_config.tie_embeddings:
            self._where.pop("model/lm_head.weight", None)  # some exports store the tied copy
        self._check_names()

    def _weight_files(self) -> list[str]:
        if (self.folder / INDEX_NAME).is_file():
            try:
                weight_map = json.loads((self.folder / INDEX_NAME).read_text(encoding="utf-8"))["weight_map"]
            except (OSError, KeyError, json.JSONDecodeError) as e:
                raise CheckpointError(f"{self.folder / INDEX_NAME} cannot be read: {e}") from None
            files = sorted(set(weight_map.values()))
        elif (self.folder / SINGLE_NAME).is_file():
            files = [SINGLE_NAME]
        elif list(self.folder.glob("*.bin")):
            raise CheckpointError(f"{self.folder} holds pickled *.bin weights: parallel3d reads only "
                                  "safetensors (load it in transformers and save_pretrained it first)")
        else:
            raise CheckpointError(f"{self.folder} has no {SINGLE_NAME} or {INDEX_NAME}")
        for name in files:
            if "/" in name or name.startswith("."):
                raise CheckpointError(f"{self.folder / INDEX_NAME} names the file {name!r}: only "
                                      "plain file names inside the folder are allowed")
        return files

    def _open(self, file: str) -> SafetensorsFile:
        f = self._files.get(file)
        if f is None:
            f = self._files[file] = SafetensorsFile(self.folder / file)
        return f

    def _check_names(self) -> None:
        missing = sorted(set(self._shapes) - set(self._where))
        extra = sorted(n for n in set(self._where) - set(self._shapes)
                       if not n.endswith("rotary_emb.inv_freq"))
        if missing or extra:
            raise CheckpointError(f"{self.folder}: the weights do not match config.json: missing "
                                  f"{missing[:4]}, unexpected {extra[:4]}")
        for name, shape in self._shapes.items():
            file, key = self._where[name]
            have = self._files[file].tensors[key].shape
            if tuple(have) != tuple(shape):
                raise CheckpointError(f"{self.folder / file}: {key} has shape {list(have)}, "
                                      f"config.json implies {list(shape)}")

    # -- the source interface (as CheckpointReader) -----------------------------------------------
    def names(self) -> list[str]:
        return list(self._shapes)

    def has(self, name: str) -> bool:
        return name in self._shapes

    def spec(self, name: str) -> tuple[tuple[int, ...], torch.dtype]:
        file, key = self._where[name]
        info = self._files[file].tensors[key]
        return info.shape, info.dtype

    def read_region(self, name: str, offsets, shape) -> torch.Tensor:
        if name not in self._shapes:
            raise CheckpointError(f"{self.folder} has no tensor {name!r}")
        file, key = self._where[name]
        return self._files[file].read_box(key, offsets, shape)

    def read(self, name: str) -> torch.Tensor:
        file, key = self._where[name]
        return self._files[file].read(key)

    def close(self) -> None:
        for f in self._files.values():
            f.close()


# What a fine-tuned export needs from its source folder besides the weights: the tokenizer
# (transformers' fast and sentencepiece forms, the chat template when it has its own
# file) and the generation defaults.
COMPANION_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "tokenizer.model", "chat_template.jinja", "chat_template.json",
                   "generation_config.json")


def copy_companion_files(src: str | Path, dst: str | Path) -> list[str]:
    """Copy :data:`COMPANION_FILES` that ``src`` has into ``dst``; returns their names."""
    src, dst = Path(src), Path(dst)
    copied = []
    for name in COMPANION_FILES:
        if (src / name).is_file():
            shutil.copyfile(src / name, dst / name)
            copied.append(name)
    return copied


def hf_order(names: list[str]) -> list[str]:
    """Embedding, layers in numeric order, final norm, head: the order of the model."""
    def key(n: str):
        parts = n.split("/", 1)[-1].split(".")
        if parts[0] == "layers":
            return (1, int(parts[1]), n)
        return ({"embed_tokens": 0, "norm": 2, "lm_head": 3}.get(parts[0], 4), 0, n)
    return sorted(names, key=key)


def plan_shards(specs: list[tuple[str, tuple, torch.dtype]], max_bytes: int) -> list[list[int]]:
    """Consecutive tensors grouped into shards of at most ``max_bytes`` (a larger tensor
    gets a shard of its own)."""
    shards, current, size = [], [], 0
    for i, (_, shape, dtype) in enumerate(specs):
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        if current and size + nbytes > max_bytes:
            shards.append(current)
            current, size = [], 0
        current.append(i)
        size += nbytes
    if current:
        shards.append(current)
    return shards
