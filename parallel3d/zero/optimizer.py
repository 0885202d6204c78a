"""The flat-buffer AdamW of every ZeRO stage: 0 (replicated), 1 and 2 (sharded over dp).

The parameters of this rank (whatever tensor and pipeline parallelism left on it) become
views of one flat buffer packed in buckets (:mod:`parallel3d.zero.buckets`); gradients are
reduced in fp32 (:mod:`parallel3d.zero.grads`); AdamW steps flat fp32 master shards::

                         stage 0            stage 1        stage 2    stage 3
    parameters           P                  P              P          P/dp + gathered buckets
    fp32 gradients       P                  P + P/dp       P/dp       P/dp
    fp32 master weights  P if params bf16   P/dp if params bf16       (else the params)
    Adam moments         2P                 2P/dp          2P/dp      2P/dp

One step: each bucket's gradient is reduced as soon as the step's last backward pass has
filled it (stage 0: all-reduced, every rank keeps the average; 1: reduce-scattered so
rank r receives the dp-average of its shard; 2: reduce-scattered every micro-batch); the
gradients of a tied embedding (first and last pipeline stage hold it, each in a bucket of
its own) are summed over the two; the global gradient norm is the sum of squares over
every rank's shard (each replicated parameter counted once); AdamW updates the master
shard; the updated shard is written into the parameter buffer and (stages 1 and 2) every
bucket is all-gathered back to all ranks. Those all-gathers are asynchronous: with
``model`` given, each module waits, in a forward pre-hook, only for the buckets holding
its own parameters, so the first layers compute while the later layers' parameters are
still arriving (that publication, and ``take_masters``: :mod:`parallel3d.zero.publish`).

It receives whatever parameters ``parallelize`` left on this rank and the topology's
groups; tensor parallelism shows only in the gradients several tp ranks hold partially
(``p3d_tp_partial_grad``: summed over their holders on the reduced shard).
"""

from __future__ import annotations

import math
import typing

import torch

from parallel3d.config import TrainConfig, ZeroStage
from parallel3d.distributed import all_reduce
from parallel3d.grad_norm import (GlobalNormOptimizer, applies_weight_decay, clip_factor,
                                  counts_in_norm, norm_pieces, squared_norm)
from parallel3d.pipeline.timeline import comm_span
from parallel3d.tensor_parallel.grad_sync import sum_over_tp_holders
from parallel3d.tensor_parallel.init import materialize_
from parallel3d.topology import Topology

from .adam import CpuOffloadAdamW, FlatAdamW
from .buckets import BucketLayout
from .grads import GradReducer
from .params import ShardedParams
from .publish import ParamPublication


def _unique(params) -> list[torch.nn.Parameter]:
    seen, out = set(), []
    for p in params:
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


class ZeroOptimizer(ParamPublication, GlobalNormOptimizer):
    """AdamW over flat buffers; optimizer state (stage 1) and gradients (stage 2) sharded
    over dp.

    Interface (:class:`~parallel3d.grad_norm.GlobalNormOptimizer`): ``begin_step(n)``,
    ``reduce_gradients()``, ``apply(lr, norm)``, ``step(lr) -> grad_norm``,
    ``state_dict()``, ``load_state_dict()``.

    Args:
        params: this rank's parameters (registration order; tied ones once), stored in
            the dtype the model is trained in (bf16 parameters get fp32 master weights).
            Meta parameters (a model built on the meta device) are placed straight into
            the flat buffer, allocated on ``device`` in ``dtype``: ``model`` then gets
            new parameter objects, uninitialised views of the buffer; fill them (seeded
            init, a checkpoint) and call :meth:`take_masters`. The full parameters never
            exist twice.
        stage: 0, 1, 2 or 3 (the parameters sharded too, :mod:`parallel3d.zero.params`:
            gathered bucket by bucket around each module's forward and backward; needs
            ``model``).
        bucket_mb: bucket size in MiB of fp32 gradient.
        replicas: the ranks holding the same ``params`` (default ``topo.replicas()``, dp x
            cp); the experts' optimizer passes ``topo.expert_replicas()``.
        grad_divisor: what the summed gradients are divided by (default: the replicas'
            number); the experts' optimizer passes dp x cp.
        materialize_rest: with meta parameters, also allocate the model's other meta
            parameters and buffers (False: leave them for another optimizer).
        offload: keep master weights and moments on the CPU; step with DeepSpeed's CPU Adam
            (stages 1 and 2).
        model: the module owning ``params``; when given (and ``overlap_param_gather``), the
            post-step all-gather of each bucket is waited for lazily in forward pre-hooks.
        overlap_param_gather: stages 1/2 with ``model``: leave the post-step all-gathers in
            flight until the forward needs them (``parallel.overlap_param_gather``); False:
            :meth:`apply` waits for them all before returning.
        timeline: where the optimizer's collective waits and bucket reductions are
            recorded (the trainer's step timeline).
    """

    def __init__(self, params, cfg: TrainConfig, topo: Topology, *, stage: ZeroStage = 1,
                 bucket_mb: float = 25.0, offload: bool = False, reduce_dtype: str = "fp32",
                 model: torch.nn.Module | None = None, overlap_param_gather: bool = True, timeline=None,
                 device: torch.device | None = None, dtype: torch.dtype | None = None,
                 replicas=None, grad_divisor: int | None = None, materialize_rest: bool = True):
        if stage not in typing.get_args(ZeroStage):  # a caller other than the config's
            raise ValueError(f"ZeroOptimizer stage must be one of {typing.get_args(ZeroStage)}, got {stage}")
        if offload and stage in (0, 3):
            raise ValueError("the CPU-offloaded optimizer needs stage 1 or 2")
        if stage == 3 and model is None:
            raise ValueError("ZeRO stage 3 needs the model (its modules gather their parameters)")
        self.params = _unique(params)
        self.cfg, self.topo, self.stage, self.offload = cfg, topo, stage, offload
        self.frozen = None  # stage 3 with frozen weights (LoRA): their FrozenShards (.frozen), set by the caller
        self.timeline = timeline
        # The ranks holding the same weights (dp x cp; context-parallel ranks hold the same
        # weights as data-parallel ones): gradients average, and stages 1/2 shard, over them.
        # ``replicas`` other than the default: the experts' (edp x cp, parallel3d.zero.split).
        replicas = replicas or topo.replicas()
        self.replicas = replicas
        self.dp, self.dp_rank = replicas.size, replicas.rank
        # stage 0: every replica holds the whole state (one "shard" of the whole layout)
        self.shards_over_dp = stage > 0
        self.shard_dp, self.shard_rank = (replicas.size, replicas.rank) if stage > 0 else (1, 0)
        self.dp_group = replicas.group  # None at one replica
        meta = self.params[0].is_meta
        if meta and (model is None or device is None):
            raise ValueError("meta parameters need the model they belong to and a device")
        device = device if meta else self.params[0].device
        param_dtype = (dtype or torch.float32) if meta else self.params[0].dtype
        bucket_numel = max(1, int(bucket_mb * 2**20) // 4)
        tied = {i for i, p in enumerate(self.params) if getattr(p, "p3d_tied_embedding", False)}
        self.layout = BucketLayout([p.numel() for p in self.params], bucket_numel, self.shard_dp,
                                   alone=tied)
        state_device = torch.device("cpu") if offload else device
        # fp32 parameters on the optimizer's device are their own master weights
        self.master_is_param = param_dtype == torch.float32 and state_device == device
        self._materialize_rest = materialize_rest
        self._build_buffers(device, param_dtype, state_device, model if meta else None)
        if not meta:
            self.take_masters()
        self.reducer = GradReducer(self.params, self.layout, topo, stage, device, reduce_dtype, replicas,
                                   grad_divisor)
        if timeline is not None:
            self.reducer.on_issue = lambda b: timeline.instant(f"reduce bucket {b}", bucket=b)
        self._build_norm_runs()
        self._build_partial_pieces()
        self._tied_views = [self.reducer.shard_views[self.layout.location[i][0]] for i in sorted(tied)]
        self.step_count = 0
        self._gathers: dict[int, object] = {}
        self._bucket_of = {id(p): self.layout.location[i][0] for i, p in enumerate(self.params)}
        self.read_waits = None
        self._build_adam(state_device)
        self._overlap_gather = model is not None and overlap_param_gather
        # called before apply() changes a weight or a moment: a background checkpoint
        # copying them from the training thread's tensors (CheckpointWriter.wait_copied)
        self.before_update: list = []
        if stage == 3:
            self.sharded.hook(model, self.params)
            self.reducer.on_ready = self.sharded.bucket_done
        elif self._overlap_gather and self.shards_over_dp and self.dp_group is not None:
            self._hook_forward(model)

    # -- construction ----------------------------------------------------------------------
    @torch.no_grad()
    def _build_buffers(self, device, param_dtype, state_device, meta_model) -> None:
        """The flat parameter buffer (every parameter becomes a view of it: copied in, or,
        for meta parameters, placed there uninitialised) and the fp32 master shards."""
        layout = self.layout
        self.sharded = None
        if self.stage == 3:  # each bucket's full storage apart, freed while not in use
            self.sharded = ShardedParams(layout, len(self.params), self.shard_rank, self.dp_group,
                                         device, param_dtype)
            self.param_buffer, self.param_shards = None, self.sharded.shards
            views = self.sharded.views([p.shape for p in self.params])
        else:
            self.param_buffer = torch.zeros(layout.numel, dtype=param_dtype, device=device)
            self.param_shards = []
            for b in layout.buckets:
                lo, hi = b.shard_range(self.shard_rank)
                self.param_shards.append(self.param_buffer[b.offset + lo:b.offset + hi])
            views = []
            for i, p in enumerate(self.params):
                b, seg = layout.location[i]
                start = layout.buckets[b].offset + seg.start
                views.append(self.param_buffer[start:start + seg.numel].view(p.shape))
        if meta_model is not None:
            if not all(p.is_meta for p in self.params):
                raise ValueError("parameters must be all on the meta device or none")
            new = materialize_(meta_model, device, param_dtype,
                               storage={id(p): v for p, v in zip(self.params, views)},
                               only_storage=not self._materialize_rest)
            self.params = [new[id(p)] for p in self.params]
        else:
            copy = {id(v): p.detach() for p, v in zip(self.params, views)}
            self.fill_params(lambda vs: [v.copy_(copy[id(v)]) for v in vs], views)
            for p, view in zip(self.params, views):
                p.data = view
        if self.master_is_param:
            self.master_flat = None
            self.masters = self.param_shards
        else:
            pin = state_device.type == "cpu" and device.type == "cuda"
            self.master_flat = torch.zeros(layout.shard_numel, dtype=torch.float32,
                                           device=state_device, pin_memory=pin)
            offsets = layout.shard_offsets()
            self.masters = [self.master_flat[o:o + b.shard_numel] for o, b in zip(offsets, layout.buckets)]

    def fill_params(self, fill, params: list | None = None) -> None:
        """``fill(ps)`` writes the start values of parameters ``ps``: at stage 3 those of
        ``params`` (default: this optimizer's) one bucket at a time, each bucket's storage
        dropped once its shard is taken (:meth:`ShardedParams.fill_by_bucket`); at other
        stages one call, ``fill(params)`` (None: every parameter of the model, frozen
        ones included)."""
        if self.sharded is not None:
            if params is None and self.frozen is not None:
                self.frozen.fill_params(fill)
            self.sharded.fill_by_bucket(self.params if params is None else params, fill)
        else:
            fill(params)

    def _build_partial_pieces(self) -> None:
        """(slice of the gradient shard, p3d_tp_shared) for parameters marked
        ``p3d_tp_partial_grad``, in layout order."""
        self._partial_pieces = []
        for b, bucket in enumerate(self.layout.buckets):
            g = self.reducer.shard_views[b]
            for seg, lo, hi in bucket.shard_pieces(self.shard_rank):
                p = self.params[seg.index]
                if getattr(p, "p3d_tp_partial_grad", False):
                    self._partial_pieces.append((g[lo:hi], p.p3d_tp_shared))

    def _build_norm_runs(self) -> None:
        """Pieces of the gradient shard counted in the global norm (see counts_in_norm)."""
        owner = lambda i: counts_in_norm(self.params[i])  # noqa: E731
        self._norm_views = []
        for b, bucket in enumerate(self.layout.buckets):
            g = self.reducer.shard_views[b]
            self._norm_views += norm_pieces([g[r.lo:r.hi] for r in bucket.shard_runs(self.shard_rank, owner)
                                             if r.flag])

    def _decay_runs(self) -> list[tuple[int, int, int, bool]]:
        decays = lambda i: applies_weight_decay(self.params[i])  # noqa: E731
        return [(b, r.lo, r.hi, r.flag) for b, bucket in enumerate(self.layout.buckets)
                for r in bucket.shard_runs(self.shard_rank, decays)]

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

    # -- the interface the trainer sees ------------------------------------------------------
    def begin_step(self, backward_passes: int | None = None) -> None:
        """Zero the gradients for a step of ``backward_passes`` backward passes (its
        micro-batches): each bucket is reduced as soon as the last of them has filled it.
        None: reduce everything in :meth:`reduce_gradients`."""
        self.reducer.begin_step(backward_passes)

    def zero_grad(self) -> None:
        self.begin_step(None)

    @torch.no_grad()
    def reduce_gradients(self) -> torch.Tensor:
        """Reduce the gradients into this rank's fp32 shard (summed over micro-batches,
        averaged over dp); return the shard's share of the squared global norm (its owner
        pieces: the other shards and model parts are counted on other ranks; at stage 0,
        where every dp rank holds the same average, dp rank 0 counts it)."""
        with comm_span(self.timeline, "grad sync"):
            self._wait_gathers(list(self._gathers))  # (apply() writes the shards)
            self.reducer.reduced()  # fp32, this rank's shard, averaged over dp
            if self._tied_views:
                # the embedding (first stage) and the head (last stage) are one tensor: both
                # take the sum of their gradients, so the two copies stay equal
                flat = torch.cat(self._tied_views) if len(self._tied_views) > 1 else self._tied_views[0]
                all_reduce(flat, self.topo.embed_group)
                if flat is not self._tied_views[0]:
                    torch._foreach_copy_(self._tied_views, list(flat.split([v.numel() for v in self._tied_views])))
        # Parameters several tp ranks hold with partial gradients (norms under sequence
        # parallelism, replicated kv-heads): sum their pieces of the shard over the tp
        # holders. Summing commutes with the dp mean, and every rank of a tp group has the
        # same bucket layout and dp_rank, so the pieces line up.
        with comm_span(self.timeline, "grad norm"):
            sum_over_tp_holders(self._partial_pieces, self.topo)
        counted = self._norm_views if self.shards_over_dp or self.dp_rank == 0 else []
        return squared_norm(counted, self.reducer.shard.device, pieces=True)

    @torch.no_grad()
    def apply(self, lr: float, norm: torch.Tensor, skip: bool = False) -> None:
        if skip or not math.isfinite(float(norm)):  # same norm on every rank: all skip
            return
        for gate in self.before_update:  # a checkpoint still copying the weights (async save)
            gate()
        grad = self.reducer.shard
        coef = clip_factor(norm, self.cfg.grad_clip)
        if coef is not None:
            grad.mul_(coef)
        self.step_count += 1
        if self.offload and self._grad_host is not grad:
            self._grad_host.copy_(grad)
        self.adam.step(self.step_count, lr)
        self._publish_params()

    def release(self) -> None:
        """Let go of the parameters' gradient hooks (see :meth:`GradReducer.release`), after
        any all-gather in flight: the buffers are freed once the optimizer is dropped."""
        self.wait_for_params()
        self.reducer.release()
        if self.sharded is not None:
            self.sharded.release()
        if self.frozen is not None:
            self.frozen.release()

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
        params = [self.sharded.shard_flat] if self.sharded is not None else []
        params += self.frozen.memory_tensors() if self.frozen is not None else []
        return {"grads": grads, "optimizer_state": state, "params": params}

    def state_dict(self) -> dict:
        """This rank's shard: master weights (when they are not the parameters), moments,
        step, and the layout they belong to (checked on load)."""
        self.wait_for_params()
        state = {"stage": self.stage, "step": self.step_count, "dp": self.shard_dp,
                 "dp_rank": self.shard_rank, "bucket_numels": [b.numel for b in self.layout.buckets],
                 "adam": self.adam.state_dict()}
        if self.master_flat is not None:
            state["master"] = self.master_flat
        return state

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        mine = [b.numel for b in self.layout.buckets]
        if (state["dp"], state["dp_rank"], state["bucket_numels"]) != (self.shard_dp, self.shard_rank, mine):
            raise ValueError(f"optimizer shard was saved for dp={state['dp']} rank {state['dp_rank']} "
                             f"with buckets {state['bucket_numels']}; this rank has dp={self.shard_dp} "
                             f"rank {self.shard_rank} with buckets {mine}")
        self.wait_for_params()
        self.step_count = state["step"]
        self.adam.load_state_dict(state["adam"])
        if self.master_flat is not None:
            self.master_flat.copy_(state["master"])
            self._publish_params()
            self.wait_for_params()
