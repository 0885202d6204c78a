"""Tensor-parallel communication as autograd functions that undo each other.

Each function takes its process group explicitly (``topo.tp_group``); a ``None`` group, or
a group of one, makes every function the identity, so the same code runs at tp=1.

Pairs, forward <-> backward (``p`` = ranks in the group)::

    copy_to_tp_region          identity                  <-> all-reduce (sum)
    reduce_from_tp_region      all-reduce (sum)          <-> identity
    scatter_to_tp_region       keep my 1/p of dim -1     <-> all-gather dim -1
    gather_from_tp_region      all-gather dim -1         <-> keep my 1/p of dim -1
    scatter_to_sequence        keep my 1/p of the tokens <-> all-gather the tokens
    gather_from_sequence       all-gather the tokens     <-> reduce-scatter the tokens
    reduce_scatter_to_sequence reduce-scatter the tokens <-> all-gather the tokens

``gather_from_sequence`` feeds a column-parallel layer, whose input gradient is a partial
sum on each rank (each rank holds some output features): its backward therefore sums and
scatters in one reduce-scatter. With ``grad_is_partial=False`` it splits instead. (The
column-parallel layers themselves gather inside their own autograd node, ``column.py``.)

Sequence parallelism shards the tokens: activations are (B, S, H) as in
``models/llama``, and rank r holds the r-th of p equal runs of the B*S tokens in memory
order (b, s), viewed as (B, S/p, H). At micro_batch B = 1 that is positions
[r S/p, (r+1) S/p); at B > 1 a rank may hold whole sequences, which every per-token
operation outside the tensor-parallel region (norms, residual adds) does not mind. It is
the layout the collectives produce and consume (they concatenate and split flat buffers),
so sequence gathers and reduce-scatters never copy, at any B. Sharding S within each
sequence would need a (B, S, H) <-> (p, B, S/p, H) permuting copy per collective at
B > 1 (Megatron avoids it with sequence-first activations); see ``column.py`` for what
that would cost.

``reduce_from_tp_region(x, group, inplace=True)`` reduces into ``x`` itself: for a caller
that hands over a temporary nobody else holds (the row-parallel GEMM output, the
embedding's masked lookup), which saves a full copy. By default it reduces a copy.

For overlap, :func:`start_all_reduce` and :func:`start_reduce_scatter_tokens` return a
handle at once; ``handle.wait()`` finishes the collective and returns its result.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from parallel3d.distributed import GLOO_SMALL_BYTES, all_gather_flat, all_reduce, reduce_scatter_flat

SEQ_DIM = 1  # activations are (B, S, H)


def group_size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group) -> int:
    return 0 if group is None else dist.get_rank(group)


# -- the collectives themselves (no autograd) -----------------------------------------------

def _all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    if group_size(group) == 1:
        return x
    return all_reduce(x.contiguous(), group)


def _tokens(x: torch.Tensor, p: int) -> int:
    """Elements per rank when the tokens of ``x`` (B, S, ...) are split over ``p`` ranks."""
    if x.dim() < 2 or x.shape[SEQ_DIM] % p:
        raise ValueError(f"sequence of {tuple(x.shape)} (dim {SEQ_DIM}) does not split over {p} ranks")
    return x.numel() // p


def _split_tokens(x: torch.Tensor, group) -> torch.Tensor:
    """This rank's run of the B*S tokens, viewed (B, S/p, ...) (a view of ``x``)."""
    p = group_size(group)
    if p == 1:
        return x
    n = _tokens(x, p)
    x = x.contiguous()
    return x.view(-1)[group_rank(group) * n:(group_rank(group) + 1) * n].view(
        x.shape[0], x.shape[SEQ_DIM] // p, *x.shape[2:])


def _gather_tokens(x: torch.Tensor, group) -> torch.Tensor:
    """Every rank's run of tokens in rank order: (B, S/p, ...) -> (B, S, ...); no copy."""
    p = group_size(group)
    if p == 1:
        return x
    x = x.contiguous()
    out = x.new_empty((x.shape[0], p * x.shape[SEQ_DIM], *x.shape[2:]))
    all_gather_flat(out.view(-1), x.view(-1), group=group)
    return out


def _reduce_scatter_tokens(x: torch.Tensor, group) -> torch.Tensor:
    """Sum (B, S, ...) over the ranks, keep this rank's run of tokens (B, S/p, ...); no copy."""
    p = group_size(group)
    if p == 1:
        return x
    _tokens(x, p)
    x = x.contiguous()
    out = x.new_empty((x.shape[0], x.shape[SEQ_DIM] // p, *x.shape[2:]))
    reduce_scatter_flat(out.view(-1), x.view(-1), group)
    return out


def _split(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """This rank's 1/p of ``x`` along ``dim`` (a copy, so the full tensor can be freed)."""
    p = group_size(group)
    if p == 1:
        return x
    if x.shape[dim] % p:
        raise ValueError(f"dim {dim} of size {x.shape[dim]} does not split over {p} ranks")
    return x.chunk(p, dim=dim)[group_rank(group)].contiguous()


def _all_gather(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim``, in rank order.

    The collective stacks the ranks' buffers: (p, *x.shape). Moving that p next to
    ``dim`` and merging is a view when every dim before ``dim`` has size 1 (the sequence
    at micro_batch 1), else the one copy a concatenation along ``dim`` costs."""
    p = group_size(group)
    if p == 1:
        return x
    dim = dim % x.dim()
    stacked = x.new_empty((p, *x.shape))
    all_gather_flat(stacked.view(-1), x.contiguous().view(-1), group=group)
    merged = (*x.shape[:dim], p * x.shape[dim], *x.shape[dim + 1:])
    return stacked.movedim(0, dim).reshape(merged)


class _Pending:
    """A collective in flight: ``wait()`` finishes it (once) and returns its result."""

    def __init__(self, work, finish):
        self.work, self.finish, self.result = work, finish, None

    def wait(self) -> torch.Tensor:
        if self.finish is not None:
            if self.work is not None:
                self.work.wait()
            self.result, self.finish, self.work = self.finish(), None, None
        return self.result


def start_all_reduce(t: torch.Tensor, group) -> _Pending:
    """Start summing ``t`` (contiguous, owned by the caller) over ``group`` in place.

    NCCL: the all-reduce runs on NCCL's stream, ``wait()`` makes the current stream wait
    for it (the host does not block). gloo: the collective runs on gloo's worker thread
    while this one goes on; ``wait()`` blocks until it is done. A small tensor on gloo
    (bytes x ranks <= 4 MiB) goes by one all-to-all and a rank-order fold at ``wait()``,
    as :func:`parallel3d.distributed.all_reduce` does."""
    p = group_size(group)
    if p == 1:
        return _Pending(None, lambda: t)
    if dist.get_backend(group) == "gloo" and t.numel() * t.element_size() * p <= GLOO_SMALL_BYTES:
        received = t.new_empty((p, t.numel()))
        work = dist.all_to_all_single(received, t.reshape(1, -1).expand(p, -1).contiguous(),
                                      group=group, async_op=True)

        def fold():
            acc = received[0]
            for r in range(1, p):
                acc.add_(received[r])
            return t.copy_(acc.view(t.shape))
        return _Pending(work, fold)
    return _Pending(dist.all_reduce(t, group=group, async_op=True), lambda: t)


def start_gather_tokens(x: torch.Tensor, group) -> _Pending:
    """Start ``_gather_tokens(x, group)``; ``wait()`` returns (B, S, ...)."""
    p = group_size(group)
    if p == 1:
        return _Pending(None, lambda: x)
    x = x.contiguous()
    out = x.new_empty((x.shape[0], p * x.shape[SEQ_DIM], *x.shape[2:]))
    work = all_gather_flat(out.view(-1), x.view(-1), group=group, async_op=True)
    return _Pending(work, lambda: out)


def start_reduce_scatter_tokens(x: torch.Tensor, group) -> _Pending:
    """Start ``_reduce_scatter_tokens(x, group)`` ((B, S, ...) contiguous); ``wait()``
    returns this rank's (B, S/p, ...)."""
    p = group_size(group)
    if p == 1:
        return _Pending(None, lambda: x)
    _tokens(x, p)
    out = x.new_empty((x.shape[0], x.shape[SEQ_DIM] // p, *x.shape[2:]))
    work = reduce_scatter_flat(out.view(-1), x.contiguous().view(-1), group, async_op=True)
    return _Pending(work, lambda: out)


# -- autograd pairs ------------------------------------------------------------------------

class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, inplace):
        if not inplace:
            return _all_reduce(x.clone(), group)  # never reduce into the caller's tensor
        ctx.mark_dirty(x)
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


class _ScatterToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _split(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, ctx.dim, ctx.group), None, None


class _ScatterTokens(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split_tokens(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_tokens(grad, ctx.group), None


class _GatherTokens(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, grad_is_partial):
        ctx.group, ctx.grad_is_partial = group, grad_is_partial
        return _gather_tokens(x, group)

    @staticmethod
    def backward(ctx, grad):
        if ctx.grad_is_partial:
            return _reduce_scatter_tokens(grad, ctx.group), None, None
        return _split_tokens(grad, ctx.group), None, None


class _ReduceScatterTokens(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter_tokens(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_tokens(grad, ctx.group), None


class _GatherFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _all_gather(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _split(grad, ctx.dim, ctx.group), None, None


def _identity(group) -> bool:
    return group_size(group) == 1


def copy_to_tp_region(x: torch.Tensor, group) -> torch.Tensor:
    """Forward: identity. Backward: all-reduce the gradient (each rank used ``x`` for a
    different part of the output, so the gradient of ``x`` is the sum of theirs)."""
    return x if _identity(group) else _CopyToRegion.apply(x, group)


def reduce_from_tp_region(x: torch.Tensor, group, inplace: bool = False) -> torch.Tensor:
    """Forward: all-reduce partial sums into the full value. Backward: identity.

    ``inplace=True``: ``x`` is a temporary the caller hands over and never reads again
    (contiguous, not saved by anyone for backward): it is reduced where it lies, saving
    a full copy. Under selective recomputation the GEMM output is kept by the
    checkpoint, so the row-parallel layer must not hand it over then."""
    if _identity(group):
        return x
    if inplace and not x.is_contiguous():
        raise ValueError("reduce_from_tp_region(inplace=True) needs a contiguous tensor")
    return _ReduceFromRegion.apply(x, group, inplace)


def scatter_to_tp_region(x: torch.Tensor, group) -> torch.Tensor:
    """Forward: keep this rank's 1/p of the last dim. Backward: all-gather it."""
    return x if _identity(group) else _ScatterToRegion.apply(x, -1, group)


def gather_from_tp_region(x: torch.Tensor, group) -> torch.Tensor:
    """Forward: all-gather the last dim. Backward: keep this rank's 1/p of it."""
    return x if _identity(group) else _GatherFromRegion.apply(x, -1, group)


def scatter_to_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """Forward: keep this rank's 1/p of the tokens, (B, S, H) -> (B, S/p, H) (module
    docstring). Backward: all-gather them."""
    return x if _identity(group) else _ScatterTokens.apply(x, group)


def gather_from_sequence(x: torch.Tensor, group, grad_is_partial: bool = True) -> torch.Tensor:
    """Forward: all-gather the token shards, (B, S/p, H) -> (B, S, H). Backward:
    reduce-scatter (``grad_is_partial``, the input of a column-parallel layer) or split."""
    return x if _identity(group) else _GatherTokens.apply(x, group, grad_is_partial)


def reduce_scatter_to_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """Forward: sum partial (B, S, H) over ranks, keep this rank's tokens (B, S/p, H).
    Backward: all-gather."""
    return x if _identity(group) else _ReduceScatterTokens.apply(x, group)
