"""ZeRO 3 for the weights that do not train: LoRA's frozen base, sharded over the replicas.

At ``parallel.zero = 3`` with ``[lora]`` the optimizer shards what trains (the adapters:
parameters, fp32 gradients, masters, moments; :mod:`.optimizer`), and this shards the
frozen weights the same way, with the same machinery (:class:`~.params.ShardedParams`):
each rank keeps ``1 / (dp x cp)`` of every bucket of frozen weights, in the storage
dtype; a module's buckets are all-gathered before its forward and again before its
backward (the input gradient reads the weight), the next prefetched, and freed after.
There is no gradient, so no reduction and no update: a bucket gathered for a backward is
freed when the backward reaches an earlier module (``ShardedParams._pre_backward``) or
at the pass's end. They are never gathered whole by the run (:meth:`FrozenShards.gather_all`
is for a reader outside it). Per rank::

    persistently         frozen / (dp x cp)           the shards
    while in use         + the gathered buckets       (a module's, and one prefetched)

A LoRA fine-tune of a 70B base at dp 8 then holds 17.5 GB of bf16 base per GPU, not
140 GB, as FSDP-LoRA does. Under expert parallelism the frozen experts shard over their
own replicas (edp x cp): one ``FrozenShards`` for them beside the expert optimizer, one
for the rest beside the dense one (``train/optim.build_optimizer``, ``select``); when no
expert weight trains (LoRA on the attention only), both sit beside the one optimizer, as a
:class:`FrozenGroups`.
"""

from __future__ import annotations

import torch

from parallel3d.tensor_parallel.init import materialize_

from .buckets import BucketLayout
from .params import ShardedParams


class FrozenShards:
    """The frozen parameters of ``model`` (meta, ``requires_grad=False``; those ``select``
    takes, when given) placed as views of sharded buckets over ``replicas`` (a
    :class:`~parallel3d.topology.Replicas`: group, size, rank), on ``device`` in ``dtype``,
    and hooked to be gathered around each use. Fill them with :meth:`fill_params` (the
    seeded init or a checkpoint's slices, one bucket at a time)."""

    def __init__(self, model: torch.nn.Module, replicas, device, dtype: torch.dtype, bucket_mb: float,
                 select=None):
        seen, params = set(), []
        for p in model.parameters():
            if not p.requires_grad and id(p) not in seen and (select is None or select(p)):
                seen.add(id(p))
                params.append(p)
        if not params or not all(p.is_meta for p in params):
            raise ValueError("FrozenShards takes a model built on meta with frozen parameters")
        bucket_numel = max(1, int(bucket_mb * 2**20) // torch.empty((), dtype=dtype).element_size())
        self.layout = BucketLayout([p.numel() for p in params], bucket_numel, replicas.size)
        self.sharded = ShardedParams(self.layout, len(params), replicas.rank, replicas.group, device, dtype)
        self.shard_rank, self.param_shards = replicas.rank, self.sharded.shards  # (what a checkpoint reads)
        views = self.sharded.views([p.shape for p in params])
        new = materialize_(model, device, dtype, storage={id(p): v for p, v in zip(params, views)},
                           only_storage=True)
        self.params = [new[id(p)] for p in params]
        self.sharded.hook(model, self.params)

    def fill_params(self, fill) -> None:
        """``fill(ps)`` writes the values of frozen parameters ``ps``, one bucket at a time."""
        self.sharded.fill_by_bucket(self.params, fill)

    def gather_all(self) -> None:
        """Every frozen weight whole until :meth:`free_all`. Nothing in a run needs it (the
        modules gather what they read, a checkpoint holds what trains, ``export_hf``
        converts the saved checkpoint): the optimizer's ``finish_param_gather`` leaves
        them sharded, so that the end of a 70B run does not gather the whole base on
        every GPU. Tests and interactive readers call it."""
        self.sharded.gather_all()

    def free_all(self) -> None:
        self.sharded.free_all()

    def release(self) -> None:
        self.sharded.free_all()
        self.sharded.release()

    def memory_tensors(self) -> list[torch.Tensor]:
        return [self.sharded.shard_flat]


class FrozenGroups:
    """Several :class:`FrozenShards` (each over its own replicas) as one: the frozen dense
    weights and the frozen routed experts of an optimizer that trains neither (LoRA on a
    Mixture-of-Experts model's attention only, at ep > 1)."""

    def __init__(self, members: list[FrozenShards]):
        self.members = members

    @staticmethod
    def of(holders):
        """The holders that exist (None where a part has no frozen weight) as one: None,
        the one holder, or a group."""
        members = [h for h in holders if h is not None]
        return FrozenGroups(members) if len(members) > 1 else (members[0] if members else None)

    def fill_params(self, fill) -> None:
        for m in self.members:
            m.fill_params(fill)

    def gather_all(self) -> None:
        for m in self.members:
            m.gather_all()

    def free_all(self) -> None:
        for m in self.members:
            m.free_all()

    def release(self) -> None:
        for m in self.members:
            m.release()

    def memory_tensors(self) -> list[torch.Tensor]:
        return [t for m in self.members for t in m.memory_tensors()]
