"""Gradients from the backward pass to fp32, data-parallel-averaged shards.

Stage 1 keeps a full fp32 gradient buffer (one flat tensor laid out like the buckets);
fp32 parameters get their ``.grad`` as views into it, so autograd accumulates the
micro-batches in place. At the optimizer step every bucket is reduce-scattered into this
rank's shard.

Stage 2 never holds the full gradient. A hook on each parameter
(``register_post_accumulate_grad_hook``) counts the gradients ready per bucket; when a
bucket is complete, its gradients are packed into a transient fp32 bucket, ``.grad`` is
released, and an asynchronous reduce-scatter is issued, while autograd goes on with the
earlier layers. Buckets are issued strictly in index order, so every rank issues the same
collectives in the same order. At the end of each backward pass (an autograd callback)
the reductions are waited for and summed into the fp32 shard: gradient accumulation over
micro-batches happens in the shard, at 1/dp of the memory, at the cost of one
reduce-scatter per micro-batch (as DeepSpeed's ZeRO-2 does).

Either way gradients are accumulated and reduced in fp32, whatever the parameter dtype.
"""

from __future__ import annotations

import torch

from parallel3d.distributed import reduce_scatter_flat

from .buckets import BucketLayout

class _Reduction:
    """One bucket's reduce-scatter in flight: on :meth:`finish` the reduced shard is
    written (first contribution of the step) or added (later micro-batches) into ``dest``.
    The collective is :func:`parallel3d.distributed.reduce_scatter_flat` (NCCL's own, an
    all-to-all and a local sum on gloo).
    """

    def __init__(self, bucket_flat: torch.Tensor, dest: torch.Tensor, accumulate: bool, group):
        self.dest, self.accumulate = dest, accumulate
        if group is None:
            self.work, self.result = None, bucket_flat
        else:
            self.result = torch.empty_like(dest) if accumulate else dest
            self.work = reduce_scatter_flat(self.result, bucket_flat, group, async_op=True)
        self._keep = bucket_flat  # alive until the collective is done

    def finish(self) -> None:
        if self.work is not None:
            self.work.wait()
        if self.accumulate:
            self.dest.add_(self.result)
        elif self.result is not self.dest:
            self.dest.copy_(self.result)
        self._keep = self.result = None


class GradReducer:
    """Owns the gradient storage of a :class:`~parallel3d.zero.optimizer.ZeroOptimizer`.

    ``shard`` is the flat fp32 gradient shard of this rank (one piece per bucket, in
    bucket order, as :meth:`BucketLayout.shard_offsets`). Set ``trace`` to a list to
    record ``("grad", param_index)``, ``("issue", bucket)`` and ``("done", bucket)``
    events in order (the overlap test reads it).
    """

    def __init__(self, params: list[torch.nn.Parameter], layout: BucketLayout, topo,
                 stage: int, device: torch.device):
        self.params, self.layout, self.stage = params, layout, stage
        self.dp, self.dp_rank = topo.dp, topo.dp_rank
        self.group = topo.dp_group if topo.dp > 1 else None
        self.shard = torch.zeros(layout.shard_numel, dtype=torch.float32, device=device)
        offsets = layout.shard_offsets()
        self.shard_views = [self.shard[o:o + b.shard_numel] for o, b in zip(offsets, layout.buckets)]
        self.trace: list | None = None
        self._accumulated = [False] * len(layout.buckets)
        self.full = None
        if stage == 1:
            self.full = torch.zeros(layout.numel, dtype=torch.float32, device=device)
            self._full_views = [self._param_view(self.full, i) for i in range(len(params))]
        self._ready = [0] * len(layout.buckets)
        self._next = 0  # next bucket to issue (stage 2)
        self._inflight: list[tuple[int, _Reduction]] = []
        self._callback_queued = False
        self._hooks = []
        for i, p in enumerate(params):
            if stage == 2 or p.dtype != torch.float32:
                self._hooks.append(p.register_post_accumulate_grad_hook(self._make_hook(i)))
        self.zero()

    def _param_view(self, flat: torch.Tensor, i: int) -> torch.Tensor:
        b, seg = self.layout.location[i]
        start = self.layout.buckets[b].offset + seg.start
        return flat[start:start + seg.numel].view(self.params[i].shape)

    # -- the step's life cycle -----------------------------------------------------------
    @torch.no_grad()
    def zero(self) -> None:
        self._accumulated = [False] * len(self.layout.buckets)
        if self.stage == 1:
            self.full.zero_()
            for p, view in zip(self.params, self._full_views):
                # fp32 params accumulate straight into the buffer; others via the hook
                p.grad = view if p.dtype == torch.float32 else None
        else:
            for p in self.params:
                p.grad = None

    @torch.no_grad()
    def reduced(self) -> torch.Tensor:
        """The fp32 gradient shard, summed over micro-batches and averaged over dp."""
        if self.stage == 1:
            self._adopt_foreign_grads()
            for b, bucket in enumerate(self.layout.buckets):
                flat = self.full[bucket.offset:bucket.offset + bucket.numel]
                self._issue(b, flat)
            self._finish_inflight()
        for b, done in enumerate(self._accumulated):
            if not done:  # no backward pass reached this bucket in this step
                self.shard_views[b].zero_()
        if self.dp > 1:
            self.shard.div_(self.dp)
        return self.shard

    def _adopt_foreign_grads(self) -> None:
        """Stage 1: a ``.grad`` that is not our view (someone replaced it) is copied in."""
        for p, view in zip(self.params, self._full_views):
            if p.grad is not None and p.grad.data_ptr() != view.data_ptr():
                view.add_(p.grad)
                p.grad = view if p.dtype == torch.float32 else None

    # -- collectives ---------------------------------------------------------------------
    def _issue(self, b: int, bucket_flat: torch.Tensor) -> None:
        if self.trace is not None:
            self.trace.append(("issue", b))
        red = _Reduction(bucket_flat, self.shard_views[b], self._accumulated[b], self.group)
        self._accumulated[b] = True
        self._inflight.append((b, red))

    def _finish_inflight(self) -> None:
        for b, red in self._inflight:
            red.finish()
            if self.trace is not None:
                self.trace.append(("done", b))
        self._inflight = []

    # -- hooks ---------------------------------------------------------------------------
    def _make_hook(self, i: int):
        def hook(p: torch.Tensor) -> None:
            self._on_grad(i, p)
        return hook

    @torch.no_grad()
    def _on_grad(self, i: int, p: torch.Tensor) -> None:
        if self.trace is not None:
            self.trace.append(("grad", i))
        if self.stage == 1:  # a low-precision param: accumulate into the fp32 buffer
            self._full_views[i].add_(p.grad)
            p.grad = None
            return
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
        b, _ = self.layout.location[i]
        self._ready[b] += 1
        while self._next < len(self._ready) and \
                self._ready[self._next] == len(self.layout.buckets[self._next].segments):
            self._issue_packed(self._next)
            self._next += 1

    def _issue_packed(self, b: int) -> None:
        """Pack bucket ``b``'s gradients into a fresh fp32 buffer, release ``.grad``, and
        issue its reduction. A parameter without a gradient contributes zeros."""
        bucket = self.layout.buckets[b]
        flat = torch.zeros(bucket.numel, dtype=torch.float32, device=self.shard.device)
        views, grads = [], []
        for seg in bucket.segments:
            p = self.params[seg.index]
            if p.grad is not None:
                views.append(flat[seg.start:seg.end])
                grads.append(p.grad.view(-1))
                p.grad = None
        if views:
            torch._foreach_copy_(views, grads)
        self._issue(b, flat)

    @torch.no_grad()
    def _end_of_backward(self) -> None:
        while self._next < len(self._ready):  # buckets with a parameter that got no gradient
            self._issue_packed(self._next)
            self._next += 1
        self._finish_inflight()
        self._ready = [0] * len(self._ready)
        self._next = 0
        self._callback_queued = False

    def memory_tensors(self) -> list[torch.Tensor]:
        out = [self.shard] + ([self.full] if self.full is not None else [])
        return out + [p.grad for p in self.params if p.grad is not None]
