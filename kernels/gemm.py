"""The three GEMMs of a linear layer, each sent to Triton or to torch, and the choice.

    forward_gemm  Y  = X W^T + b    (M, N)   "fwd"
    dgrad_gemm    dX = dY W         (M, K)   "dgrad"
    wgrad_gemm    dW = dY^T X       (N, K)   "wgrad" (+ db = sum of dY's rows)

Each takes a ``backend``:

* "torch": torch's GEMM in the input dtype (cuBLAS on CUDA), seen by activation
  checkpointing policies as ``aten.mm`` / ``aten.addmm``;
* "triton": ``kernels/linear.py`` through its custom ops ``torch.ops.parallel3d.linear_*``
  (on CPU only under ``TRITON_INTERPRET=1``);
* "auto": torch on CPU; on CUDA, Triton only for a GEMM (GPU model, kind, dtype, M, N, K)
  whose measurement (:func:`measure_linear_backends`) found it at least as fast as cuBLAS,
  torch for everything else. Without a measured table nothing runs Triton. The table is
  made on one rank and shipped to the others (``parallel3d.tensor_parallel.gemm_backends``),
  so every rank runs the same kernels.

Gradient-accumulation fusion (``main_grad``, fp32, the weight's shape): dW is added into
it in place and the weight gets no gradient from autograd. Triton adds its fp32
accumulator (no rounding of dW); torch rounds dW to the input dtype once and adds it, as
Megatron does without its fused kernel.

:func:`linear` is the differentiable layer on top (any leading dims), each of its three
GEMMs dispatched on its own. Its backward honours :mod:`.deferred`: inside a backward run
under ``deferring(work)`` it computes dX only and records the wgrad (and bias gradient)
for ``work.run()`` (the W of a zero-bubble pipeline schedule).
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from . import linear as _triton_linear  # registers the torch.ops.parallel3d.linear_* ops
from .deferred import defer
from ._matmul_common import KERNEL_KINDS, prefers_triton, record_backend_choice

__all__ = ["linear", "forward_gemm", "dgrad_gemm", "wgrad_gemm", "measure_linear_backends", "BACKENDS"]

BACKENDS = ("auto", "triton", "torch")
_ops = torch.ops.parallel3d


@functools.lru_cache(maxsize=None)
def gpu_name(device: torch.device) -> str:
    """The GPU model the backend table is keyed by, e.g. "NVIDIA H200"."""
    return torch.cuda.get_device_name(device)


def check_backend(backend: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"linear backend {backend!r}: expected one of {BACKENDS}")


def _runs_triton(kind: str, backend: str, a: torch.Tensor, m: int, n: int, k: int) -> bool:
    if backend == "torch":
        return False
    if backend == "triton":
        if _triton_linear.triton is None:
            raise ValueError("linear backend 'triton' needs triton installed (pip install triton)")
        if not a.is_cuda and not _triton_linear._INTERPRETED:
            raise ValueError("backend='triton' on CPU tensors needs TRITON_INTERPRET=1 in the environment "
                             "before triton is first imported; use backend='auto' or 'torch' otherwise")
        return True
    check_backend(backend)
    return (a.is_cuda and _triton_linear.triton is not None
            and prefers_triton(gpu_name(a.device), kind, a.dtype, m, n, k))


def _unit_stride(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous() if t.shape[1] > 1 and t.stride(1) != 1 else t


def forward_gemm(x2d, weight, bias=None, backend="auto"):
    """``x W^T + b``: x (M, K), weight (N, K) -> (M, N); no autograd."""
    if _runs_triton("fwd", backend, x2d, x2d.shape[0], weight.shape[0], x2d.shape[1]):
        return _ops.linear_fwd(_unit_stride(x2d), weight, bias)
    return F.linear(x2d, weight, bias)


def dgrad_gemm(dy, weight, backend="auto"):
    """``dX = dy W``: dy (M, N), weight (N, K) -> (M, K); no autograd."""
    if _runs_triton("dgrad", backend, dy, dy.shape[0], weight.shape[1], weight.shape[0]):
        return _ops.linear_dgrad(_unit_stride(dy), weight)
    return torch.mm(dy, weight)


def _accumulated(main_grad) -> None:
    """Tell whoever owns ``main_grad`` that a gradient went in: its ``on_accumulated``
    attribute, when set, is called (the optimizer counts each weight's contributions with
    it; autograd's own hooks never see a gradient that autograd does not produce)."""
    hook = getattr(main_grad, "on_accumulated", None)
    if hook is not None:
        hook()


def wgrad_gemm(dy, x2d, backend="auto", *, bias_grad=False, main_grad=None):
    """``(dW, db)`` with dW = dy^T x (N, K), db = sum of dy's rows (N,) or None unless
    ``bias_grad``. With ``main_grad`` (fp32 (N, K), contiguous) dW is added into it (then
    its ``on_accumulated``, if any, is called) and None is returned in its place."""
    n, k = dy.shape[1], x2d.shape[1]
    _triton_linear._check_main_grad(main_grad, (n, k), x2d.device)
    if _runs_triton("wgrad", backend, dy, n, k, dy.shape[0]):
        dy, x2d = _unit_stride(dy), _unit_stride(x2d)
        if main_grad is not None:
            db = _ops.linear_wgrad_into(dy, x2d, main_grad, bias_grad)
            _accumulated(main_grad)
            return None, db if bias_grad else None
        dw, db = _ops.linear_wgrad(dy, x2d, bias_grad)
        return dw, db if bias_grad else None
    db = dy.sum(0) if bias_grad else None
    if main_grad is not None:
        main_grad.add_(torch.mm(dy.t(), x2d))  # dW rounded to dy's dtype once, summed in fp32
        _accumulated(main_grad)
        return None, db
    return torch.mm(dy.t(), x2d), db


class _LinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2d, weight, bias, main_grad, backend):
        ctx.save_for_backward(x2d, weight)
        # main_grad is not saved for backward: every micro-batch's backward updates it in
        # place, which would trip autograd's version check of a saved tensor.
        ctx.main_grad, ctx.backend = main_grad, backend
        # A deferred W hands its gradients to these very inputs: under activation
        # recomputation the saved tensors come back as recomputed copies, which autograd
        # does not lead to the parameters' accumulators.
        ctx.inputs = (weight, bias)
        return forward_gemm(x2d, weight, bias, backend)

    @staticmethod
    def backward(ctx, grad_out):
        x2d, weight = ctx.saved_tensors
        dy = grad_out.reshape(-1, weight.shape[0])  # (M, N)
        want_dx, want_dw, want_db = ctx.needs_input_grad[:3]
        dx = dgrad_gemm(dy, weight, ctx.backend) if want_dx else None
        if not (want_dw or want_db):
            return dx, None, None, None, None
        # a frozen weight with a trainable bias still runs the GEMM
        main_grad, backend, (weight_in, bias_in) = (ctx.main_grad if want_dw else None), ctx.backend, ctx.inputs

        def weight_grads() -> list:
            dw, db = wgrad_gemm(dy, x2d, backend, bias_grad=want_db, main_grad=main_grad)
            return [(weight_in, dw if want_dw else None), (bias_in, db)]

        if defer(weight_grads):  # a zero-bubble schedule's B: the W runs later
            return dx, None, None, None, None
        (_, dw), (_, db) = weight_grads()
        return dx, dw, db, None, None


def linear(x, weight, bias=None, main_grad=None, backend="auto"):
    """``y = x W^T + b``, differentiable: x (..., K), weight (N, K), bias (N,) -> (..., N).

    main_grad: optional fp32 (N, K) buffer; if given, the backward adds dW into it in
    place and gives the weight no .grad. backend: "auto", "triton" or "torch" (module
    docstring); each of the three GEMMs is dispatched on its own.
    """
    check_backend(backend)
    if not isinstance(x, torch.Tensor) or x.dim() < 1:
        raise ValueError(f"x must be a tensor of shape (..., in_features), got {getattr(x, 'shape', type(x))}")
    _triton_linear._check_weight(weight, x.shape[-1])
    x2d = _unit_stride(x.reshape(-1, x.shape[-1]))  # (M, K), M = prod(leading dims); autograd undoes the view
    _triton_linear._check_linear(x2d, weight, bias)
    _triton_linear._check_main_grad(main_grad, weight.shape, weight.device)
    y = _LinearFunction.apply(x2d, weight, bias, main_grad, backend)  # (M, N)
    return y.view(*x.shape[:-1], weight.shape[0])


def _cuda_seconds(fn) -> float:
    import triton.testing  # deferred: only a GPU measurement needs it

    return triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median") / 1e3


def measure_linear_backends(m, n, k, dtype, device, *, fuse_main_grad=False, timer=None,
                            device_name=None, kinds=KERNEL_KINDS) -> dict:
    """Time each GEMM of a linear layer (x (m, k), W (n, k)) with Triton and with torch on
    the same operands, record the faster per GEMM for ``backend="auto"`` (Triton only if at
    least as fast) and return ``{kind: (triton s, torch s, choice)}``.

    ``timer(fn) -> seconds``: by default the median of CUDA-event timings
    (``triton.testing.do_bench``), which needs a CUDA device; tests inject one.
    ``fuse_main_grad`` times the wgrad as the layers run it with an fp32 main grad.
    """
    device = torch.device(device)
    if timer is None:
        if device.type != "cuda" or _triton_linear.triton is None:
            raise ValueError("measuring the GEMM backends needs a CUDA device and triton "
                             "(or an injected timer): CPU timings would mean nothing")
        timer = _cuda_seconds
    name = device_name or gpu_name(device)
    x, w, dy = _triton_linear.example_operands(m, n, k, dtype, device)
    main_grad = torch.zeros(n, k, dtype=torch.float32, device=device) if fuse_main_grad else None
    pairs = {  # kind -> (GEMM M, N, K as keyed, Triton, torch)
        "fwd": ((m, n, k), lambda: forward_gemm(x, w, None, "triton"), lambda: forward_gemm(x, w, None, "torch")),
        "dgrad": ((m, k, n), lambda: dgrad_gemm(dy, w, "triton"), lambda: dgrad_gemm(dy, w, "torch")),
        "wgrad": ((n, k, m), lambda: wgrad_gemm(dy, x, "triton", main_grad=main_grad),
                  lambda: wgrad_gemm(dy, x, "torch", main_grad=main_grad)),
    }
    out = {}
    for kind in kinds:
        mnk, ours, theirs = pairs[kind]
        triton_s, torch_s = timer(ours), timer(theirs)
        out[kind] = (triton_s, torch_s, record_backend_choice(name, kind, dtype, *mnk, triton_s, torch_s))
    return out
