"""What a training step does for a Mixture-of-Experts model, beside the dense path.

Around the forward and backward passes of a step (``models/moe/parallelize.py``)::

    begin_step(n_micro)   each sparse layer's auxiliary-loss weight for this step
    finish_step()         the step's expert counts summed over the replicas; the
                          aux-loss-free biases moved; this rank's parts of the figures
    record(parts)         after the step's world all-reduce: the record's fields

The record's ``loss`` stays the language-model loss (comparable with a dense run); the
auxiliary loss is ``aux_loss`` beside it (coefficient included), with
``expert_imbalance`` (the largest max / mean assignments per expert of any sparse layer
over the global batch; 1 is balanced) and ``dropped_tokens`` (assignments over capacity).
"""

from __future__ import annotations

import torch

from parallel3d.expert_parallel.dispatch import CATEGORY
from parallel3d.expert_parallel.grouped_backends import agree_on_grouped_backends
from parallel3d.models.moe.parallelize import (ExpertParallelExperts, finish_moe_step, prepare_moe_training,
                                               use_grouped_gemm)


class MoESteps:
    def __init__(self, model, n_sparse_layers: int, topo, sequence_parallel: bool, timeline=None):
        self.model, self.topo, self.sp = model, topo, sequence_parallel
        self.n_sparse = n_sparse_layers
        self.timeline = timeline
        for module in model.modules():  # the token all-to-alls record their waits there
            if isinstance(module, ExpertParallelExperts):
                module.timeline = timeline

    @classmethod
    def of(cls, model, model_cfg, topo, parallel, timeline=None, train=None, device=None) -> "MoESteps | None":
        """None for a model without sparse layers anywhere (a stage without any of a MoE
        model's sparse layers still takes part in the figures' reduction). The experts run
        through the grouped GEMMs of ``parallel.linear_backend``; under "auto" on CUDA
        rank 0 measures Triton against ``torch._grouped_mm`` on this run's expert stacks
        and every rank adopts its table (collective; nothing on CPU)."""
        moe = getattr(model_cfg, "moe", None)
        if moe is None:
            return None
        n_sparse = sum(moe.is_sparse(i) for i in range(model_cfg.n_layers))
        if not n_sparse:
            return None
        stacks = use_grouped_gemm(model, parallel.linear_backend)
        if device is not None and device.type == "cuda" and parallel.linear_backend == "auto" and train is not None:
            tokens = train.micro_batch * train.seq_len // topo.cp
            if parallel.sequence_parallel:
                tokens //= topo.tp
            rows = tokens * moe.top_k // topo.ep  # the rows one rank's stack gets on average
            shapes = sorted({s for g, dim, ffn in stacks for s in ((g, rows, ffn, dim), (g, rows, dim, ffn))})
            agree_on_grouped_backends(shapes, torch.bfloat16, device, topo.world_group)
        return cls(model, n_sparse, topo, parallel.sequence_parallel, timeline)

    def begin_step(self, n_micro: int) -> None:
        prepare_moe_training(self.model, self.topo, self.sp, n_micro, self.n_sparse)

    def finish_step(self) -> dict:
        """This rank's parts (:func:`finish_moe_step`) and its seconds blocked in the token
        all-to-alls (max over the world: the slowest rank's)."""
        parts = finish_moe_step(self.model, self.topo, self.sp)
        waited = self.timeline.step_breakdown().get(CATEGORY, 0.0) if self.timeline is not None else 0.0
        parts["all_to_all_s"] = parts["imbalance"].new_tensor(waited)
        return parts

    def record(self, reduced: dict, step_time_s: float) -> dict:
        """The record's fields from the world-reduced parts."""
        a2a = float(reduced["all_to_all_s"])
        return {"aux_loss": float(reduced["aux_loss"]) / self.topo.dp,
                "expert_imbalance": float(reduced["imbalance"]),
                "dropped_tokens": int(round(float(reduced["dropped"]))),
                "all_to_all_s": a2a, "all_to_all_share": a2a / step_time_s if step_time_s > 0 else 0.0}
