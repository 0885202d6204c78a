"""Column-parallel layers that read the same input, in one autograd node whose backward
overlaps the input-gradient reduction with the weight-gradient GEMMs.

Layers i = 1..n read one ``X`` (q, k and v of attention; gate and up of the MLP; or a
single layer): ``Y_i = X A_i^T + b_i`` with ``A_i = [A_i,1; ..; A_i,p]`` split by output
rows over the p ranks of the tensor-parallel group; rank r holds ``A_i,r`` (N_i/p, K).

    forward   X (B, S, K), the same on every rank; under sequence parallelism each rank
              holds (B, S/p, K) and X is all-gathered along S once for all n layers.
              Y_i,r = X A_i,r^T + b_i,r                     n GEMMs, (B, S, N_i/p) each
    backward  D_r = sum_i dY_i,r A_i,r                      n dgrad GEMMs, summed here
              start  dX = sum_r D_r                         all-reduce of (B, S, K), or
                                                            reduce-scatter to (B, S/p, K)
              dA_i,r = dY_i,r^T X,  db_i,r = sum dY_i,r     n wgrad GEMMs, while it flies
              wait

What crosses the wire, per call: nothing forward (the all-gather of X under sequence
parallelism); backward one all-reduce of (B, S, K) (one reduce-scatter to (B, S/p, K)),
for all n layers together, started before the first wgrad GEMM and waited for after the
last. Under sequence parallelism the node keeps only this rank's shard of X for the
backward, (B, S/p, K), not the gathered (B, S, K): the backward gathers it again, started
before the dgrad GEMMs and waited for before the first wgrad (Megatron does the same),
which saves (1 - 1/p) of the largest activation of every attention and MLP block. It is one node for all n layers because autograd runs a node once all its outputs'
gradients are in: it can run every dgrad, issue the reduction of their sum, then every
wgrad. One node per layer would compute each layer's wgrad before the last dgrad, with
nothing left to overlap; Megatron's and picotron's single-layer version overlap one
layer's wgrad only.

What overlaps where: on NCCL the reduction runs on NCCL's stream while the wgrad GEMMs
run on the compute stream (``wait`` only orders the streams; the host never blocks). On
gloo (CPU) the collective runs on gloo's worker thread while this thread computes the
wgrads; ``wait`` blocks until it is done. ``ORDER`` records, in tests, the order in
which the reduction is issued, the wgrads run and the wait returns.

Split backward (zero-bubble schedules, :mod:`parallel3d.kernels.deferred`): inside a
backward run under ``deferring(work)`` the node computes the dgrads and the dX reduction
only (waited for at once: there is no wgrad left to overlap it with) and records the
wgrads as one closure for the schedule's W, which under sequence parallelism gathers X
again from the kept shard (all tp ranks run the same plan, so they gather together).

Layout: under sequence parallelism a rank holds a run of the B*S tokens (``comm.py``),
the layout the collectives read and write, so neither the gather nor the reduce-scatter
copies at any micro_batch B. Sharding S within each sequence instead would cost, at
B > 1, one permuting (B, S, K) copy per collective, eight per layer (forward and
backward); estimated for an H100 at tp 8 (8B shard: 164 MFLOP of GEMMs per token
against 8 x 16 KB of copy traffic) about a fifth of the GEMM time, a third of the
collectives' own (on this CPU it measured 0.3-2.6 % of the GEMM time, noisy).

:class:`SharedInput` lets the layers be called one by one, as a plain model does
(``self.q_proj(x)``, ``self.k_proj(x)``, ...): the first call computes all of them,
the others take their output. Under sequence parallelism the module around them
(attention, MLP) reads the sequence length from its input, so a forward pre-hook on it
hands the module the gathered ``X`` (B, S, K): a stand-in that only says which shard
to compute from. Its gradient must come through the shared layers (whose node returns
the reduce-scattered dX of the shard); any other use of it raises in backward.
"""

from __future__ import annotations

from functools import partial

import torch

from parallel3d.kernels.deferred import defer
from parallel3d.kernels.gemm import dgrad_gemm, forward_gemm, wgrad_gemm

from .comm import (_gather_tokens, group_size, start_all_reduce, start_gather_tokens,
                   start_reduce_scatter_tokens)

# Tests set this to a list: the backward appends ("reduce started"), ("wgrad", i) and
# ("reduce waited") in the order they happen.
ORDER: list | None = None


def _note(event) -> None:
    if ORDER is not None:
        ORDER.append(event)


class _ColumnParallelGemms(torch.autograd.Function):
    """``(Y_1, .., Y_n) = (X A_1^T + b_1, .., X A_n^T + b_n)`` with the communication of
    the module docstring. ``spec = (group, sequence_parallel, backend, main_grads)``;
    ``params = (A_1, b_1, .., A_n, b_n)``, biases may be None."""

    @staticmethod
    def forward(ctx, x, spec, *params):
        group, sp, backend, main_grads, gathered = spec
        shard = x  # under sequence parallelism (B, S/p, K): what the backward keeps
        with torch.autocast(x.device.type, enabled=False):  # the caller cast the operands
            if sp:  # (B, S/p, K) -> (B, S, K), unless the module's pre-hook gathered it
                x = gathered.to(x.dtype) if gathered is not None else _gather_tokens(x, group)
            x2d = x.reshape(-1, x.shape[-1])  # (B*S, K)
            weights, biases = params[0::2], params[1::2]
            ys = [forward_gemm(x2d, w, b, backend).view(*x.shape[:-1], w.shape[0])
                  for w, b in zip(weights, biases)]
        ctx.save_for_backward(shard if sp else x2d, *weights)
        ctx.spec, ctx.gathered_shape = spec, x.shape
        ctx.has_bias = [b is not None for b in biases]
        # what a deferred W hands its gradients to: the inputs themselves (recomputation
        # hands back copies of the saved tensors, not leading to the parameters)
        ctx.params = (weights, biases)
        ctx.set_materialize_grads(False)
        return tuple(ys)

    @staticmethod
    def backward(ctx, *grads):
        group, sp, backend, main_grads, _ = ctx.spec
        saved, *weights = ctx.saved_tensors
        dys = [None if g is None else g.reshape(-1, w.shape[0]) for g, w in zip(grads, weights)]
        wants = [(ctx.needs_input_grad[2 + 2 * i], ctx.needs_input_grad[3 + 2 * i] and ctx.has_bias[i])
                 for i in range(len(weights))]
        work = [(i, dy, ww, wb) for i, (dy, (ww, wb)) in enumerate(zip(dys, wants))
                if dy is not None and (ww or wb)]
        spec = (group, sp, backend, saved, weights, ctx.params, main_grads, work)
        # A zero-bubble schedule's B: the wgrads are recorded for its W (which gathers X
        # again under sequence parallelism); nothing is left to overlap the dX reduction.
        deferred = bool(work) and defer(partial(_weight_grads, spec))
        # under sequence parallelism X is gathered again, while the dgrads run
        gathering = start_gather_tokens(saved, group) if sp and work and not deferred else None
        pending = None
        if ctx.needs_input_grad[0]:
            partial_dx = None  # D_r = sum_i dY_i A_i, (B*S, K)
            for dy, w in zip(dys, weights):
                if dy is not None:
                    part = dgrad_gemm(dy, w, backend)
                    partial_dx = part if partial_dx is None else partial_dx.add_(part)
            if partial_dx is None:
                partial_dx = saved.new_zeros(ctx.gathered_shape)
            partial_dx = partial_dx.view(ctx.gathered_shape)
            pending = (start_reduce_scatter_tokens(partial_dx, group) if sp
                       else start_all_reduce(partial_dx, group))
            _note("reduce started")
        param_grads = [None] * (2 * len(weights))
        if not deferred:
            x2d = gathering.wait().reshape(-1, saved.shape[-1]) if gathering is not None else saved
            pairs = _weight_grads(spec, x2d, by_index=True)
            for (i, dw), (_, db) in zip(pairs[0::2], pairs[1::2]):
                param_grads[2 * i], param_grads[2 * i + 1] = dw, db
        dx = None
        if pending is not None:
            dx = pending.wait()
            _note("reduce waited")
        return (dx, None, *param_grads)


def _weight_grads(spec, x2d=None, by_index: bool = False) -> list:
    """``dA_i = dY_i^T X`` (and ``db_i``) of every layer that wants them, as
    ``[(A_i, dA_i), (b_i, db_i), ...]`` (a deferred W's pairs), or with the layer index
    ``i`` in place of the parameters (``by_index``: the backward returns them itself).
    ``x2d``: X (B*S, K), gathered under sequence parallelism; gathered here if not given."""
    group, sp, backend, saved, weights, (weights_in, biases_in), main_grads, work = spec
    keyed = not by_index
    if x2d is None:
        x2d = _gather_tokens(saved, group).reshape(-1, saved.shape[-1]) if sp else saved
    out = []
    for i, dy, want_w, want_b in work:
        main_grad = main_grads[i] if want_w else None
        dw, db = wgrad_gemm(dy, x2d, backend, bias_grad=want_b, main_grad=main_grad)
        _note(("wgrad", i))
        out += [(weights_in[i] if keyed else i, dw if want_w else None), (biases_in[i] if keyed else i, db)]
    return out


def column_parallel_forward(x: torch.Tensor, layers, group, sequence_parallel: bool,
                            backend: str, gathered: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """The outputs of the column-parallel ``layers`` (each with ``.weight``, ``.bias``)
    on their shared input ``x``, (B, S, N_i/p) each; under sequence parallelism ``x`` is
    this rank's (B, S/p, K) and ``gathered``, if given, its all-gather (not repeated).
    Under autocast the GEMMs run in the autocast dtype (differentiable casts, as autocast
    does for ``F.linear``). A weight carrying an fp32 ``main_grad`` gets its gradient
    added there instead of ``.grad``."""
    main_grads = tuple(getattr(layer.weight, "main_grad", None) for layer in layers)
    params = []
    for layer in layers:
        params += [layer.weight, layer.bias]
    device = x.device.type
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
        x = x.to(dtype)
        params = [None if p is None else p.to(dtype) for p in params]
    if group_size(group) == 1:
        sequence_parallel = False  # nothing to gather or reduce
    spec = (group, sequence_parallel, backend, main_grads,
            None if gathered is None else gathered.detach())
    return _ColumnParallelGemms.apply(x, spec, *params)


class _GatheredStandIn(torch.autograd.Function):
    """The all-gathered input a module under sequence parallelism reads its shape from."""

    @staticmethod
    def forward(ctx, x, group):
        return _gather_tokens(x, group)  # (B, S/p, K) -> (B, S, K)

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("the sequence-gathered input of column-parallel layers tied by share_input was "
                           "used outside those layers; its gradient would be lost: call the layers on it only")


class SharedInput:
    """Column-parallel layers (same group, sequence parallelism, backend and input width)
    that read the same ``X``, computed together by :func:`column_parallel_forward`.

    A member called with a new ``X`` (or one whose output was already taken) computes
    every member's output; the others, called with the same tensor, take theirs. The
    outputs are held only until taken, so a member never called again keeps its output
    (and ``X``) alive until the next call."""

    def __init__(self, layers):
        self.layers = list(layers)
        first = self.layers[0]
        self.group, self.sequence_parallel, self.backend = first.group, first.sequence_parallel, first.backend
        self._x = None
        self._outputs: dict[int, torch.Tensor] = {}
        self._entered: tuple[torch.Tensor, torch.Tensor] | None = None  # (gathered, shard)

    def __call__(self, module, args):
        """Forward pre-hook of the module around the layers: under sequence parallelism
        its input becomes the gathered stand-in (B, S, K) for the shard (B, S/p, K)."""
        if not self.sequence_parallel or group_size(self.group) == 1:
            return None
        shard = args[0]
        device = shard.device.type
        if torch.is_autocast_enabled(device):  # the GEMMs read it in that dtype: gather fewer bytes
            shard = shard.to(torch.get_autocast_dtype(device))
        gathered = _GatheredStandIn.apply(shard, self.group)
        self._entered = (gathered, shard)
        return (gathered, *args[1:])

    def shard_of(self, x: torch.Tensor) -> torch.Tensor:
        """The token shard (B, S/p, K) that ``x``, the module's input as its pre-hook
        handed it, stands for (``x`` itself without sequence parallelism or outside the
        module's call): what another reader of the input (LoRA's A) may differentiate."""
        if self._entered is not None and x is self._entered[0]:
            return self._entered[1]
        return x

    def output(self, layer, x: torch.Tensor) -> torch.Tensor:
        if x is not self._x or id(layer) not in self._outputs:
            source, gathered = x, None
            if self._entered is not None:
                if x is not self._entered[0]:
                    raise ValueError("under sequence parallelism the layers tied by share_input must be "
                                     "called on their module's input as the module received it")
                gathered, source = self._entered
            ys = column_parallel_forward(source, self.layers, self.group, self.sequence_parallel,
                                         self.backend, gathered)
            self._x, self._outputs = x, {id(member): y for member, y in zip(self.layers, ys)}
        y = self._outputs.pop(id(layer))
        if not self._outputs:
            self._x = self._entered = None
        return y
