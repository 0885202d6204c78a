"""The learning-rate schedule and the optimizer the trainer builds.

Every ``parallel.zero`` stage is the flat-buffer AdamW of :mod:`parallel3d.zero`: stage 0
keeps the whole optimizer state on every data-parallel rank and all-reduces gradients,
stages 1 and 2 shard it, 3 the parameters too (see :class:`~parallel3d.zero.ZeroOptimizer`). The step's two
halves and the global norm are in :mod:`parallel3d.grad_norm`.
"""

from __future__ import annotations

import contextlib
import math

import torch

from parallel3d.config import Dtype, TrainConfig
from parallel3d.grad_norm import applies_weight_decay
from parallel3d.topology import Topology
from parallel3d.zero import ZeroOptimizer
from parallel3d.zero.frozen import FrozenGroups, FrozenShards
from parallel3d.zero.split import SplitOptimizer, is_expert


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up over ``warmup_steps`` to ``lr``, then cosine to ``lr*min_lr_ratio``
    at the last step. ``step`` counts from 0."""
    if cfg.warmup_steps > 0 and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    decay_steps = max(1, cfg.steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / decay_steps)
    floor = cfg.lr * cfg.min_lr_ratio
    return floor + (cfg.lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def param_groups(params: list[torch.nn.Parameter], weight_decay: float) -> list[dict]:
    """torch AdamW parameter groups with parallel3d's decay rule (the reference loops of
    the benchmarks and tests use them)."""
    decay = [p for p in params if applies_weight_decay(p)]
    no_decay = [p for p in params if not applies_weight_decay(p)]
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


# ``train.dtype`` -> the parameters' storage dtype; "auto" (None) depends on the device.
STORAGE_DTYPES: dict[Dtype, torch.dtype | None] = {"auto": None, "fp32": torch.float32,
                                                   "bf16": torch.bfloat16}


def storage_dtype(train_cfg: TrainConfig, device: torch.device) -> torch.dtype:
    """The dtype parameters are stored in: bf16 with ``train.dtype`` bf16 (or auto on
    CUDA), fp32 otherwise. Under bf16 the optimizer keeps fp32 master weights."""
    chosen = STORAGE_DTYPES[train_cfg.dtype]
    if chosen is None:
        chosen = torch.bfloat16 if device.type == "cuda" else torch.float32
    return chosen


def autocast_for(train_cfg: TrainConfig, device: torch.device):
    """A factory of the forward's autocast context: bf16 autocast when parameters are
    stored in bf16 (the GEMMs' operands cast, fp32 where torch keeps it), else none."""
    if storage_dtype(train_cfg, device) != torch.bfloat16:
        return contextlib.nullcontext
    return lambda: torch.autocast(device.type, dtype=torch.bfloat16)


def build_optimizer(params, train_cfg: TrainConfig, parallel_cfg, topo: Topology, model=None,
                    timeline=None, device=None, dtype=None) -> ZeroOptimizer:
    """The optimizer for ``parallel.zero`` (0-3) over ``params``, stored in their
    current dtype (bf16 parameters get fp32 master weights in the optimizer); meta
    parameters are allocated in its flat buffer on ``device`` in ``dtype``. With ``model``
    given and ``parallel.overlap_param_gather`` on, the sharded stages overlap their
    post-step all-gather with the next forward pass; ``timeline`` records the optimizer's collective waits. Under expert parallelism
    the experts get an optimizer of their own over their replicas (:class:`SplitOptimizer`)."""
    params = list(params)
    kwargs = dict(stage=parallel_cfg.zero, bucket_mb=parallel_cfg.bucket_mb, offload=parallel_cfg.offload_optimizer,
                  reduce_dtype=parallel_cfg.reduce_dtype, overlap_param_gather=parallel_cfg.overlap_param_gather,
                  model=model, timeline=timeline, device=device, dtype=dtype)

    def frozen_shards(replicas, select=None):
        # ZeRO 3's frozen weights (LoRA's base) are sharded too, and first: the optimizer
        # would allocate them whole with the model's other meta tensors
        if parallel_cfg.zero != 3 or model is None or not any(
                p.is_meta and not p.requires_grad and (select is None or select(p)) for p in params):
            return None
        return FrozenShards(model, replicas, device, dtype or torch.float32, parallel_cfg.bucket_mb, select)

    if topo.ep > 1:
        # experts live on edp x cp replicas, the rest on dp x cp (and at ZeRO 3 their frozen
        # weights likewise): one optimizer each when experts train, else one optimizer with
        # both frozen holders beside it (LoRA on the attention only)
        frozen = (frozen_shards(topo.replicas(), lambda p: not is_expert(p)),
                  frozen_shards(topo.expert_replicas(), is_expert))
        if any(is_expert(p) and p.requires_grad for p in params):
            opt = SplitOptimizer(params, train_cfg, topo, **kwargs)
            opt.dense.frozen, opt.experts.frozen = frozen
            return opt
        frozen = FrozenGroups.of(frozen)
    else:
        frozen = frozen_shards(topo.replicas())
    opt = ZeroOptimizer(params, train_cfg, topo, **kwargs)
    opt.frozen = frozen
    return opt
