"""Building this rank's shards of a Llama without ever holding the full model.

    model, loss_fn = build_sharded_llama(cfg, topo, parallel_cfg, seed=1234, device=dev,
                                         dtype=torch.bfloat16)

builds the model on the meta device (shapes, no memory), parallelizes it (tensor and
pipeline parallelism: this rank's chunks and shards, still on meta), allocates only this
rank's parameters on ``device`` in ``dtype`` and fills them with :func:`init_llama_`, a
counter-based initialisation (:mod:`parallel3d.tensor_parallel.init`): each element
depends only on (seed, parameter name, index in the full tensor), so the shards equal
the slices of the unsharded model given ``init_llama_`` with the same seed, at any
layout. This is how the trainer builds every model. The distributions are those of
``Llama.reset_parameters``; the random stream is not (that one follows the global torch
RNG through the parameters in order, which only a full build can replay).
"""

from __future__ import annotations

import math

import torch

from parallel3d.tensor_parallel.init import counter_normal_, materialize_

from ..moe.parallelize import apply_expert_parallel
from .model import Llama, LlamaConfig
from .parallelize import parallelize_llama

VOCAB_PARAMS = ("embed_tokens.weight", "lm_head.weight")


@torch.no_grad()
def init_parameter_(p: torch.Tensor, name: str, cfg: LlamaConfig, seed: int) -> torch.Tensor:
    """Initialise parameter ``name`` of the model (``p``: the whole tensor, or a
    tensor-parallel shard carrying the ``p3d_tp_*`` attributes), in place."""
    if name.endswith(".bias"):  # q/k/v biases (Qwen2), as Llama.reset_parameters
        return p.zero_()
    if p.ndim == 1:
        return p.fill_(1.0)
    if cfg.tie_embeddings and name == "lm_head.weight":
        name = "embed_tokens.weight"  # one tensor, wherever it is held
    out_std = cfg.init_std / math.sqrt(2 * cfg.n_layers)
    std = out_std if name.endswith(("o_proj.weight", "down_proj.weight")) else cfg.init_std
    dim = getattr(p, "p3d_tp_dim", None)
    full, start = list(p.shape), 0
    if dim is not None:
        full[dim], start = p.p3d_tp_full, p.p3d_tp_range[0]
    counter_normal_(p, std, seed=seed, name=name, full_shape=full, dim=dim, start=start)
    if name in VOCAB_PARAMS and dim == 0:
        p[max(0, cfg.vocab_size - start):].zero_()  # rows padding the vocabulary
    return p


@torch.no_grad()
def init_llama_(model: Llama, seed: int, only: list | None = None) -> Llama:
    """Initialise every parameter ``model`` holds (a Llama, or a pipeline stage's chunks
    of one), whole or a tensor-parallel shard (read from the ``p3d_tp_*`` attributes),
    in place; ``only``: just these parameters (ZeRO 3 fills one bucket at a time)."""
    cfg = model.cfg if isinstance(model, Llama) else model.pipeline_chunks[0].cfg
    wanted = None if only is None else {id(p) for p in only}
    for name, p in model.named_parameters():
        if wanted is None or id(p) in wanted:
            init_parameter_(p, name, cfg, seed)
    for name, b in model.named_buffers():
        if name.endswith(".expert_bias"):  # MoE selection biases start at 0 (materialize_ leaves them empty)
            b.zero_()
    return model


def build_meta_llama(cfg: LlamaConfig, topo, parallel_cfg):
    """(this rank's model, its loss function) on the meta device: this rank's pipeline
    chunks, tensor-parallel shards and experts (under ``topo.ep``) as shapes, no memory. Allocate them with
    :func:`~parallel3d.tensor_parallel.init.materialize_` (or let the optimizer place them
    in its flat buffer) and fill them with :func:`init_llama_` or a checkpoint."""
    with torch.device("meta"):
        model = Llama(cfg)
    model, loss_fn = parallelize_llama(model, topo, parallel_cfg)
    if getattr(topo, "ep", 1) > 1:  # this rank's experts only (laid out from the coordinates)
        apply_expert_parallel(model, topo.ep_group, ep=topo.ep, ep_rank=topo.ep_rank)
    return model, loss_fn


def build_sharded_llama(cfg: LlamaConfig, topo, parallel_cfg, *, seed: int | None,
                        device: torch.device | str = "cpu", dtype: torch.dtype | None = None):
    """(this rank's model, its loss function), allocated shard by shard on ``device`` in
    ``dtype`` (default fp32) and initialised from ``seed`` (None: left uninitialised, for a
    caller that loads every parameter from a checkpoint)."""
    model, loss_fn = build_meta_llama(cfg, topo, parallel_cfg)
    materialize_(model, device, dtype)  # allocates this rank's shards only
    if seed is not None:
        init_llama_(model, seed)
    return model, loss_fn
