"""Weight gradients taken out of a backward pass and computed later: the "W" of
zero-bubble pipeline schedules (Qi et al., "Zero Bubble Pipeline Parallelism", 2024).

A backward pass splits into the input gradient (B: what the previous pipeline stage is
waiting for) and the weight gradient (W: needed only by the optimizer step). Run the
backward under :func:`deferring` and every op that honours it computes its input gradient
only and records its weight-gradient work instead::

    work = DeferredWeightGrads()
    with deferring(work):
        torch.autograd.backward(out, grad)   # B: input gradients; W recorded in `work`
    ...                                      # other micro-batches, other stages
    work.run()                               # W: every weight gradient of that backward

The ops that honour it call :func:`defer` with a closure; outside :func:`deferring` (or
inside ``deferring(None)``) ``defer`` returns False and the op computes its weight
gradient at once, as before. A closure returns ``[(parameter, gradient), ...]``;
:meth:`DeferredWeightGrads.run` calls the closures in the order they were recorded
(autograd's order for the same backward) and hands their gradients, a group of at most
:data:`FLUSH_BYTES` at a time, to ``torch.autograd.backward`` on the leaf parameters, so
they accumulate exactly as an undivided backward pass would have accumulated them: into ``.grad`` through each
parameter's ``AccumulateGrad`` node, with its post-accumulate-grad hooks (ZeRO's bucket
counting, :mod:`parallel3d.zero.grads`) firing once per parameter and group. A weight whose
GEMM adds into an fp32 ``main_grad`` does that inside the closure (and calls its
``on_accumulated``), returning no pair for it.

A closure keeps alive what its weight gradient reads (the layer's input, the gradient of
its output); everything else the forward saved is freed by B as usual. It must name the
parameters as the op's forward received them (kept on ``ctx``), not as
``ctx.saved_tensors`` returns them: under activation recomputation those are the
recomputation's copies, and a gradient handed to a copy need not reach the parameter.

The recording target is one module-level slot, not thread-local: on CUDA autograd runs
the backward on a device thread while the calling thread waits in it, and that thread
must see the caller's target. Only one backward pass records at a time (the pipeline
runtime runs one action at a time).
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch

__all__ = ["DeferredWeightGrads", "deferring", "defer", "is_deferring"]

_target: list = [None]  # the DeferredWeightGrads being recorded into, or None
_ENGINE = torch.autograd.Variable._execution_engine


class DeferredWeightGrads:
    """The weight-gradient closures recorded during one (or more) backward passes."""

    def __init__(self):
        self.work: list[Callable[[], list]] = []

    def __len__(self) -> int:
        return len(self.work)

    def add(self, fn: Callable[[], list]) -> None:
        self.work.append(fn)

    def run(self) -> None:
        """Compute every recorded weight gradient and accumulate it (see the module
        docstring); the recorded work is released. Gradients are handed to autograd in
        groups of at most :data:`FLUSH_BYTES` (or one closure's, if larger), so no more
        than that many bytes of computed, not yet accumulated gradients exist at once."""
        work, self.work = self.work, []
        params, grads, held, flushed = [], [], 0, set()
        for fn in work:
            # Outside a backward pass grad mode is on: the GEMMs on the saved inputs (which
            # require grad) would record a graph nobody differentiates, and an in-place add
            # into an fp32 main_grad would be refused.
            with torch.no_grad():
                pairs = fn()
            for p, g in pairs:
                if g is not None:
                    # a parameter whose gradients land in two groups would be counted
                    # twice by the hooks (ZeRO's expect one per micro-batch and chunk)
                    assert id(p) not in flushed, "a parameter's weight gradient recorded twice"
                    params.append(p)
                    grads.append(g)
                    held += g.numel() * g.element_size()
            if held >= FLUSH_BYTES:
                _accumulate(params, grads)
                flushed.update(map(id, params))
                params, grads, held = [], [], 0
        if params:
            _accumulate(params, grads)


FLUSH_BYTES = 16 * 2**20  # computed weight gradients handed to autograd together, at most


def _accumulate(params: list, grads: list) -> None:
    # torch.autograd.backward's own call, without its per-tensor Python checks (half its
    # cost: 190 against 90 us for 40 parameters on CPU); the closures give gradients of
    # their parameters' shapes
    _ENGINE.run_backward(tuple(params), tuple(grads), False, False, (), True, True)


@contextlib.contextmanager
def deferring(work: DeferredWeightGrads | None):
    """Record the weight gradients of the backward passes run inside into ``work``
    (None: compute them at once)."""
    previous, _target[0] = _target[0], work
    try:
        yield work
    finally:
        _target[0] = previous


def is_deferring() -> bool:
    return _target[0] is not None


def defer(fn: Callable[[], list]) -> bool:
    """Record ``fn`` (returning ``[(parameter, gradient), ...]``) if a backward pass is
    being recorded; False if not, and the caller computes the gradients now."""
    work = _target[0]
    if work is None:
        return False
    work.add(fn)
    return True
