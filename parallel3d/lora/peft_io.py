"""PEFT adapter folders in: ``adapter_config.json`` + ``adapter_model.safetensors``.

PEFT names an adapter factor ``base_model.model.<HF name of the layer>.lora_A.weight``;
parallel3d's parameter names are the Hugging Face names without the ``model.`` prefix
(``layers.0.self_attn.q_proj.lora_A.weight``), so the key is ``PREFIX + name``. Each
rank reads only its slice of each factor (``safe_open(...).get_slice``): the rows of a
column-parallel ``B``, the columns of a row-parallel ``A``, whole otherwise.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from parallel3d.errors import UserError

from .adapters import adapter_parameters, model_config, trained_whole

PREFIX = "base_model.model.model."
CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
VOCAB_ROWS = ("embed_tokens.weight", "lm_head.weight")  # rows: our vocabulary padded to a multiple of tp


def modules_to_save(trainable) -> list[str] | None:
    """``lora.trainable`` as PEFT's ``modules_to_save``, which wraps every module whose name
    ends with a key: the final norm as ``model.norm`` (``norm`` would take every layer's
    norms too); the others' names end no other module's."""
    return sorted("model.norm" if t == "norm" else t for t in trainable) or None


def peft_key(name: str) -> str:
    """The adapter file's key of our parameter ``name``: PEFT's prefix on its Hugging Face
    name (the head is no part of the HF ``model.``)."""
    return "base_model.model." + name if name.startswith("lm_head.") else PREFIX + name


def read_adapter_config(folder: str | Path) -> dict:
    path = Path(folder) / CONFIG_FILE
    if not path.is_file():
        raise UserError(f"lora.adapter {folder}: no {CONFIG_FILE} there; point lora.adapter at a PEFT adapter folder")
    return json.loads(path.read_text())


def check_adapter_config(hf: dict, lora, folder) -> None:
    """Raise :class:`UserError` when the folder's adapter is not the ``[lora]`` section's."""
    problems = []
    if hf.get("peft_type", "LORA") != "LORA":
        problems.append(f"peft_type {hf.get('peft_type')} is not LORA")
    if hf.get("r") != lora.rank:
        problems.append(f"its r is {hf.get('r')}: set lora.rank={hf.get('r')}")
    if float(hf.get("lora_alpha", 8)) != float(lora.alpha):
        problems.append(f"its lora_alpha is {hf.get('lora_alpha')}: set lora.alpha={hf.get('lora_alpha')}")
    if hf.get("target_parameters"):  # peft_experts.py: the fused experts, the MLP beside them
        raise UserError(f"lora.adapter {folder}: it adapts parameters (target_parameters "
                        f"{hf['target_parameters']}: a Mixture-of-Experts model's fused experts), which "
                        "lora.adapter does not read: train on the merged model instead (the run's "
                        "checkpoint.export_hf folder as model.hf_checkpoint)")
    targets = hf.get("target_modules") or []
    if isinstance(targets, str) or sorted(targets) != sorted(lora.targets):
        problems.append(f"its target_modules are {targets}: set lora.targets to that list")
    for key, off in (("use_rslora", False), ("use_dora", False), ("fan_in_fan_out", False), ("bias", "none")):
        if hf.get(key, off) != off:
            problems.append(f"{key}={hf.get(key)} is not supported")
    saved = hf.get("modules_to_save") or None
    if (sorted(saved) if isinstance(saved, list) else saved) != modules_to_save(lora.trainable):
        names = ["norm" if m == "model.norm" else m for m in saved or []]
        problems.append(f"its modules_to_save are {saved}: set lora.trainable={names}")
    if problems:
        raise UserError(f"lora.adapter {folder}: " + "; ".join(problems))


@torch.no_grad()
def load_adapter_(model: torch.nn.Module, lora, only=None) -> None:
    """Fill every adapter factor of ``model`` (those in ``only``, when given: ZeRO 3's
    bucket being filled) with this rank's slice of ``lora.adapter``."""
    from safetensors import safe_open


    folder = Path(lora.adapter)
    check_adapter_config(read_adapter_config(folder), lora, folder)
    path = folder / WEIGHTS_FILE
    if not path.is_file():
        raise UserError(f"lora.adapter {folder}: no {WEIGHTS_FILE} there (only safetensors adapters are read)")
    vocab = model_config(model).vocab_size
    with safe_open(str(path), framework="pt") as f:
        keys = set(f.keys())
        for name, p in adapter_parameters(model, only) + trained_whole(model, only):  # + modules_to_save
            key = peft_key(name)
            if key not in keys:
                raise UserError(f"lora.adapter {folder}: {key} is missing; the adapter was made for other layers")
            block = f.get_slice(key)
            dim = getattr(p, "p3d_tp_dim", None)
            want = list(p.shape)
            if dim is not None:
                want[dim] = p.p3d_tp_full
            if name in VOCAB_ROWS:
                want[0] = vocab  # the file's rows: the vocabulary without our padding
            if list(block.get_shape()) != want:
                raise UserError(f"lora.adapter {folder}: {key} has shape {block.get_shape()}, "
                                f"this model's needs {want}")
            if dim is None:
                piece = block[:]
                p.narrow(0, 0, piece.shape[0]).copy_(piece.to(p.dtype))  # (rows past the vocabulary: padding)
                continue
            start, stop = p.p3d_tp_range
            stop = min(stop, want[dim])  # (a vocabulary shard's padding rows stay as they are)
            if stop > start:
                piece = block[start:stop] if dim == 0 else block[:, start:stop]
                p.narrow(dim, 0, stop - start).copy_(piece.to(p.dtype))
