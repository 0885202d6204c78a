"""The global gradient norm, clipping, and the optimizer step in two halves.

Shared by every optimizer the trainer can build (``parallel3d.zero``) and by the code that
measures gradients (tests, benchmarks); it sits below both, so neither imports the other.

The interface the trainer sees (:class:`GlobalNormOptimizer`)::

    opt.begin_step(n)                # before the step's backward passes (n micro-batches)
    ... forward / backward over the micro-batches ...
    share = opt.reduce_gradients()   # gradient sync; this rank's share of |g|^2
    ... sum share over every rank of the world (the trainer's one collective) ...
    opt.apply(lr, norm, skip)        # clip by the global norm, update

A step whose global norm is not finite (or called with ``skip=True``) still does every
collective, so the ranks stay in step, but changes no weight and no optimizer state.
"""

from __future__ import annotations

import torch

from parallel3d.distributed import all_reduce
from parallel3d.pipeline.timeline import comm_span


def applies_weight_decay(p: torch.nn.Parameter) -> bool:
    """Weight decay on matrices and embeddings, none on vectors (norm weights, biases)."""
    return p.ndim >= 2


def counts_in_norm(p: torch.nn.Parameter) -> bool:
    """A parameter replicated over a model-parallel group (a norm weight under tensor
    parallelism, a tied embedding held by two pipeline stages) is marked by
    ``parallelize`` with ``p.p3d_norm_owner = False`` on all but one holder, so the
    global norm counts it once."""
    return getattr(p, "p3d_norm_owner", True)


# Each gradient is read as rows of this many elements (and a shorter tail row): one norm
# kernel per tensor gives every row's fp32 norm, and the squares of those are summed in
# fp64. Not torch's norm of the whole tensor: on CPU it accumulates fp32 sequentially, its
# relative error growing with the length (measured: 4e-8 at 64k elements, 2e-6 at 256k,
# 9e-5 at 4M), enough to change the clipping coefficient, hence every update, between
# layouts that hold the same gradients in differently sized buffers; over rows of 1024
# the error is 1e-9 at 100M elements (benchmarks/bench_grad_norm.py). One call per tensor
# (a flat bucket: a few per step), where the former 16k-element pieces made 61k views
# and a stack of as many scalars per step at 1B elements (benchmarks/README.md).
NORM_ROW = 1 << 10


def norm_pieces(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each of ``tensors`` (contiguous), flat, as a ``(numel // NORM_ROW, NORM_ROW)`` view
    and a ``(1, numel % NORM_ROW)`` view of its tail (each only if not empty)."""
    out = []
    for t in tensors:
        flat = t.reshape(-1)
        whole = flat.numel() // NORM_ROW * NORM_ROW
        if whole:
            out.append(flat[:whole].view(-1, NORM_ROW))
        if whole < flat.numel():
            out.append(flat[whole:].view(1, -1))
    return out


def squared_norm(grads: list[torch.Tensor], device: torch.device, pieces: bool = False) -> torch.Tensor:
    """Sum of squares of ``grads`` as an fp32 scalar: per 2-D piece the fp32 norm of each
    row (whatever the gradient dtype; one kernel), their squares summed in fp64; a zero
    scalar on ``device`` when there are none. ``pieces``: ``grads`` are already
    :func:`norm_pieces`."""
    if not grads:
        return torch.zeros((), dtype=torch.float32, device=device)
    views = grads if pieces else norm_pieces(grads)
    rows = [torch.linalg.vector_norm(v, dim=1, dtype=torch.float32) for v in views]  # (rows,) each
    return torch.cat(rows).double().square().sum().float()


@torch.no_grad()
def global_grad_norm(grads_and_params, topo) -> torch.Tensor:
    """L2 norm of all gradients of the model, each parameter counted once across the
    tensor- and pipeline-parallel groups (fp32, same value on every rank, on the
    gradients' device)."""
    pairs = [(g, p) for g, p in grads_and_params if g is not None]
    grads = [g for g, p in pairs if counts_in_norm(p)]
    device = pairs[0][0].device if pairs else torch.device("cpu")
    sq = squared_norm(grads, device)
    all_reduce(sq, topo.mp_group)
    return sq.sqrt()


@torch.no_grad()
def clip_coefficient(norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """``min(1, max_norm / (norm + 1e-6))``, as ``torch.nn.utils.clip_grad_norm_``."""
    return torch.clamp(max_norm / (norm + 1e-6), max=1.0)


def clip_factor(norm: torch.Tensor, max_norm: float) -> torch.Tensor | None:
    """The factor to scale gradients by, or None when clipping is off or would multiply
    by exactly 1 (the norm is within ``max_norm``: a pass over every gradient saved)."""
    if max_norm <= 0:
        return None
    coef = clip_coefficient(norm, max_norm)
    return coef if float(coef) < 1.0 else None


class GlobalNormOptimizer:
    """An optimizer step in two halves around one all-reduce over the world (see the
    module docstring).

    The shares of all ranks add up to the squared global norm, each gradient element
    counted once: model-parallel ranks hold different parameters (a parameter replicated
    over them is counted by its ``p3d_norm_owner`` only), and data-parallel copies of
    the same gradient count on one of them. So the trainer can sum the norm together
    with the step's loss and metrics in a single collective. :meth:`step` does the
    three parts itself."""

    topo = None
    timeline = None  # a Timeline: collective waits recorded as "comm" spans

    def begin_step(self, backward_passes: int | None = None) -> None:
        raise NotImplementedError

    def fill_params(self, fill, params: list | None = None) -> None:
        """``fill(ps)`` writes the start values of parameters ``ps`` (the seeded init or a
        checkpoint's slices): here in one call, ``fill(params)`` (None: every parameter of
        the model); ZeRO 3 overrides it to fill one bucket at a time."""
        fill(params)

    def reduce_gradients(self) -> torch.Tensor:
        raise NotImplementedError

    def apply(self, lr: float, norm: torch.Tensor, skip: bool = False) -> None:
        raise NotImplementedError

    @torch.no_grad()
    def step(self, lr: float, skip: bool = False) -> float:
        """Sync, clip and update; returns the global gradient norm. A step whose norm is
        not finite, or called with ``skip``, changes no weight."""
        sq = self.reduce_gradients()
        with comm_span(self.timeline, "grad norm"):
            all_reduce(sq, self.topo.world_group)
        norm = sq.sqrt()
        self.apply(lr, norm, skip)
        return float(norm)
