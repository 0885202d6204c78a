"""The trained LoRA adapters out as a PEFT folder (``adapter_config.json``,
``adapter_model.safetensors``) that ``peft.PeftModel.from_pretrained`` loads onto the
Hugging Face base.

    export_peft(model, job_cfg.lora, folder, topo, optimizer=trainer.optimizer)

Collective over the world. The ranks of the first data-parallel replica (dp x cp rank 0)
send their adapter factors, each with its tensor-parallel split (``p3d_tp_dim``,
``p3d_tp_range``), to rank 0, which places every block at its range in the full tensor
and writes the folder; pipeline stages send their own layers. Adapters are small (r x
(in + out) per projection), so they travel as objects, gathered whole on rank 0.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist

from parallel3d.lora.adapters import adapter_parameters
from parallel3d.lora.peft_io import CONFIG_FILE, PREFIX, WEIGHTS_FILE


def _blocks(model: torch.nn.Module) -> list[tuple]:
    """(name, split dim or None, (start, stop), full size, tensor on the CPU) per factor."""
    out = []
    for name, p in adapter_parameters(model):
        dim = getattr(p, "p3d_tp_dim", None)
        out.append((name, dim, getattr(p, "p3d_tp_range", None), getattr(p, "p3d_tp_full", None),
                    p.detach().to("cpu", copy=True)))
    return out


def assemble(blocks: list[tuple]) -> dict[str, torch.Tensor]:
    """Full tensors from the blocks of every rank (a replicated factor, or a shard held by
    several ranks, appears more than once: the copies are equal, the first is kept)."""
    full: dict[str, torch.Tensor] = {}
    for name, dim, rows, size, t in blocks:
        if dim is None:
            full.setdefault(name, t)
            continue
        if name not in full:
            shape = list(t.shape)
            shape[dim] = size
            full[name] = torch.zeros(shape, dtype=t.dtype)
        full[name].narrow(dim, rows[0], rows[1] - rows[0]).copy_(t)
    return full


def adapter_config(lora, base_model: str = "") -> dict:
    """PEFT's ``adapter_config.json`` for the ``[lora]`` section."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lora.rank,
            "lora_alpha": lora.alpha, "lora_dropout": lora.dropout,
            "target_modules": sorted(lora.targets), "bias": "none", "fan_in_fan_out": False,
            "use_rslora": False, "use_dora": False, "init_lora_weights": True,
            "modules_to_save": None, "base_model_name_or_path": base_model or None,
            "inference_mode": True}


def export_peft(model: torch.nn.Module, lora, folder: str | Path, topo, optimizer=None,
                base_model: str = "") -> Path | None:
    """Write ``model``'s adapters as a PEFT folder at ``folder`` (rank 0 writes; every
    rank calls). ``optimizer``: waited for (``wait_for_params``) first, so a ZeRO step's
    all-gather of the updated adapters has landed. Returns the folder on rank 0.
    ``lora.trainable`` weights are not exported (PEFT's ``modules_to_save``): refused."""
    if lora.trainable:
        raise ValueError(f"export_peft: lora.trainable {lora.trainable} would need PEFT's "
                         "modules_to_save, not written yet; export with lora.trainable=[]")
    if optimizer is not None and hasattr(optimizer, "wait_for_params"):
        optimizer.wait_for_params()
    mine = _blocks(model) if topo.dp_cp_rank == 0 else []
    if dist.is_initialized() and topo.world_size > 1:
        every = [None] * topo.world_size if topo.rank == 0 else None
        dist.gather_object(mine, every, dst=0)
    else:
        every = [mine]
    if topo.rank != 0:
        return None
    from safetensors.torch import save_file

    full = assemble([b for blocks in every for b in blocks])
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_file({PREFIX + name: t.contiguous() for name, t in sorted(full.items())}, str(folder / WEIGHTS_FILE),
              metadata={"format": "pt"})
    (folder / CONFIG_FILE).write_text(json.dumps(adapter_config(lora, base_model), indent=2))
    return folder
