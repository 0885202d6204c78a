"""Turn a plain :class:`Llama` into this rank's part of a parallel model.

Data parallelism needs no change to the model. Pipeline parallelism cuts it into chunks
(:func:`cut_pipeline_stages`); tensor parallelism (swapping q/k/v/gate/up for
column-parallel and o/down for row-parallel layers) plugs in here too.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from parallel3d.errors import UserError
from parallel3d.pipeline.partition import layer_ranges, rank_chunks, resolve_split

from .model import Llama, LlamaConfig


def cross_entropy_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over all (B*S) positions, computed in fp32."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def parallelize_llama(model: Llama, topo, parallel_cfg) -> tuple[nn.Module, callable]:
    """Return (this rank's model, its loss function).

    With ``pp > 1`` the model is a :class:`PipelineStage`: this rank's chunks under the
    unsplit parameter names, run by the pipeline schedule through ``.pipeline_chunks``.
    """
    if topo.tp > 1:
        raise UserError("parallel.tp > 1 is not implemented yet: use parallel.tp=1")
    if topo.pp > 1:
        model = PipelineStage(cut_pipeline_stages(model, topo, parallel_cfg))
    return model, cross_entropy_loss


# -- pipeline stages -----------------------------------------------------------------------

def activation_shape(model_cfg: LlamaConfig, micro_batch: int, seq_len: int, tp: int = 1) -> tuple[int, int, int]:
    """What one pipeline stage hands the next (and the gradient that comes back):
    the hidden states ``(micro_batch, seq_len, dim)``. Under sequence parallelism each tp
    rank would hold ``seq_len // tp`` positions; that would be the only change here."""
    del tp  # no sequence parallelism: every tp rank holds the whole sequence
    return (micro_batch, seq_len, model_cfg.dim)


def stage_costs(cfg: LlamaConfig) -> tuple[float, float]:
    """(embedding, head) cost in decoder layers, by GEMM FLOPs per token (the split rule
    of ``parallel3d.pipeline.partition``). The embedding is a gather: 0. The head is one
    ``dim x vocab`` GEMM against the layer's attention and MLP GEMMs. Tensor parallelism
    divides both alike, so the ratio holds for any tp."""
    hd = cfg.head_dim
    layer = 2 * cfg.dim * cfg.n_heads * hd + 2 * cfg.dim * cfg.n_kv_heads * hd + 3 * cfg.dim * cfg.ffn_dim
    return 0.0, cfg.vocab_size * cfg.dim / layer


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
    counts = resolve_split(cfg.n_layers, topo.pp, v, parallel_cfg.pp_layers, *stage_costs(cfg))
    ranges = layer_ranges(counts)
    last = len(counts) - 1
    chunks = [_chunk(model, ranges[c], first=c == 0, last=c == last)
              for c in rank_chunks(topo.pp_rank, topo.pp, v)]
    if cfg.tie_embeddings:
        for chunk in chunks:
            if chunk.embed_tokens is not None:
                chunk.embed_tokens.weight.p3d_tied_embedding = True
            if chunk.lm_head is not None:
                chunk.lm_head.weight.p3d_tied_embedding = True
                chunk.lm_head.weight.p3d_norm_owner = False  # counted on the first stage
    return chunks


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
