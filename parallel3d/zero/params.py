"""ZeRO stage 3: the parameters sharded over the data-parallel replicas too.

Each rank keeps, persistently, only its shard of every bucket's flat parameters (the same
``[r * N_b/dp, (r+1) * N_b/dp)`` ranges as the optimizer state, :mod:`.buckets`). Every
bucket also has a full flat tensor of its own whose storage exists only while the bucket
is gathered: the parameters are views of it, so autograd's saved tensors (a weight a GEMM
keeps for its input gradient) point into it, and freeing is resizing its storage to 0
bytes (the tensors stay valid; a later gather re-allocates and refills the same storage,
its version counter kept as it was, so autograd sees the weight it saved)::

    per rank, persistently      sum_b N_b / dp         (the shards, in the storage dtype)
    while a bucket is gathered  + N_b                  (its full storage)

When (hooks on every module holding parameters, through :meth:`ShardedParams.hook`):

- forward pre-hook: the module's buckets (those of the layers it computes together with,
  ``shared_input``) are all-gathered over the replicas and waited for; the next bucket in
  forward order (the next lower index: buckets hold parameters in reverse order) is
  prefetched (its all-gather issued, not waited for), except in a forward re-run inside
  a backward (recomputation), whose next module is already done;
- forward post-hook: a bucket whose last user (registration order) this module is, is
  freed; a hook goes on the module's outputs for its backward;
- the output's gradient hook (before the module's backward nodes run): the buckets are
  gathered again and held for this backward pass, the next bucket of the backward order
  prefetched;
- a bucket's gradients all in for this backward pass (:class:`~.grads.GradReducer` calls
  :meth:`ShardedParams.bucket_done`): freed; at the end of every backward pass (an autograd
  callback) everything not held by a forward is freed (a zero-bubble B, whose weight
  gradients wait for the W, frees there: a W reads the layer's input and output gradient,
  never its weights).

Each use gathers what it reads, so a bucket a forward freed early is only gathered again
(more traffic); one freed while a backward node still reads it fails loudly (its storage
has 0 bytes: autograd raises), it is never read stale. :meth:`gather_all` holds every bucket gathered until
:meth:`free_all` (whatever reads the parameters outside a forward: a checkpoint, an
export; the optimizer frees them when the update changes the shards).

A parameter whose bucket is freed is a tensor over 0 bytes of storage: any kernel that read
it would read freed memory and crash the process (a segfault, no traceback). So while
freed it is guarded (:mod:`.guard`): its metadata reads, and anything else is refused in
one line naming the way to gather. While its bucket's all-gather is in flight (issued, a
prefetch, not yet waited for), a read waits for that bucket first; once waited for, it is
a plain parameter again.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import torch
from torch.utils._pytree import tree_leaves

from parallel3d.distributed import all_gather_flat
from parallel3d.errors import UserError

from .buckets import BucketLayout
from .guard import guard, unguard


def _refuse_read(p: torch.Tensor, what: str) -> None:
    """A freed bucket's parameter read outside its module's forward (:mod:`.guard`)."""
    raise UserError(f"a parameter of shape {tuple(p.shape)} was read ({what}) while parallel.zero=3 holds it "
                    "sharded (this rank keeps 1/dp of it between uses): gather the weights first with "
                    "trainer.finish_param_gather() (LoRA's frozen base: optimizer.frozen.gather_all())")


def _output_tensors(output) -> list[torch.Tensor]:
    """The tensors of a module's output: pytree leaves, and the tensor fields of a
    dataclass among them (the MoE router returns its weights and probabilities in one,
    ``Routing``: without its fields, the router's backward would find its weight freed)."""
    out = []
    for leaf in tree_leaves(output):
        if isinstance(leaf, torch.Tensor):
            out.append(leaf)
        elif dataclasses.is_dataclass(leaf) and not isinstance(leaf, type):
            out += [t for f in dataclasses.fields(leaf) for t in tree_leaves(getattr(leaf, f.name))
                    if isinstance(t, torch.Tensor)]
    return out


def bucket_readers(model: torch.nn.Module, params: list, layout: BucketLayout) -> list[tuple]:
    """``(module, sorted bucket indices)`` for every module of ``model`` (in ``modules()``
    order) that reads parameters of ``params``: its own; for a layer computed together
    with others (column-parallel layers tied by ``share_input``: the first one called
    computes all of their outputs) those of every member of its group; for a module that
    computes its children with their weights (``computes_children = True``: the MoE
    experts' grouped GEMM, whose children's forwards never run) all of theirs, and its
    descendants are no readers (a hook on them would never fire)."""
    index = {id(p): i for i, p in enumerate(params)}
    users, computed = [], set()
    for module in model.modules():
        if id(module) in computed:
            continue
        computes = bool(getattr(module, "computes_children", False))
        if computes:
            computed.update(id(m) for m in module.modules() if m is not module)
        shared = getattr(module, "shared_input", None)
        readers = shared.layers if shared is not None else [module]
        buckets = sorted({layout.location[index[id(p)]][0]
                          for m in readers for p in m.parameters(recurse=computes) if id(p) in index})
        if buckets:
            users.append((module, buckets))
    return users


class ShardedParams:
    """The gathered / freed state of every bucket's full parameters (see the module doc).

    ``trace``, when a list, records ``("gather", b)``, ``("wait", b)`` and ``("free", b)``;
    ``on_change()``, when set, is called after every gather and free (the memory test
    samples the live parameter bytes there)."""

    def __init__(self, layout: BucketLayout, n_params: int, shard_rank: int, group, device, dtype):
        self.layout, self.group, self.shard_rank = layout, group, shard_rank
        # Each bucket's full storage is created and dropped at once (never the whole model):
        # :meth:`fill_by_bucket` fills the shards one bucket at a time.
        self.full, self._nbytes = [], []
        for b in layout.buckets:
            t = torch.empty(b.numel, dtype=dtype, device=device)
            self._nbytes.append(t.untyped_storage().nbytes())
            t.untyped_storage().resize_(0)
            self.full.append(t)
        self.shard_flat = torch.zeros(layout.shard_numel, dtype=dtype, device=device)
        self.shards = [self.shard_flat[o:o + b.shard_numel]
                       for o, b in zip(layout.shard_offsets(), layout.buckets)]
        n = len(layout.buckets)
        self.gathered = [False] * n
        self._work: dict[int, object] = {}
        self._forward_refs = [0] * n
        self._backward_held: set[int] = set()
        self.read_held = False
        self._callback_queued = False
        self._handles: list = []
        self._first_user: dict[int, int] = {}  # bucket -> its first module (registration order)
        self.trace: list | None = None
        self.on_change = None
        self.filled = False  # the shards hold the start values (fill_by_bucket)
        self._params: list | None = None  # the parameters (hook): their class follows the storage
        self._bucket_of: dict[int, int] = {}  # id(parameter) -> its bucket

    def views(self, shapes: list[torch.Size]) -> list[torch.Tensor]:
        """Parameter i's view of its bucket's full storage (made while that storage is
        allocated, one bucket at a time; a view outlives the storage's resizing)."""
        out: list = [None] * len(shapes)
        for b, members in enumerate(self._members(len(shapes))):
            self._allocate(b)
            for i in members:
                seg = self.layout.location[i][1]
                out[i] = self.full[b][seg.start:seg.end].view(shapes[i])
            self.full[b].untyped_storage().resize_(0)
        return out

    def _members(self, n_params: int) -> list[list[int]]:
        """The parameter indices of each bucket."""
        members: list[list[int]] = [[] for _ in self.full]
        for i in range(n_params):
            members[self.layout.location[i][0]].append(i)
        return members

    def _allocate(self, b: int) -> None:
        self.full[b].untyped_storage().resize_(self._nbytes[b])
        self._mark(b, "gathered")
        if self.on_change is not None:
            self.on_change()

    @torch.no_grad()
    def fill_by_bucket(self, params: list, fill) -> None:
        """The shards from ``fill(ps)``, which writes the values of parameters ``ps`` (the
        seeded init, or a checkpoint's slices) into their views: one bucket's full storage
        at a time, its shard copied out and the storage dropped (start-up holds the shards
        and one bucket, never the whole model)."""
        for b, members in enumerate(self._members(len(params))):
            self._allocate(b)
            self.gathered[b] = True
            fill([params[i] for i in members])
            lo, hi = self.layout.buckets[b].shard_range(self.shard_rank)
            self.shards[b].copy_(self.full[b][lo:hi])
            self._free(b)
        self.filled = True

    def _mark(self, b: int, state: str) -> None:
        """Bucket ``b``'s parameters refuse reads ("freed"), wait for the bucket when read
        ("in flight") or are plain parameters ("gathered")."""
        if self._params is None:
            return
        on_read = {"freed": _refuse_read, "in flight": self._read_in_flight}.get(state)
        for seg in self.layout.buckets[b].segments:
            if on_read is None:
                unguard(self._params[seg.index])
            else:
                guard(self._params[seg.index], on_read)

    def _read_in_flight(self, p: torch.Tensor, what: str) -> None:
        self._wait(self._bucket_of[id(p)])

    # -- gather and free ------------------------------------------------------------------
    def _note(self, kind: str, b: int) -> None:
        if self.trace is not None:
            self.trace.append((kind, b))

    @torch.no_grad()
    def _issue(self, b: int) -> None:
        if self.gathered[b] or b in self._work:
            return
        full = self.full[b]
        full.untyped_storage().resize_(self._nbytes[b])
        self._mark(b, "in flight")
        self._note("gather", b)
        with torch.autograd._unsafe_preserve_version_counter(full):
            if self.group is None:
                full.copy_(self.shards[b])
                self._work[b] = None
            else:
                self._work[b] = all_gather_flat(full, self.shards[b], group=self.group, async_op=True)
        if self.on_change is not None:
            self.on_change()

    @torch.no_grad()
    def _wait(self, b: int) -> None:
        if self.gathered[b]:
            return
        self._issue(b)
        work = self._work.pop(b)
        if work is not None:
            with torch.autograd._unsafe_preserve_version_counter(self.full[b]):
                work.wait()
        self._note("wait", b)
        self.gathered[b] = True
        self._mark(b, "gathered")

    def gather(self, buckets, prefetch: int | None = None) -> None:
        """Issue every bucket's all-gather (and the prefetched one's), then wait for them."""
        for b in buckets:
            self._issue(b)
        if prefetch is not None and 0 <= prefetch < len(self.full):
            self._issue(prefetch)
        for b in buckets:
            self._wait(b)

    def _free(self, b: int) -> None:
        if b in self._work:  # a prefetch nobody used: finish it before dropping the storage
            self._wait(b)
        if not self.gathered[b]:
            return
        self.full[b].untyped_storage().resize_(0)
        self._mark(b, "freed")
        self.gathered[b] = False
        self._note("free", b)
        if self.on_change is not None:
            self.on_change()

    def _maybe_free(self, b: int) -> None:
        if not self.read_held and self._forward_refs[b] == 0 and b not in self._backward_held:
            self._free(b)

    def free_all(self) -> None:
        """Drop every full bucket (the shards changed, or the parameters were read)."""
        self.read_held = False
        self._backward_held.clear()
        self._forward_refs = [0] * len(self.full)
        for b in range(len(self.full)):
            self._free(b)

    def gather_all(self) -> None:
        """Every bucket gathered and held until :meth:`free_all`."""
        self.gather(range(len(self.full)))
        self.read_held = True

    @torch.no_grad()
    def shard_from_full(self) -> None:
        """Shards <- this rank's ranges of the full buckets (after the init or a load);
        nothing once :meth:`fill_by_bucket` filled them."""
        if self.filled:
            return
        for b, bucket in enumerate(self.layout.buckets):
            lo, hi = bucket.shard_range(self.shard_rank)
            self.shards[b].copy_(self.full[b][lo:hi])

    def bucket_done(self, b: int) -> None:
        """Bucket ``b``'s gradients of this backward pass are all in: its parameters are
        not read again by this pass."""
        self._backward_held.discard(b)
        self._maybe_free(b)

    # -- hooks ----------------------------------------------------------------------------
    def hook(self, model: torch.nn.Module, params: list[torch.nn.Parameter]) -> None:
        """Forward pre/post hooks on every module reading parameters of ``params``."""
        users = bucket_readers(model, params, self.layout)
        self._params = list(params)
        self._bucket_of = {id(p): self.layout.location[i][0] for i, p in enumerate(params)}
        for b, gathered in enumerate(self.gathered):
            self._mark(b, "gathered" if gathered else "in flight" if b in self._work else "freed")
        last_user = {b: k for k, (_, buckets) in enumerate(users) for b in buckets}
        self._first_user = {b: k for k, (_, buckets) in reversed(list(enumerate(users))) for b in buckets}
        for k, (module, buckets) in enumerate(users):
            frees = [b for b in buckets if last_user[b] == k]
            self._handles.append(module.register_forward_pre_hook(partial(self._pre_forward, buckets)))
            self._handles.append(module.register_forward_hook(partial(self._post_forward, (k, buckets), frees)))
        self._handles.append(model.register_state_dict_pre_hook(self._refuse_a_sharded_read))

    def _refuse_a_sharded_read(self, module, prefix, keep_vars) -> None:
        """``model.state_dict()`` with a bucket freed would hand out tensors over 0 bytes of
        storage: refused, saying how many buckets are sharded (each parameter's own guard,
        :mod:`.guard`, would name only the first one read)."""
        freed = self.gathered.count(False)
        if freed:
            raise UserError(f"state_dict() at parallel.zero=3 with {freed} of {len(self.gathered)} parameter buckets "
                            "sharded (this rank holds 1/dp of them): gather them first with "
                            "trainer.finish_param_gather() (LoRA's frozen base: optimizer.frozen.gather_all())")

    def release(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _pre_forward(self, buckets, module, args) -> None:
        # A recomputation inside a backward prefetches nothing: the next module in forward
        # order has had its backward already, and a gather nobody waits for would hold its
        # storage to the end of the pass (one bucket per recomputed layer: the whole model
        # by then). The backward's own prefetch (_pre_backward) looks the other way.
        recomputing = torch._C._current_graph_task_id() != -1
        self.gather(buckets, prefetch=None if recomputing else buckets[0] - 1)
        for b in buckets:
            self._forward_refs[b] += 1

    def _post_forward(self, user, frees, module, args, output) -> None:
        buckets = user[1]
        for b in buckets:
            self._forward_refs[b] -= 1
        if torch.is_grad_enabled():
            for t in _output_tensors(output):
                if t.requires_grad:
                    t.register_hook(partial(self._pre_backward, user))
        for b in frees:
            self._maybe_free(b)

    def _pre_backward(self, user, grad) -> None:
        """Before the backward of module ``k`` (registration order), which reads
        ``buckets``. Autograd runs a pass's nodes in reverse order of creation, so the
        modules after ``k`` in forward order are done with this pass: a bucket held for
        them alone is freed (a zero-bubble B gets no gradients to say so; its W reads no
        weight)."""
        k, buckets = user
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
        for b, first in self._first_user.items():
            if first > k and (b in self._backward_held or self._forward_refs[b]):
                # (a forward reference here is a recomputation's: torch's checkpoint stops
                # re-running a layer once it has what the backward needs, so some modules
                # see their pre-hook and never their post-hook)
                self._forward_refs[b] = 0
                self.bucket_done(b)
        self.gather(buckets, prefetch=buckets[-1] + 1)
        self._backward_held.update(buckets)

    def _end_of_backward(self) -> None:
        self._callback_queued = False
        self._backward_held.clear()
        self._forward_refs = [0] * len(self.full)  # no forward runs across a backward's end
        for b in range(len(self.full)):
            self._maybe_free(b)

    # -- inspection -----------------------------------------------------------------------
    def live_bytes(self) -> int:
        """Bytes of parameter storage this rank holds now: the shards and every full
        bucket with storage (gathered or being gathered)."""
        return self.shard_flat.untyped_storage().nbytes() + sum(t.untyped_storage().nbytes() for t in self.full)
