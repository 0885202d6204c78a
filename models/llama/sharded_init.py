"""Building this rank's shards of a Llama without ever holding the full model.

    model, loss_fn = build_sharded_llama(cfg, topo, parallel_cfg, seed=1234, device=dev)

builds the model on the meta device (shapes, no memory), parallelizes it, allocates only
this rank's parameters and fills them with :func:`init_llama_`, a counter-based
initialisation (:mod:`parallel3d.tensor_parallel.init`): each element depends only on
(seed, parameter name, index in the full tensor), so the shards equal the slices of the
unsharded model given ``init_llama_`` with the same seed, at any tp. The distributions
are those of ``Llama.reset_parameters``; the random stream is not (that one follows the
global torch RNG through the parameters in order, which only a full build can replay).
"""

from __future__ import annotations

import math

import torch

from parallel3d.tensor_parallel.init import counter_normal_, materialize_

from .model import Llama, LlamaConfig
from .parallelize import parallelize_llama

VOCAB_PARAMS = ("embed_tokens.weight", "lm_head.weight")


@torch.no_grad()
def init_llama_(model: Llama, seed: int) -> Llama:
    """Initialise every parameter ``model`` holds, whole or a tensor-parallel shard
    (read from the ``p3d_tp_*`` attributes), in place."""
    cfg = model.cfg
    out_std = cfg.init_std / math.sqrt(2 * cfg.n_layers)
    for name, p in model.named_parameters():
        if name.endswith(".bias"):  # q/k/v biases (Qwen2), as Llama.reset_parameters
            p.zero_()
            continue
        if p.ndim == 1:
            p.fill_(1.0)
            continue
        if cfg.tie_embeddings and name == "lm_head.weight":
            name = "embed_tokens.weight"  # one tensor, wherever it is held
        std = out_std if name.endswith(("o_proj.weight", "down_proj.weight")) else cfg.init_std
        dim = getattr(p, "p3d_tp_dim", None)
        full, start = list(p.shape), 0
        if dim is not None:
            full[dim], start = p.p3d_tp_full, p.p3d_tp_range[0]
        counter_normal_(p, std, seed=seed, name=name, full_shape=full, dim=dim, start=start)
        if name in VOCAB_PARAMS and dim == 0:
            p[max(0, cfg.vocab_size - start):].zero_()  # rows padding the vocabulary
    return model


def build_sharded_llama(cfg: LlamaConfig, topo, parallel_cfg, *, seed: int,
                        device: torch.device | str = "cpu"):
    """(this rank's model, its loss function), allocated and initialised shard by shard."""
    with torch.device("meta"):
        model = Llama(cfg)
    model, loss_fn = parallelize_llama(model, topo, parallel_cfg)
    materialize_(model, device)  # allocates this rank's shards only
    return init_llama_(model, seed), loss_fn
