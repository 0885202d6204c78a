"""Gradients from the backward pass to fp32, data-parallel-averaged (shards of) buckets.

Stages 0 and 1 keep a full fp32 gradient buffer (one flat tensor laid out like the
buckets); fp32 parameters get their ``.grad`` as views into it, so autograd accumulates
the micro-batches in place, and a low-precision parameter's gradient is added into it by
a hook and released. A hook on every parameter (``register_post_accumulate_grad_hook``)
counts its gradient accumulations: once a parameter has received the step's last one (the
optimizer is told how many backward passes the step has, :meth:`GradReducer.begin_step`)
it is final, and as soon as every parameter of a bucket is final the bucket's reduction is
issued, asynchronously, while autograd goes on with the earlier layers: an all-reduce
over dp in place (stage 0, every rank keeps the whole average) or a reduce-scatter into
this rank's shard (stage 1). So the last micro-batch's backward pass overlaps the
gradient communication, bucket by bucket, as the first buckets fill first (buckets hold
parameters in reverse order). A parameter two of this rank's pipeline chunks use (zb-v's
tied embedding and head, both on rank 0) gets two gradients per micro-batch and says so
(``p3d_grads_per_micro_batch``). Zero-bubble schedules compute weight gradients in their
W actions, after the B that computed the input gradients; the W hands them to autograd
(``parallel3d.kernels.deferred``), so the same hooks count them there.

Stage 2 never holds the full gradient. When a bucket's gradients of one backward pass are
complete, they are packed into a transient fp32 bucket, ``.grad`` is released, and an
asynchronous reduce-scatter is issued; at the end of each backward pass (an autograd
callback) the reductions are waited for and summed into the fp32 shard: gradient
accumulation over micro-batches happens in the shard, at 1/dp of the memory, at the cost
of one reduce-scatter per micro-batch (as DeepSpeed's ZeRO-2 does).

Buckets are issued strictly in index order, so every rank of the dp group issues the same
collectives in the same order (NCCL requires it). At most :data:`MAX_INFLIGHT` reductions
are in flight: issuing another first finishes the oldest (on NCCL a stream wait, the host
goes on; on gloo the host waits), so the transient buffers of the reductions (stage 2's
packed buckets, gloo's receive buffers) stay within four buckets. Four, not two: the
buckets fill in bursts (a layer's large weights complete several at once), and with two a
backward whose link has room on average still waited for reductions (dp 2 across two
hosts with comm ~ compute, two runs: the step 1.24x and 1.30x max(compute, comm) against
1.29x and 1.32x with two, 4-5% off the step; eight or sixteen gave no more;
benchmarks/README.md). Either way gradients
are accumulated in fp32, whatever the parameter dtype, and reduced in fp32 by default.

``reduce_dtype = "bf16"`` (``parallel.reduce_dtype``) sends each bucket as a bf16 copy of
its fp32 values: half the bytes on the wire. Each contribution is rounded once to bf16 (a
relative error of at most 2^-8). A reduce-scatter (stages 1 and 2) sums what it receives
into the fp32 shard: on gloo the all-to-all's copies are summed locally in fp32; NCCL's
reduce-scatter sums in bf16 (dp-1 more roundings along its ring) and the result is added
into fp32. Stage 0's all-reduce sums in bf16 on either backend and copies the result into
the fp32 buffer. Accumulation over micro-batches stays in fp32 (the buffer or the shard).
"""

from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist

from parallel3d.distributed import reduce_scatter_flat

from .buckets import BucketLayout

MAX_INFLIGHT = 4  # bucket reductions in flight at once (see the module docstring)
REDUCE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}  # parallel.reduce_dtype


class _Reduction:
    """One bucket's collective in flight: on :meth:`finish` the reduced values are in
    ``dest``: written (first contribution of the step) or added (stage 2's later
    micro-batches). ``dest`` is the bucket itself for an all-reduce (stage 0), this rank's
    shard of it for a reduce-scatter (:func:`parallel3d.distributed.reduce_scatter_flat`:
    NCCL's own, an all-to-all and a local sum on gloo)."""

    def __init__(self, bucket_flat: torch.Tensor, dest: torch.Tensor, accumulate: bool, group,
                 all_reduce: bool, wire_dtype: torch.dtype = torch.float32):
        self.dest, self.accumulate = dest, accumulate
        in_place = dest.data_ptr() == bucket_flat.data_ptr() and dest.numel() == bucket_flat.numel()
        if group is not None and wire_dtype != bucket_flat.dtype:
            bucket_flat = bucket_flat.to(wire_dtype)  # what crosses the wire (the only copy)
            in_place = False
        if group is None:
            self.work, self.result = None, dest if in_place else bucket_flat
        elif all_reduce:
            assert not accumulate, "stage 0 reduces each bucket once"
            self.result = dest if in_place else bucket_flat  # a bf16 copy: copied back on finish
            self.work = dist.all_reduce(self.result, group=group, async_op=True)
        else:
            # into fp32 (gloo sums the received bf16 copies in it; NCCL upcasts its bf16 sum)
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

    ``shard`` is the flat fp32 gradient this rank reduces into (one piece per bucket, in
    bucket order, as :meth:`BucketLayout.shard_offsets`): the whole buffer at stage 0.
    ``on_issue(bucket)`` and ``on_done(bucket)``, when set, are called as a bucket's
    reduction is issued and finished (the optimizer marks them on the step's timeline);
    ``trace``, when a list, records ``("grad", param_index)``, ``("issue", bucket)`` and
    ``("done", bucket)`` in order (the overlap tests read it).
    """

    def __init__(self, params: list[torch.nn.Parameter], layout: BucketLayout, topo,
                 stage: int, device: torch.device, reduce_dtype: str = "fp32", replicas=None,
                 divisor: int | None = None):
        self.params, self.layout, self.stage = params, layout, stage
        self.wire_dtype = REDUCE_DTYPES[reduce_dtype]
        # the ranks holding the same weights: dp x cp (experts: edp x cp)
        replicas = replicas or topo.replicas()
        self.dp = replicas.size
        # the summed gradient is divided by the data replicas whose losses it sums: the
        # replicas themselves (dense weights), or all dp x cp for an expert, whose gradient
        # also sums the rows its expert group's ranks sent it (parallel3d.zero.split)
        self.divisor = divisor or replicas.size
        self.shard_rank = replicas.rank if stage > 0 else 0
        self.group = replicas.group  # None at one replica: nothing to reduce
        self.trace: list | None = None
        self.on_issue = self.on_done = self.on_ready = None
        self.full = None
        if stage in (0, 1):
            self.full = torch.zeros(layout.numel, dtype=torch.float32, device=device)
            self._full_views = [self._param_view(self.full, i) for i in range(len(params))]
        if stage == 0:
            self.shard = self.full
        else:
            self.shard = torch.zeros(layout.shard_numel, dtype=torch.float32, device=device)
        offsets = layout.shard_offsets()
        self.shard_views = [self.shard[o:o + b.shard_numel] for o, b in zip(offsets, layout.buckets)]
        self._use_main_grad()
        self._expected: int | None = None  # backward passes this step (None: not told)
        self._inflight: list[tuple[int, _Reduction]] = []
        self._callback_queued = False
        self._per_pass = [int(getattr(p, "p3d_grads_per_micro_batch", 1)) for p in params]
        # Autograd runs a parameter's hooks even when a node gave it no gradient (a B that
        # deferred it to the W, a GEMM that added into main_grad); the tensor pre-hook sees
        # whether one arrives, which an fp32 .grad (our buffer's view) cannot tell after.
        self._arriving = [False] * len(params)
        self._hooks = [p.register_hook(self._make_pre_hook(i)) for i, p in enumerate(params)]
        self._hooks += [p.register_post_accumulate_grad_hook(self._make_hook(i))
                        for i, p in enumerate(params)]
        self.begin_step(None)

    def release(self) -> None:
        """Remove the hooks from the parameters and drop the gradient views they carry: a
        tensor hook lives in the tensor's C++ autograd state, where Python's cycle
        collector cannot see it, so hooks -> reducer -> parameters would keep every buffer
        alive after the trainer let go of it (the autopilot's move)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        for p in self.params:
            p.grad = None
            p.__dict__.pop("main_grad", None)

    def _use_main_grad(self) -> None:
        """Stages 0/1: a low-precision weight of a tensor-parallel GEMM gets its fp32 view of
        the gradient buffer as ``main_grad``: the weight-gradient GEMM adds into it in fp32
        (Megatron's gradient-accumulation fusion) instead of producing a bf16 ``.grad`` that
        a hook adds, and calls back so the bucket counting sees the contribution. A tied
        embedding (whose lookup writes ``.grad``) never takes it: the layers mark only the
        weights their own GEMMs own (``p3d_takes_main_grad``)."""
        self.main_grads = []
        if self.full is None:
            return
        for i, p in enumerate(self.params):
            if p.dtype != torch.float32 and getattr(p, "p3d_takes_main_grad", False):
                view = self._full_views[i]
                view.on_accumulated = partial(self._on_contribution, i)
                p.main_grad = view
                self.main_grads.append(i)

    def _param_view(self, flat: torch.Tensor, i: int) -> torch.Tensor:
        b, seg = self.layout.location[i]
        start = self.layout.buckets[b].offset + seg.start
        return flat[start:start + seg.numel].view(self.params[i].shape)

    # -- the step's life cycle -----------------------------------------------------------
    @torch.no_grad()
    def begin_step(self, backward_passes: int | None) -> None:
        """Zero the gradients for a new step of ``backward_passes`` backward passes over
        every parameter (one per micro-batch). None, at stages 0 and 1: nothing is issued
        during the backward, every bucket is reduced in :meth:`reduced`. Stages 2 and 3
        ignore it: their gradients live in the shard only, so each backward's buckets are
        reduce-scattered as they fill, whatever the count."""
        n = len(self.layout.buckets)
        self._expected = backward_passes
        self._accumulated = [False] * n
        self._issued = [False] * n
        self._counts = [0] * len(self.params)
        self._final = [0] * n  # parameters of each bucket that got their last gradient
        self._next_final = 0  # next bucket to issue once final (stages 0 and 1)
        self._ready = [0] * n  # parameters of each bucket done in this backward (stage 2)
        self._next = 0  # next bucket to issue in this backward (stage 2)
        if self.full is not None:
            self.full.zero_()
            for p, view in zip(self.params, self._full_views):
                # fp32 params accumulate straight into the buffer; others via the hook
                p.grad = view if p.dtype == torch.float32 else None
        else:
            for p in self.params:
                p.grad = None

    @torch.no_grad()
    def reduced(self) -> torch.Tensor:
        """The fp32 gradient (shard), summed over micro-batches and over the replicas,
        divided by ``divisor`` (the replicas' number, dp x cp: their average)."""
        if self.full is not None:
            self._adopt_foreign_grads()
            for b, bucket in enumerate(self.layout.buckets):
                if not self._issued[b]:
                    self._issue(b, self._bucket_of_full(b))
        self._finish_inflight()
        for b, done in enumerate(self._accumulated):
            if not done:  # no backward pass reached this bucket in this step
                self.shard_views[b].zero_()
        if self.divisor > 1:
            self.shard.div_(self.divisor)
        return self.shard

    def _bucket_of_full(self, b: int) -> torch.Tensor:
        bucket = self.layout.buckets[b]
        return self.full[bucket.offset:bucket.offset + bucket.numel]

    def _adopt_foreign_grads(self) -> None:
        """Stages 0/1: a ``.grad`` that is not our view (someone replaced it) is added in."""
        for i, (p, view) in enumerate(zip(self.params, self._full_views)):
            if p.grad is not None and p.grad.data_ptr() != view.data_ptr():
                if self._issued[self.layout.location[i][0]]:
                    raise RuntimeError(f"parameter {i} got a gradient after its bucket was reduced")
                view.add_(p.grad)
                p.grad = view if p.dtype == torch.float32 else None

    # -- collectives ---------------------------------------------------------------------
    def _issue(self, b: int, bucket_flat: torch.Tensor) -> None:
        while len(self._inflight) >= MAX_INFLIGHT:
            self._finish_oldest()
        if self.trace is not None:
            self.trace.append(("issue", b))
        if self.on_issue is not None:
            self.on_issue(b)
        red = _Reduction(bucket_flat, self.shard_views[b], self._accumulated[b], self.group,
                         all_reduce=self.stage == 0, wire_dtype=self.wire_dtype)
        self._accumulated[b] = True
        self._issued[b] = True
        self._inflight.append((b, red))

    def _finish_oldest(self) -> None:
        b, red = self._inflight.pop(0)
        red.finish()
        if self.trace is not None:
            self.trace.append(("done", b))
        if self.on_done is not None:
            self.on_done(b)

    def _finish_inflight(self) -> None:
        while self._inflight:
            self._finish_oldest()

    # -- hooks ---------------------------------------------------------------------------
    def _make_pre_hook(self, i: int):
        def pre_hook(grad: torch.Tensor | None) -> None:
            self._arriving[i] = grad is not None
        return pre_hook

    def _make_hook(self, i: int):
        def hook(p: torch.Tensor) -> None:
            self._on_grad(i, p)
        return hook

    @torch.no_grad()
    def _on_grad(self, i: int, p: torch.Tensor) -> None:
        if not self._arriving[i]:
            # no gradient came (a deferred weight gradient, or one a GEMM added into
            # main_grad and counted through its on_accumulated)
            return
        self._arriving[i] = False
        if self.trace is not None:
            self.trace.append(("grad", i))
        if self.stage >= 2:  # stage 3 reduces its gradients as stage 2 does
            self._on_grad_stage2(i)
            return
        if p.dtype != torch.float32:  # a low-precision param: accumulate into the fp32 buffer
            self._full_views[i].add_(p.grad)
            p.grad = None
        self._on_contribution(i)

    def _on_contribution(self, i: int) -> None:
        """Parameter ``i`` received one backward pass's gradient (stages 0/1): once it has
        the step's last, its bucket may be complete; complete buckets are issued in order."""
        self._counts[i] += 1
        if self._expected is None or self._counts[i] != self._expected * self._per_pass[i]:
            return
        b, _ = self.layout.location[i]
        self._final[b] += 1
        while self._next_final < len(self._final) and \
                self._final[self._next_final] == len(self.layout.buckets[self._next_final].segments):
            self._issue(self._next_final, self._bucket_of_full(self._next_final))
            self._next_final += 1

    def _on_grad_stage2(self, i: int) -> None:
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
        b, _ = self.layout.location[i]
        self._ready[b] += 1
        if self.on_ready is not None and self._ready[b] == len(self.layout.buckets[b].segments):
            self.on_ready(b)  # (stage 3 frees the bucket's gathered parameters)
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
