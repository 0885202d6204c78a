"""The trained LoRA adapters out as a PEFT folder (``adapter_config.json``,
``adapter_model.safetensors``) that ``peft.PeftModel.from_pretrained`` loads onto the
Hugging Face base.

    export_peft(model, job_cfg.lora, folder, topo, optimizer=trainer.optimizer)
    convert(checkpoint, dst, to="hf", merge_lora=True)   # LoraExportView: the merged model

Collective over the world. The ranks of the first data-parallel replica (dp x cp rank 0)
send their adapter factors, each with its tensor-parallel split (``p3d_tp_dim``,
``p3d_tp_range``), to rank 0, which places every block at its range in the full tensor
and writes the folder; pipeline stages send their own layers. A routed expert's factors
(whole on every tp rank) come from tp rank 0 of the first replica of its experts
(edp x cp rank 0: under expert parallelism the dp ranks of every ep rank), and go into
transformers' fused experts as peft adapts them (``peft_experts.py``). They travel as host
objects on a gloo group (the checkpointer's, or one made for the call under NCCL), one
sender at a time: rank 0 holds the assembled tensors and one sender's blocks, never a
buffer of world size x the largest sender's bytes, which ``gather_object`` allocates
(on the GPU under NCCL). That matters with ``lora.trainable``: a 70B model's head is
4 GiB in fp32, its last stage's tp ranks send 1/tp of it each, and at 512 ranks a
gather would have asked rank 0 for 512 of those.

:class:`LoraExportView` serves a LoRA run's checkpoint to the Hugging Face writers: as its
base model (the adapters left out) or merged (``W + s B A``, PEFT's ``merge_and_unload``),
streamed tensor by tensor like any conversion. The trainer calls both at the end of a run
(``checkpoint.export_peft``, ``checkpoint.export_hf``).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist

from parallel3d.lora.adapters import adapter_parameters, model_config, trained_whole
from parallel3d.lora.peft_io import CONFIG_FILE, VOCAB_ROWS, WEIGHTS_FILE, modules_to_save, peft_key

from .peft_experts import fuse_experts


def _blocks(model: torch.nn.Module, topo) -> list[tuple]:
    """(name, split dim or None, (start, stop), full size, tensor on the CPU) per factor,
    and per weight ``lora.trainable`` trains (PEFT's ``modules_to_save``), of those this
    rank sends: the first replica's (dp x cp rank 0) and, of a routed expert's, tp rank 0
    of its experts' first replica (edp x cp rank 0)."""
    dense = topo.dp_cp_rank == 0
    experts = topo.edp_rank == 0 and topo.cp_rank == 0 and topo.tp_rank == 0
    out = []
    for name, p in adapter_parameters(model) + trained_whole(model):
        if not (experts if getattr(p, "p3d_expert", False) else dense):
            continue
        dim = getattr(p, "p3d_tp_dim", None)
        out.append((name, dim, getattr(p, "p3d_tp_range", None), getattr(p, "p3d_tp_full", None),
                    p.detach().to("cpu", copy=True)))
    return out


def assemble(blocks: list[tuple], full: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """Full tensors from the blocks of every rank, placed into ``full`` (a new dict when
    None) and returned (a replicated factor, or a shard held by several ranks, appears
    more than once: the copies are equal, the first is kept)."""
    full = {} if full is None else full
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


def adapter_config(lora, base_model: str = "", experts: dict | None = None) -> dict:
    """PEFT's ``adapter_config.json`` for the ``[lora]`` section; ``experts``: the keys that
    adapt a Mixture-of-Experts model's fused experts instead (``peft_experts.expert_config``)."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lora.rank,
            "lora_alpha": lora.alpha, "lora_dropout": lora.dropout,
            "target_modules": sorted(lora.targets), "bias": "none", "fan_in_fan_out": False,
            "use_rslora": False, "use_dora": False, "init_lora_weights": True,
            "modules_to_save": modules_to_save(lora.trainable), "base_model_name_or_path": base_model or None,
            "inference_mode": True, **(experts or {})}


def _collect(mine: list[tuple], topo, group) -> dict[str, torch.Tensor] | None:
    """Rank 0: the full tensors of every sender's blocks, received one sender at a time
    on ``group`` (a gloo group over the world); the other ranks send theirs, if any, and
    get None."""
    if not (dist.is_initialized() and topo.world_size > 1):
        return assemble(mine)
    sends = [None] * topo.world_size if topo.rank == 0 else None
    dist.gather_object(bool(mine), sends, dst=0, group=group)  # one flag a rank
    if topo.rank != 0:
        if mine:
            dist.send_object_list([mine], dst=0, group=group)
        return None
    full = assemble(mine)
    for src in (r for r in range(1, topo.world_size) if sends[r]):
        box = [None]
        dist.recv_object_list(box, src=src, group=group)
        assemble(box[0], full)
    return full


def export_peft(model: torch.nn.Module, lora, folder: str | Path, topo, optimizer=None,
                base_model: str = "", group=None) -> Path | None:
    """Write ``model``'s adapters as a PEFT folder at ``folder`` (rank 0 writes; every
    rank calls). ``optimizer``: waited for (``wait_for_params``) first, so a ZeRO step's
    all-gather of the updated adapters has landed. Returns the folder on rank 0.
    ``lora.trainable`` weights go in whole, as PEFT saves its ``modules_to_save`` (the
    vocabulary's padding dropped). ``group``: a gloo group over the world to send them
    on (None: the default group on gloo, a new gloo group otherwise)."""
    if optimizer is not None and hasattr(optimizer, "wait_for_params"):
        optimizer.wait_for_params()
    mine = _blocks(model, topo)
    if group is None and dist.is_initialized() and topo.world_size > 1 and dist.get_backend() != "gloo":
        group = dist.new_group(backend="gloo")  # host objects; collective: every rank is here
    full = _collect(mine, topo, group)
    if topo.rank != 0:
        return None
    from safetensors.torch import save_file

    cfg = model_config(model)
    experts = fuse_experts(full, cfg.moe.n_experts, lora) if cfg.moe is not None else None
    vocab = cfg.vocab_size
    for name in VOCAB_ROWS:  # our padding's rows dropped
        if name in full:
            full[name] = full[name][:vocab]
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_file({peft_key(name): t.contiguous() for name, t in sorted(full.items())}, str(folder / WEIGHTS_FILE),
              metadata={"format": "pt"})
    (folder / CONFIG_FILE).write_text(json.dumps(adapter_config(lora, base_model, experts), indent=2))
    if base_model and Path(base_model).is_dir():  # the base's tokenizer goes along, as PEFT saves it
        from .hf import copy_companion_files

        copy_companion_files(base_model, folder)
    return folder


def _factor(name: str, which: str) -> str:
    """``model/layers.0.self_attn.q_proj.weight`` -> ``...q_proj.lora_A.weight`` (``which`` A or B)."""
    return name.removesuffix(".weight") + f".lora_{which}.weight"


class LoraExportView:
    """A checkpoint source seen without its LoRA factors, for a Hugging Face (or DCP)
    export: ``scaling`` None serves the base weights as saved; a number serves every
    adapted weight merged, ``W + scaling (B @ A)`` (PEFT's ``merge_and_unload``: the
    product in fp32, from the fp32 masters of a bf16 run where saved, cast to W's dtype).
    Everything else is the source's."""

    def __init__(self, source, scaling: float | None):
        self.source, self.scaling = source, scaling

    def __getattr__(self, name):
        return getattr(self.source, name)

    def names(self, *prefix) -> list[str]:
        return [n for n in self.source.names(*prefix) if ".lora_" not in n]

    def _merged(self, name: str) -> bool:
        return self.scaling is not None and name.startswith("model/") and self.source.has(_factor(name, "A"))

    def read_tiles(self, name: str):
        read = getattr(self.source, "read_tiles", None)
        return None if read is None or self._merged(name) else read(name)

    def _factor_region(self, name: str, which: str, offsets, shape) -> torch.Tensor:
        for prefix in ("master/", "model/"):
            key = prefix + _factor(name, which).removeprefix("model/")
            if self.source.has(key):
                return self.source.read_region(key, offsets, shape).float()
        raise KeyError(key)

    def read_region(self, name: str, offsets, shape) -> torch.Tensor:
        w = self.source.read_region(name, offsets, shape)
        if not self._merged(name):
            return w
        rank = self.source.spec(_factor(name, "A"))[0][0]
        (r0, c0), (rows, cols) = offsets, shape
        a = self._factor_region(name, "A", (0, c0), (rank, cols))  # (r, cols)
        b = self._factor_region(name, "B", (r0, 0), (rows, rank))  # (rows, r)
        return (w.float() + (b @ a) * self.scaling).to(w.dtype)

    def read(self, name: str) -> torch.Tensor:
        shape = self.source.spec(name)[0]
        return self.read_region(name, (0,) * len(shape), shape)


def lora_export_view(source, merge: bool):
    """``source`` for a Hugging Face export: unchanged without adapters; else a
    :class:`LoraExportView`, merged (``merge``) with the scaling alpha / rank of the
    ``[lora]`` section the checkpoint was trained with."""
    source = with_lora_base(source)  # a checkpoint of the adapters only: its base's frozen weights
    if not any(".lora_" in n for n in source.names()):
        return source
    if not merge:
        return LoraExportView(source, None)
    lora = ((getattr(getattr(source, "index", None), "config", None) or {}).get("lora") or {})
    if not lora.get("rank"):
        raise ValueError(f"{source.folder}: holds LoRA adapters but no [lora] section with their rank "
                         "and alpha to merge them with")
    return LoraExportView(source, float(lora["alpha"]) / int(lora["rank"]))


def base_reference(config: dict | None) -> str:
    """The Hugging Face base a LoRA run's checkpoint refers to for its frozen weights
    (``model.hf_checkpoint`` of the job it saved), or "" when it holds them itself."""
    config = config or {}
    if not (config.get("lora") or {}).get("rank"):
        return ""
    return (config.get("model") or {}).get("hf_checkpoint") or ""


class WithBase:
    """A LoRA checkpoint (what trained) over its Hugging Face base (the frozen weights):
    one source serving both; the checkpoint's own tensors, step and configs first."""

    def __init__(self, source, base):
        self.source, self.base = source, base

    def __getattr__(self, name):
        return getattr(self.source, name)

    def _of(self, name: str):
        return self.source if self.source.has(name) else self.base

    def names(self, *prefix) -> list[str]:
        own = self.source.names(*prefix)
        held, start = set(own), prefix[0] if prefix else ""
        return own + [n for n in self.base.names() if n.startswith(start) and n not in held]

    def has(self, name: str) -> bool:
        return self.source.has(name) or self.base.has(name)

    def spec(self, name: str):
        return self._of(name).spec(name)

    def read_region(self, name: str, offsets, shape):
        return self._of(name).read_region(name, offsets, shape)

    def read(self, name: str):
        return self._of(name).read(name)

    def read_tiles(self, name: str):
        read = getattr(self._of(name), "read_tiles", None)
        return None if read is None else read(name)

    def close(self) -> None:
        self.source.close()
        self.base.close()


def with_lora_base(source, config: dict | None = None):
    """``source`` (a checkpoint) with the frozen weights of the base it refers to, when it
    holds only what trained (:func:`base_reference`); else ``source`` unchanged."""
    from parallel3d.errors import UserError

    from .hf import HFFolder

    config = config if config is not None else getattr(getattr(source, "index", None), "config", None)
    base = base_reference(config)
    if not base or isinstance(source, WithBase):
        return source
    if not Path(base).is_dir():
        raise UserError(f"{source.folder} holds the LoRA adapters only; its base model.hf_checkpoint "
                        f"'{base}' is not there: put the base back at that path")
    return WithBase(source, HFFolder(base))
