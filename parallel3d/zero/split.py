"""Two flat-buffer optimizers for a model whose experts live on fewer ranks than its dense
weights (expert parallelism).

Under ``parallel.ep`` the dense weights (attention, norms, embeddings, the router, shared
experts) are held by every dp x cp replica, but each routed expert only by the ranks of
its expert-data-parallel group, edp x cp (``Topology.expert_replicas``): its gradient
already sums the rows every rank of its expert group sent it, so it is summed over edp x
cp and divided by dp x cp, as the dense weights' gradients are averaged over the dp x cp
replicas (divided by edp x cp alone, it would be ep times too large: Adam would hide
most of it, but not the clipping norm or eps); ZeRO shards its state over edp x cp. So the parameters split in two sets, each a
:class:`~parallel3d.zero.ZeroOptimizer` over its own replicas::

    dense    dp x cp replicas      P_dense / (dp cp) state per rank at ZeRO 1/2
    experts  edp x cp replicas     P_experts_local / (edp cp), P_experts_local = P_experts / ep

and this class steps them as one: one begin, one reduction (the global norm is the sum of
both shares: every expert is counted by the holders of its shard only), one update with
the same clipping coefficient. Experts are the parameters ``parallelize`` marks
``p3d_expert`` (``models/moe/parallelize.py``). At ep 1 both sets have the same replicas
and the trainer builds a single optimizer.
"""

from __future__ import annotations

import torch

from parallel3d.grad_norm import GlobalNormOptimizer

from .optimizer import ZeroOptimizer


def is_expert(p: torch.nn.Parameter) -> bool:
    return bool(getattr(p, "p3d_expert", False))


class SplitOptimizer(GlobalNormOptimizer):
    """The dense and the expert :class:`ZeroOptimizer` stepped as one (``parts``), with the
    interface the trainer and the checkpoints use."""

    def __init__(self, params, cfg, topo, *, model=None, **kwargs):
        params = list(params)
        dense = [p for p in params if not is_expert(p)]
        experts = [p for p in params if is_expert(p)]
        if not experts:
            raise ValueError("SplitOptimizer needs expert parameters (marked p3d_expert)")
        # meta parameters: each part allocates its own in its flat buffer; the last one the
        # model's remaining meta tensors (buffers), as a single optimizer would
        self.dense = ZeroOptimizer(dense, cfg, topo, model=model, materialize_rest=False, **kwargs)
        self.experts = ZeroOptimizer(experts, cfg, topo, model=model, replicas=topo.expert_replicas(),
                                     grad_divisor=topo.dp_cp, **kwargs)
        self.parts = (self.dense, self.experts)
        self.topo, self.timeline = topo, kwargs.get("timeline")
        self.stage = self.dense.stage
        self.shards_over_dp = self.dense.shards_over_dp
        self.before_update = self.dense.before_update  # one list: both parts wait on its gates
        self.experts.before_update = self.before_update

    @property
    def params(self) -> list[torch.nn.Parameter]:
        return self.dense.params + self.experts.params

    @property
    def step_count(self) -> int:
        return self.dense.step_count

    def begin_step(self, backward_passes: int | None = None) -> None:
        for part in self.parts:
            part.begin_step(backward_passes)

    def zero_grad(self) -> None:
        self.begin_step(None)

    def fill_params(self, fill, params: list | None = None) -> None:
        """``fill(ps)`` writes the start values of parameters ``ps``: at stage 3 each part's
        parameters bucket by bucket (:meth:`ZeroOptimizer.fill_params`, ``params`` None:
        both parts' own), at other stages one call, ``fill(params)``."""
        if self.stage != 3:
            fill(params)
            return
        if params is not None:
            raise ValueError("ZeRO 3 fills every parameter of each part: pass params=None")
        for part in self.parts:
            part.fill_params(fill)

    def take_masters(self) -> None:
        for part in self.parts:
            part.take_masters()

    def reduce_gradients(self) -> torch.Tensor:
        """Both parts' reductions; the sum of their shares of the squared global norm."""
        return self.dense.reduce_gradients() + self.experts.reduce_gradients()

    def apply(self, lr: float, norm: torch.Tensor, skip: bool = False) -> None:
        for part in self.parts:
            part.apply(lr, norm, skip)

    def finish_param_gather(self) -> None:
        for part in self.parts:
            part.finish_param_gather()

    wait_for_params = finish_param_gather

    def release(self) -> None:
        for part in self.parts:
            part.release()

    @property
    def trace(self):
        return self.dense.trace

    @trace.setter
    def trace(self, events) -> None:
        for part in self.parts:
            part.trace = events

    def memory_tensors(self) -> dict[str, list[torch.Tensor]]:
        out: dict[str, list[torch.Tensor]] = {}
        for part in self.parts:
            for kind, tensors in part.memory_tensors().items():
                out.setdefault(kind, []).extend(tensors)
        return out

    def state_dict(self) -> dict:
        return {"dense": self.dense.state_dict(), "experts": self.experts.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.dense.load_state_dict(state["dense"])
        self.experts.load_state_dict(state["experts"])
