"""The sharded (ZeRO stage 1 and 2) optimizer.

Each data-parallel rank holds the full model parameters, for the forward and backward
passes, but only its shard of everything else (see :mod:`parallel3d.zero.buckets`)::

                         stage 0 (DataParallelOptimizer)   stage 1       stage 2
    parameters           P                                 P             P
    fp32 gradients       P                                 P + P/dp      P/dp
    fp32 master weights  -  (fp32 params are the master)   P/dp if the params are bf16
    Adam moments         2P                                2P/dp         2P/dp

One step: the gradients are reduce-scattered (stage 2: during the backward pass) so rank r
receives the dp-average of its shard; the global gradient norm is the sum of squares over
every rank's shard (all-reduced over dp, then over the tensor/pipeline groups, each
replicated parameter counted once); AdamW updates the master shard; the updated shard is
written into the parameter buffer and every bucket is all-gathered back to all ranks.
Those all-gathers are asynchronous: with ``model`` given, each module waits, in a forward
pre-hook, only for the buckets holding its own parameters, so the first layers compute
while the later layers' parameters are still arriving.

The optimizer does not know about tensor or pipeline parallelism: it receives whatever
parameters ``parallelize`` left on this rank and the topology's groups.
"""

from __future__ import annotations

import math

from functools import partial

import torch

from parallel3d.config import TrainConfig
from parallel3d.distributed import all_gather_flat
from parallel3d.pipeline.timeline import comm_span
from parallel3d.tensor_parallel.grad_sync import sum_over_tp_holders
from parallel3d.topology import Topology
from parallel3d.train.optim import (GlobalNormOptimizer, applies_weight_decay, clip_factor,
                                    counts_in_norm, squared_norm)

from .adam import CpuOffloadAdamW, FlatAdamW
from .buckets import BucketLayout
from .grads import GradReducer


def _unique(params) -> list[torch.nn.Parameter]:
    seen, out = set(), []
    for p in params:
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


class ZeroOptimizer(GlobalNormOptimizer):
    """AdamW with optimizer state (stage 1) and gradients (stage 2) sharded over dp.

    Same interface as :class:`~parallel3d.train.optim.DataParallelOptimizer`:
    ``zero_grad()``, ``step(lr) -> grad_norm``, ``state_dict()``, ``load_state_dict()``.

    Args:
        params: this rank's parameters (registration order; tied ones once).
        stage: 1 or 2.
        bucket_mb: bucket size in MiB of fp32 gradient.
        offload: keep master weights and moments on the CPU; step with DeepSpeed's CPU Adam.
        param_dtype: dtype of the model parameters (bf16 for mixed precision, with fp32
            master weights); default: the parameters' current dtype.
        model: the module owning ``params``; when given, the post-step all-gather of each
            bucket is waited for lazily in forward pre-hooks.
    """

    def __init__(self, params, cfg: TrainConfig, topo: Topology, *, stage: int = 1,
                 bucket_mb: float = 25.0, offload: bool = False,
                 param_dtype: torch.dtype | None = None, model: torch.nn.Module | None = None):
        if stage not in (1, 2):
            raise ValueError(f"ZeroOptimizer stage must be 1 or 2, got {stage}")
        self.params = _unique(params)
        self.cfg, self.topo, self.stage, self.offload = cfg, topo, stage, offload
        self.dp, self.dp_rank = topo.dp, topo.dp_rank
        self.dp_group = topo.dp_group if topo.dp > 1 else None
        device = self.params[0].device
        param_dtype = param_dtype or self.params[0].dtype
        bucket_numel = max(1, int(bucket_mb * 2**20) // 4)
        self.layout = BucketLayout([p.numel() for p in self.params], bucket_numel, self.dp)
        state_device = torch.device("cpu") if offload else device
        # fp32 parameters on the optimizer's device are their own master weights
        self.master_is_param = param_dtype == torch.float32 and state_device == device
        self._build_buffers(device, param_dtype, state_device)
        self.reducer = GradReducer(self.params, self.layout, topo, stage, device)
        self._build_norm_runs()
        self._build_partial_pieces()
        self.step_count = 0
        self._gathers: dict[int, object] = {}
        self._build_adam(state_device)
        self._overlap_gather = model is not None
        if model is not None:
            self._hook_forward(model)

    # -- construction ----------------------------------------------------------------------
    @torch.no_grad()
    def _build_buffers(self, device, param_dtype, state_device) -> None:
        layout = self.layout
        self.param_buffer = torch.zeros(layout.numel, dtype=param_dtype, device=device)
        self.param_shards = []
        for b in layout.buckets:
            lo, hi = b.shard_range(self.dp_rank)
            self.param_shards.append(self.param_buffer[b.offset + lo:b.offset + hi])
        if self.master_is_param:
            self.master_flat = None
            self.masters = self.param_shards
        else:  # fp32 copies of this rank's pieces, taken from the original values
            pin = state_device.type == "cpu" and device.type == "cuda"
            self.master_flat = torch.zeros(layout.shard_numel, dtype=torch.float32,
                                           device=state_device, pin_memory=pin)
            offsets = layout.shard_offsets()
            self.masters = [self.master_flat[o:o + b.shard_numel] for o, b in zip(offsets, layout.buckets)]
            for b, master in zip(layout.buckets, self.masters):
                s_lo, _ = b.shard_range(self.dp_rank)
                for seg, lo, hi in b.shard_pieces(self.dp_rank):
                    src = self.params[seg.index].detach().reshape(-1)
                    master[lo:hi].copy_(src[s_lo + lo - seg.start:s_lo + hi - seg.start])
        for i, p in enumerate(self.params):  # parameters become views of the flat buffer
            b, seg = layout.location[i]
            start = layout.buckets[b].offset + seg.start
            view = self.param_buffer[start:start + seg.numel].view(p.shape)
            view.copy_(p.detach())
            p.data = view

    def _build_partial_pieces(self) -> None:
        """(slice of the gradient shard, p3d_tp_shared) for parameters marked
        ``p3d_tp_partial_grad``, in layout order."""
        self._partial_pieces = []
        for b, bucket in enumerate(self.layout.buckets):
            g = self.reducer.shard_views[b]
            for seg, lo, hi in bucket.shard_pieces(self.dp_rank):
                p = self.params[seg.index]
                if getattr(p, "p3d_tp_partial_grad", False):
                    self._partial_pieces.append((g[lo:hi], p.p3d_tp_shared))

    def _build_norm_runs(self) -> None:
        """Pieces of the gradient shard counted in the global norm (see counts_in_norm)."""
        owner = lambda i: counts_in_norm(self.params[i])  # noqa: E731
        self._norm_views = []
        for b, bucket in enumerate(self.layout.buckets):
            g = self.reducer.shard_views[b]
            self._norm_views += [g[r.lo:r.hi] for r in bucket.shard_runs(self.dp_rank, owner) if r.flag]

    def _decay_runs(self) -> list[tuple[int, int, int, bool]]:
        decays = lambda i: applies_weight_decay(self.params[i])  # noqa: E731
        return [(b, r.lo, r.hi, r.flag) for b, bucket in enumerate(self.layout.buckets)
                for r in bucket.shard_runs(self.dp_rank, decays)]

    def _build_adam(self, state_device) -> None:
        runs = self._decay_runs()
        grad = self.reducer.shard
        if self.offload:
            if grad.device != state_device:  # the CPU Adam reads its gradient from host memory
                self._grad_host = torch.zeros(grad.numel(), dtype=torch.float32, pin_memory=True)
            else:
                self._grad_host = grad
            views = [self._grad_host[o:o + m.numel()]
                     for o, m in zip(self.layout.shard_offsets(), self.masters)]
            self.adam = CpuOffloadAdamW(self.masters, views, runs, self.cfg)
        else:
            self.adam = FlatAdamW(self.masters, grad, self.layout.shard_offsets(), runs, self.cfg)

    def _hook_forward(self, model: torch.nn.Module) -> None:
        index = {id(p): i for i, p in enumerate(self.params)}
        for module in model.modules():
            buckets = sorted({self.layout.location[index[id(p)]][0]
                              for p in module.parameters(recurse=False) if id(p) in index})
            if buckets:
                module.register_forward_pre_hook(partial(self._wait_gathers, buckets))

    # -- the interface the trainer sees ------------------------------------------------------
    def zero_grad(self) -> None:
        self.reducer.zero()

    @torch.no_grad()
    def reduce_gradients(self) -> torch.Tensor:
        """Reduce the gradients into this rank's fp32 shard (summed over micro-batches,
        averaged over dp); return the shard's share of the squared global norm (its owner
        pieces: the other shards and model parts are counted on other ranks)."""
        with comm_span(self.timeline, "grad sync"):
            self.wait_for_params()
            self.reducer.reduced()  # fp32, this rank's shard, averaged over dp
        # Parameters several tp ranks hold with partial gradients (norms under sequence
        # parallelism, replicated kv-heads): sum their pieces of the shard over the tp
        # holders. Summing commutes with the dp mean, and every rank of a tp group has the
        # same bucket layout and dp_rank, so the pieces line up.
        with comm_span(self.timeline, "grad norm"):
            sum_over_tp_holders(self._partial_pieces, self.topo)
        return squared_norm(self._norm_views, self.reducer.shard.device)

    @torch.no_grad()
    def apply(self, lr: float, norm: torch.Tensor, skip: bool = False) -> None:
        if skip or not math.isfinite(float(norm)):  # same norm on every rank: all skip
            return
        grad = self.reducer.shard
        coef = clip_factor(norm, self.cfg.grad_clip)
        if coef is not None:
            grad.mul_(coef)
        self.step_count += 1
        if self.offload and self._grad_host is not grad:
            self._grad_host.copy_(grad)
        self.adam.step(self.step_count, lr)
        self._publish_params()

    def _publish_params(self) -> None:
        """Updated master shards -> parameter buffer -> all-gathered to every dp rank.

        Buckets are sent last-first: the last bucket holds the first layers, which the
        next forward pass needs first."""
        for b in reversed(range(len(self.layout.buckets))):
            if not self.master_is_param:
                self.param_shards[b].copy_(self.masters[b], non_blocking=True)
            if self.dp_group is not None:
                bucket = self.layout.buckets[b]
                out = self.param_buffer[bucket.offset:bucket.offset + bucket.numel]
                self._gathers[b] = all_gather_flat(out, self.param_shards[b], group=self.dp_group,
                                                   async_op=True)
        if not self._overlap_gather:
            self.wait_for_params()

    def _wait_gathers(self, buckets: list[int], module=None, args=None) -> None:
        if self._gathers:
            for b in buckets:
                work = self._gathers.pop(b, None)
                if work is not None:
                    work.wait()

    def wait_for_params(self) -> None:
        """Block until every parameter holds the values of the last step."""
        self._wait_gathers(list(self._gathers))

    # -- inspection and checkpoints --------------------------------------------------------------
    @property
    def trace(self):
        return self.reducer.trace

    @trace.setter
    def trace(self, events: list | None) -> None:
        self.reducer.trace = events

    def memory_tensors(self) -> dict[str, list[torch.Tensor]]:
        """Tensors this optimizer holds, by kind, for :func:`parallel3d.zero.memory_report`."""
        state = self.adam.state_tensors()
        if self.master_flat is not None:
            state.append(self.master_flat)
        grads = self.reducer.memory_tensors()
        if self.offload and self._grad_host is not self.reducer.shard:
            grads.append(self._grad_host)
        return {"grads": grads, "optimizer_state": state}

    def state_dict(self) -> dict:
        """This rank's shard: master weights (when they are not the parameters), moments,
        step, and the layout they belong to (checked on load)."""
        self.wait_for_params()
        state = {"stage": self.stage, "step": self.step_count, "dp": self.dp, "dp_rank": self.dp_rank,
                 "bucket_numels": [b.numel for b in self.layout.buckets], "adam": self.adam.state_dict()}
        if self.master_flat is not None:
            state["master"] = self.master_flat
        return state

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        mine = [b.numel for b in self.layout.buckets]
        if (state["dp"], state["dp_rank"], state["bucket_numels"]) != (self.dp, self.dp_rank, mine):
            raise ValueError(f"optimizer shard was saved for dp={state['dp']} rank {state['dp_rank']} "
                             f"with buckets {state['bucket_numels']}; this rank has dp={self.dp} rank "
                             f"{self.dp_rank} with buckets {mine}")
        self.wait_for_params()
        self.step_count = state["step"]
        self.adam.load_state_dict(state["adam"])
        if self.master_flat is not None:
            self.master_flat.copy_(state["master"])
            self._publish_params()
            self.wait_for_params()
