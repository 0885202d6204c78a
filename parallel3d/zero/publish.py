"""Values between a :class:`~parallel3d.zero.optimizer.ZeroOptimizer`'s fp32 master shards
and its parameters: :class:`ParamPublication`, the mixin that holds ``take_masters``
(parameters -> masters, after init or load) and the publication after each update
(masters -> parameter buffer -> all-gathered over dp, asynchronously: each module waits,
in a forward pre-hook, only for the buckets it reads; ``finish_param_gather`` for readers
outside a forward; stage 3 frees its stale full buckets instead). While a bucket's
all-gather is in flight its parameters are guarded (:mod:`.guard`): any other read of
them waits for that bucket first, so nothing outside a forward reads a torn mix of the
old and new weights."""

from __future__ import annotations

from functools import partial

import torch

from parallel3d.distributed import all_gather_flat

from .guard import guard, unguard
from .params import bucket_readers


class ParamPublication:
    """The master <-> parameter half of :class:`~parallel3d.zero.optimizer.ZeroOptimizer`.

    Reads the optimizer's ``params``, ``layout``, ``param_buffer`` / ``param_shards``,
    ``masters``, ``master_is_param``, ``sharded`` (stage 3's ``ShardedParams``) and
    ``frozen``, ``shards_over_dp``, ``dp_group`` and ``_overlap_gather``; the all-gathers
    in flight are in ``_gathers`` (bucket index -> work; the optimizer starts it empty).
    """

    _gathers: dict[int, object]
    _bucket_of: dict[int, int]  # id(parameter) -> its bucket
    read_waits: list | None  # (bucket, operation) of each read that waited, when a list (tests)

    @torch.no_grad()
    def take_masters(self) -> None:
        """fp32 master weights <- this rank's shard of the parameters' current values (at
        construction from real parameters; the trainer calls it once the parameters are
        initialised or loaded). Nothing to do when fp32 parameters are their own masters.
        Stage 3: the shards are taken from the full buckets first, which are then freed."""
        if self.sharded is not None:
            self.sharded.shard_from_full()
        if self.master_is_param:
            if self.sharded is not None:
                self.sharded.free_all()
            return
        for b, master in zip(self.layout.buckets, self.masters):
            master.copy_(self.param_shards[b.index])
        if self.sharded is not None:
            self.sharded.free_all()

    def _hook_forward(self, model: torch.nn.Module) -> None:
        """Before a module's forward, wait for the all-gathers of the buckets holding the
        parameters it reads (:func:`bucket_readers`)."""
        for module, buckets in bucket_readers(model, self.params, self.layout):
            module.register_forward_pre_hook(partial(self._wait_gathers, buckets))

    def _publish_params(self) -> None:
        """Updated master shards -> parameter buffer -> (stages 1, 2) all-gathered to every
        dp rank.

        Buckets are sent last-first: the last bucket holds the first layers, which the
        next forward pass needs first. Stage 3 gathers nothing: every full bucket, now
        stale, is freed, and the forward gathers what it reads."""
        if self.sharded is not None:
            if not self.master_is_param:
                torch._foreach_copy_(self.param_shards, self.masters)
            self.sharded.free_all()
            if self.frozen is not None:
                self.frozen.free_all()  # unchanged, but whatever read them whole is done
            return
        for b in reversed(range(len(self.layout.buckets))):
            if not self.master_is_param:
                self.param_shards[b].copy_(self.masters[b], non_blocking=True)
            if self.shards_over_dp and self.dp_group is not None:
                bucket = self.layout.buckets[b]
                out = self.param_buffer[bucket.offset:bucket.offset + bucket.numel]
                self._gathers[b] = all_gather_flat(out, self.param_shards[b], group=self.dp_group,
                                                   async_op=True)
                for seg in bucket.segments:
                    guard(self.params[seg.index], self._read_in_flight)
        if not self._overlap_gather:
            self.finish_param_gather()

    def _wait_gathers(self, buckets: list[int], module=None, args=None) -> None:
        if self._gathers:
            for b in buckets:
                work = self._gathers.pop(b, None)
                if work is not None:
                    work.wait()
                    for seg in self.layout.buckets[b].segments:
                        unguard(self.params[seg.index])

    def _read_in_flight(self, p: torch.Tensor, what: str) -> None:
        """A parameter read outside its module's forward while its bucket is being
        all-gathered: wait for that bucket (a trace records it, when the optimizer has one)."""
        b = self._bucket_of[id(p)]
        if self.read_waits is not None:
            self.read_waits.append((b, what))
        self._wait_gathers([b])

    def finish_param_gather(self) -> None:
        """Block until every parameter holds the values of the last step: whatever reads
        the parameters outside the next forward pass (a checkpoint, an evaluation, an
        export, the gradient norm, a caller after the last step) calls it first. Stage 3:
        every bucket gathered, and held until the next update frees them."""
        self._wait_gathers(list(self._gathers))
        if self.sharded is not None:
            self.sharded.gather_all()  # (not the frozen weights: nothing reads them but their modules)

    wait_for_params = finish_param_gather  # the name the checkpoints and older callers use
