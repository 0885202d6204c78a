"""Pipeline parallelism for the Llama family: this rank's chunks of the model
(:func:`cut_pipeline_stages`, split by each layer's cost and the head's,
:func:`stage_costs`), tied embeddings across stages, the chunks gathered under the
unsplit names (:class:`PipelineStage`), and the B/W split of every weight's backward for
the zero-bubble schedules (:func:`split_llama_weight_grads`)."""

from __future__ import annotations

from functools import partial

import torch
from torch import nn

from parallel3d.kernels.deferred import defer
from parallel3d.pipeline.partition import layer_ranges, rank_chunks, resolve_split
from parallel3d.tensor_parallel.split_backward import split_weight_grads

from .config import stage_costs
from .model import Llama, RMSNorm, _RMSNormFn


def cut_pipeline_stages(model: Llama, topo, parallel_cfg) -> list[Llama]:
    """This rank's chunks of ``model`` (one per virtual stage, in order), each a Llama over
    a contiguous run of layers that shares its modules with ``model``: the first chunk of
    the pipeline keeps the embedding, the last the final norm and the head. Layers keep
    their global keys, so parameter names are those of the unsplit model.

    With tied embeddings the first and last stage both hold the one matrix: the pipeline
    schedule sums its gradient over ``topo.embed_group``, and the last stage's copy is
    left out of the gradient norm (``p3d_norm_owner = False``)."""
    cfg = model.cfg
    v = parallel_cfg.virtual_stages
    counts = resolve_split(cfg.n_layers, topo.pp, v, parallel_cfg.pp_layers, *stage_costs(cfg),
                           schedule=parallel_cfg.schedule)
    ranges = layer_ranges(counts)
    last = len(counts) - 1
    return [_chunk(model, ranges[c], first=c == 0, last=c == last)
            for c in rank_chunks(topo.pp_rank, topo.pp, v, parallel_cfg.schedule)]


def mark_tied_embeddings(chunks: list[Llama]) -> None:
    """Under pp > 1 with tied embeddings, once tensor parallelism made them their final
    parameters: when the embedding and the head are on different ranks, mark both (the
    optimizer sums their gradients over ``topo.embed_group`` and the norm counts the head's
    copy out). When this rank holds both in different chunks (zb-v's V puts the first and
    the last chunk on rank 0), the head takes the embedding's parameter itself, which then
    gets one gradient per chunk and micro-batch (``p3d_grads_per_micro_batch``: ZeRO's
    bucket counting waits for both)."""
    if not chunks[0].cfg.tie_embeddings:
        return
    embeds = [c.embed_tokens for c in chunks if c.embed_tokens is not None]
    heads = [c.lm_head for c in chunks if c.lm_head is not None]
    if embeds and heads:
        heads[0].weight = embeds[0].weight  # the same (Vp/tp, dim) rows at any tp
        embeds[0].weight.p3d_grads_per_micro_batch = 2
        return
    for module in embeds + heads:
        module.weight.p3d_tied_embedding = True
    for head in heads:
        head.weight.p3d_norm_owner = False  # counted on the first stage


class _SplitRMSNormFn(_RMSNormFn):
    """:class:`~.model._RMSNormFn` whose weight gradient a zero-bubble W computes (the
    same arithmetic: ``dw = sum over rows of dy * n``, ``dx`` as there)."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        ctx.weight = weight  # the W's target (recomputation hands back copies of saved tensors)
        return _RMSNormFn.forward(ctx, x, weight, eps)

    @staticmethod
    def backward(ctx, dy):
        x, weight, rstd = ctx.saved_tensors
        dw = None
        if ctx.needs_input_grad[1]:
            param = ctx.weight

            def weight_grads() -> list:  # keeps x, rstd and dy (not an fp32 copy of x r)
                n = (x.to(rstd.dtype) * rstd).to(x.dtype)
                return [(param, (dy * n).reshape(-1, x.shape[-1]).sum(0).to(weight.dtype))]

            if not defer(weight_grads):
                dw = weight_grads()[0][1]
        n32 = x.to(rstd.dtype) * rstd
        g = (dy * weight).to(rstd.dtype)
        dx = rstd * (g - n32 * (g * n32).mean(-1, keepdim=True))
        return dx.to(x.dtype), dw, None


def _split_rms_norm_forward(norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
    return _SplitRMSNormFn.apply(x, norm.weight, norm.eps)


def split_llama_weight_grads(model: Llama) -> Llama:
    """Every weight of ``model`` (a chunk, after tensor parallelism) gets a backward that
    honours the B/W split of zero-bubble schedules (``parallel3d.kernels.deferred``): the
    tensor-parallel layers do already; ``nn.Linear`` and ``nn.Embedding`` (tp = 1) go
    through ``tensor_parallel.split_backward``, the RMSNorms through
    :class:`_SplitRMSNormFn`. Parameters and their names are unchanged."""
    split_weight_grads(model)
    for module in model.modules():
        if isinstance(module, RMSNorm):
            module.forward = partial(_split_rms_norm_forward, module)
    return model


def _chunk(model: Llama, layers: range, first: bool, last: bool) -> Llama:
    # The shell is built on the meta device (no memory, no initialisation cost) and then
    # given the real modules of its part.
    with torch.device("meta"):
        chunk = Llama(model.cfg)
    chunk.embed_tokens = model.embed_tokens if first else None
    chunk.layers = nn.ModuleDict({str(i): model.layers[str(i)] for i in layers})
    chunk.norm = model.norm if last else None
    chunk.lm_head = model.lm_head if last else None
    return chunk


class PipelineStage(nn.Module):
    """This rank's chunks gathered under the unsplit names (``embed_tokens``,
    ``layers.<global index>``, ``norm``, ``lm_head``, whichever it holds), so parameters,
    ``state_dict`` keys and checkpoints do not depend on the split. It is not called: the
    schedule runs each of ``pipeline_chunks`` (a plain list, so nothing is registered
    twice)."""

    def __init__(self, chunks: list[Llama]):
        super().__init__()
        self.pipeline_chunks = chunks
        self.embed_tokens = chunks[0].embed_tokens
        self.layers = nn.ModuleDict({k: layer for c in chunks for k, layer in c.layers.items()})
        self.norm = chunks[-1].norm
        self.lm_head = chunks[-1].lm_head

    def forward(self, *args, **kwargs):
        raise RuntimeError("a PipelineStage is run chunk by chunk by the pipeline schedule "
                           "(parallel3d.pipeline), not called as a whole")
