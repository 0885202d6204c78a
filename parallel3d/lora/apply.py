"""LoRA on this rank's part of a model: adapters on the target projections, every other
weight frozen unless ``lora.trainable`` names it.

    apply_lora(model, job_cfg, topo)          # on the meta model, before the optimizer
    ... optimizer (adapters + trainable only), materialize_, base init or load ...
    start_adapters_(model, job_cfg.lora, seed)  # A seeded (or a PEFT folder), B zero

``apply_lora`` takes the whole job because what it refuses spans sections (sequence
parallelism, the PEFT export). The frozen weights keep
``requires_grad=False``: the optimizer (which takes only parameters that train) gives
them no gradient buffer, no fp32 master and no Adam state; the trainer allocates them in
the storage dtype after the optimizer.
"""

from __future__ import annotations

import math

import torch

from parallel3d.errors import UserError, did_you_mean
from parallel3d.tensor_parallel.init import counter_normal_

from .adapters import adapter_parameters, attach, model_config
from .dropout import dropout_salt
from .experts import attach_experts
from .peft_io import check_adapter_config, load_adapter_, read_adapter_config

ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")
TARGETS = ATTENTION_TARGETS + MLP_TARGETS
# what lora.trainable may name: parts of parameter names
TRAINABLE = ("embed_tokens", "lm_head", "norm", "input_layernorm", "post_attention_layernorm",
             "q_norm", "k_norm", *TARGETS)


def lora_problems(cfg) -> list[str]:
    """Every reason the job ``cfg`` (a JobConfig) cannot run LoRA, each saying what to change."""
    lora, out = cfg.lora, []
    if lora.rank < 0:
        out.append(f"lora.rank {lora.rank} is negative: 0 (off) or the adapters' rank")
    if lora.rank == 0:
        if cfg.checkpoint.export_peft:
            out.append("checkpoint.export_peft writes LoRA adapters: set lora.rank (and lora.targets), "
                       "or drop checkpoint.export_peft")
        return out
    if lora.alpha <= 0:
        out.append(f"lora.alpha {lora.alpha} must be positive (the adapters' output is scaled by alpha / rank)")
    if not 0 <= lora.dropout < 1:
        out.append(f"lora.dropout {lora.dropout} is outside [0, 1): the probability of zeroing an adapter input")
    for t in lora.targets:
        if t not in TARGETS:
            out.append(f"lora.targets: unknown projection {t!r}{did_you_mean(t, TARGETS)}; one of {', '.join(TARGETS)}")
    if not lora.targets:
        out.append("lora.targets is empty: name the projections that get adapters (q_proj, v_proj, ...)")
    for t in lora.trainable:
        if t not in TRAINABLE:
            out.append(f"lora.trainable: unknown weight {t!r}{did_you_mean(t, TRAINABLE)}; one of {', '.join(TRAINABLE)}")
    both = sorted(set(lora.trainable) & set(lora.targets))
    if cfg.checkpoint.export_peft and both:  # peft wraps a module either way, not both
        out.append(f"checkpoint.export_peft: {', '.join(both)} both in lora.targets and in lora.trainable, which "
                   "a PEFT folder cannot hold (an adapter or modules_to_save): drop them from one of the two")
    if lora.adapter and not out:  # its adapter_config.json against [lora], before any worker reads it
        try:
            check_adapter_config(read_adapter_config(lora.adapter), lora, lora.adapter)
        except UserError as e:
            out.append(str(e))
    return out


def apply_lora(model: torch.nn.Module, cfg, topo) -> torch.nn.Module:
    """Attach adapters to the ``cfg.lora.targets`` projections of every decoder layer
    ``model`` (a Llama or a PipelineStage, after parallelize, usually on meta) holds and
    freeze every parameter but the adapters and those ``cfg.lora.trainable`` names.
    ``cfg.lora.rank`` 0: nothing changes. Raises :class:`UserError` naming what to change."""
    lora = cfg.lora
    problems = lora_problems(cfg)
    if problems:
        raise UserError("; ".join(problems))
    if lora.rank == 0:
        return model
    if lora.dropout > 0 and model_config(model).moe is not None and set(lora.targets) & set(MLP_TARGETS):
        # an expert's tokens arrive permuted by the dispatch, without their stream keys
        raise UserError(f"lora.dropout {lora.dropout} on a Mixture-of-Experts model's MLP projections is not "
                        "implemented: set lora.dropout=0, or keep lora.targets to the attention projections")
    for key, layer in model.layers.items():
        experts = getattr(layer.mlp, "experts", None)  # a Mixture-of-Experts layer's routed experts
        owners = []
        for target in lora.targets:
            if target in ATTENTION_TARGETS:
                owners.append((layer.self_attn, target))
            elif experts is None:
                owners.append((layer.mlp, target))
            elif getattr(layer.mlp, "shared_expert", None) is not None:
                owners.append((layer.mlp.shared_expert, target))
        for owner, target in owners:
            proj = getattr(owner, target, None)
            if not isinstance(proj, torch.nn.Module):
                raise UserError(f"LoRA: layer {key} has no {target}: drop {target} from lora.targets")
            name = f"layers.{key}.{'self_attn' if owner is layer.self_attn else 'mlp'}.{target}"
            attach(proj, lora.rank, lora.alpha, topo.tp, topo.tp_rank, lora.dropout,
                   dropout_salt(cfg.train.seed, name))
        if experts is not None:
            attach_experts(experts, lora.targets, lora.rank, lora.alpha, topo.tp, topo.tp_rank)
    trainable = set(lora.trainable)
    if cfg.checkpoint.export_peft and model_config(model).moe is not None and trainable & set(MLP_TARGETS):
        raise UserError(f"checkpoint.export_peft with lora.trainable {sorted(trainable & set(MLP_TARGETS))} on a "
                        "Mixture-of-Experts model is not written (transformers fuses the experts): drop them from "
                        "lora.trainable, or export the merged model with checkpoint.export_hf")
    if cfg.checkpoint.export_peft and model_config(model).tie_embeddings and trainable & {"embed_tokens", "lm_head"}:
        raise UserError("checkpoint.export_peft with a trained tied embedding is not written (peft's modules_to_save "
                        "would hold two copies): export the merged model with checkpoint.export_hf")
    if model_config(model).tie_embeddings and trainable & {"embed_tokens", "lm_head"}:
        trainable |= {"embed_tokens", "lm_head"}  # one tensor, whichever stage holds it
    for name, p in model.named_parameters():
        p.requires_grad_(bool(getattr(p, "p3d_lora", False)) or bool(trainable & set(name.split("."))))
    return model


@torch.no_grad()
def init_adapters_(model: torch.nn.Module, seed: int, only=None) -> None:
    """``A`` from the counter-based init keyed by its name (the same values at any
    layout), N(0, 1/(3 in)): the variance of PEFT's kaiming-uniform (a = sqrt 5, bound
    1/sqrt(in)); ``B`` zero, as PEFT starts (the adapted model equals the base). ``only``:
    those of these parameters (ZeRO 3's bucket being filled)."""
    for name, p in adapter_parameters(model, only):
        if name.endswith("lora_B.weight"):
            p.zero_()
            continue
        dim = getattr(p, "p3d_tp_dim", None)
        full, start = list(p.shape), 0
        if dim is not None:
            full[dim], start = p.p3d_tp_full, p.p3d_tp_range[0]
        counter_normal_(p, 1.0 / math.sqrt(3 * full[1]), seed=seed, name=name,
                        full_shape=full, dim=dim, start=start)


def start_adapters_(model: torch.nn.Module, lora, seed: int, only=None) -> None:
    """Fill the adapters (after the base weights are in place, before the optimizer takes
    its masters): from ``lora.adapter`` (a PEFT folder, this rank's slices) or seeded;
    ``only``: those among these parameters (ZeRO 3 fills one bucket at a time)."""
    if lora.rank == 0:
        return
    if lora.adapter:
        load_adapter_(model, lora, only)
    else:
        init_adapters_(model, seed, only)
