"""Fused linear layer for tensor-parallel shards: ``Y = act(X W^T + b)`` in Triton.

Shapes: X (..., K) is flattened to (M, K); W (N, K) is the nn.Linear layout of one
column- or row-parallel shard; b (N,); Y (..., N). Inputs are fp32, bf16 or fp16 (all
the same dtype), every GEMM accumulates in fp32, outputs come back in the input dtype.

    forward   Z = X W^T + b          one GEMM; bias and activation in its epilogue, which
              Y = act(Z)             also stores Z (input dtype) when act != none
    backward  dZ = dY * act'(Z)      computed while loading dY, inside both GEMMs below
              dX = dZ W      (M, K)  "dgrad"
              dW = dZ^T X    (N, K)  "wgrad"; db = sum over rows of dZ in the same K loop

Gradient-accumulation fusion: with ``main_grad`` (fp32, shape of W) the wgrad epilogue
does ``main_grad += dZ^T X`` in place, so micro-batches sum into one fp32 buffer with no
extra pass, and the autograd function returns None as the weight's grad (``weight.grad``
stays None; the optimizer must read ``main_grad``). The bias grad is returned as usual.

Dispatch is the explicit ``backend`` argument: "auto" runs Triton on CUDA tensors and
the pure-torch reference on CPU tensors, "triton" forces the kernels (on CPU only under
``TRITON_INTERPRET=1`` set before triton is imported), "torch" forces the reference.

Tile configs (see _matmul_common): tuned if `autotune_linear` ran or a table was loaded,
else a shape-only heuristic. Tuned entries are keyed on (kind, dtype, M, N, K) only, so
tune with the bias/activation/main_grad options the layer really uses. To make every
rank run the same tiles::

    if rank == 0:
        autotune_linear(m, n, k, torch.bfloat16, "cuda")
    table = [tuned_configs()]
    torch.distributed.broadcast_object_list(table, src=0)
    load_tuned_configs(table[0])
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._matmul_common import (KERNEL_KINDS, TileConfig, autotune, clear_tuned_configs, load_tuned_configs,
                             select_config, tuned_configs)

__all__ = ["linear", "linear_ref", "linear_forward", "linear_grad_input", "linear_grad_weight",
           "autotune_linear", "tuned_configs", "load_tuned_configs", "clear_tuned_configs", "TileConfig"]

ACTIVATIONS = {"none": 0, "silu": 1}
BACKENDS = ("auto", "triton", "torch")
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _gemm_kernel(a_ptr, z_ptr, b_ptr, c_ptr, bias_ptr, preact_ptr, rowsum_ptr, M, N, K,
                 stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
                 ACTIVATION: tl.constexpr, SILU_GRAD_A: tl.constexpr, HAS_BIAS: tl.constexpr,
                 STORE_PREACT: tl.constexpr, ACCUMULATE: tl.constexpr, ROW_SUM_A: tl.constexpr,
                 FP32_IEEE: tl.constexpr, INT64: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    """C[M, N] (+)= epilogue(prologue(A)[M, K] @ B[K, N]), all operands strided.

    SILU_GRAD_A: A := A * silu'(Z) with Z read at A's offsets (the SiLU backward).
    ROW_SUM_A:   rowsum[m] = sum_k A[m, k] (after the prologue), stored by pid_n == 0.
    Epilogue order: + bias[n], store pre-activation, activation, += C (fp32), store.
    """
    pid = tl.program_id(0)
    # Grouped launch order: GROUP_M tile rows are swept column by column, so the B
    # panels they share are read from L2 rather than HBM.
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    group_size = GROUP_M * num_pid_n
    first_pid_m = (pid // group_size) * GROUP_M
    group_m = tl.minimum(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + (pid % group_size) % group_m
    pid_n = (pid % group_size) // group_m

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    if INT64:  # some tensor spans more than 2**31 elements: index products would wrap
        offs_m = offs_m.to(tl.int64)
        offs_n = offs_n.to(tl.int64)
    mask_m = offs_m < M
    mask_n = offs_n < N
    a_offs = offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    rowsum = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - k * BLOCK_K
        a_mask = mask_m[:, None] & (offs_k[None, :] < k_left)
        a = tl.load(a_ptr + a_offs, mask=a_mask, other=0.0)
        if SILU_GRAD_A:
            z = tl.load(z_ptr + a_offs, mask=a_mask, other=0.0).to(tl.float32)
            sig = tl.sigmoid(z)
            # d silu(z)/dz = s + z s (1 - s); round dZ to the operand dtype like the reference
            a = (a.to(tl.float32) * sig * (1.0 + z * (1.0 - sig))).to(b_ptr.dtype.element_ty)
        if ROW_SUM_A:
            rowsum += tl.sum(a.to(tl.float32), axis=1)
        b = tl.load(b_ptrs, mask=(offs_k[:, None] < k_left) & mask_n[None, :], other=0.0)
        if FP32_IEEE:  # fp32 means fp32: TF32 would lose 13 mantissa bits vs. the reference
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
        a_offs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk

    c_offs = offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn
    c_mask = mask_m[:, None] & mask_n[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    if STORE_PREACT:
        tl.store(preact_ptr + c_offs, acc.to(preact_ptr.dtype.element_ty), mask=c_mask)
    if ACTIVATION == 1:
        acc = acc * tl.sigmoid(acc)
    if ACCUMULATE:  # C is the fp32 main grad: read-modify-write, no separate add pass
        acc += tl.load(c_ptr + c_offs, mask=c_mask, other=0.0)
    tl.store(c_ptr + c_offs, acc.to(c_ptr.dtype.element_ty), mask=c_mask)
    if ROW_SUM_A:
        if pid_n == 0:  # every pid_n holds the same sums; one column of tiles writes them
            tl.store(rowsum_ptr + offs_m, rowsum.to(rowsum_ptr.dtype.element_ty), mask=mask_m)


# The kernel object says whether triton was imported under the interpreter; the host code
# never reads TRITON_INTERPRET itself.
_INTERPRETED = type(_gemm_kernel).__name__ == "InterpretedFunction"


def _max_offset(t: torch.Tensor) -> int:
    return sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()) if size > 0)


def _gemm(kind, a, b, c, *, z=None, bias=None, preact=None, rowsum=None, activation="none",
          accumulate=False, config=None):
    """Launch C = A @ B (views with any strides; see _gemm_kernel for the options)."""
    m, k = a.shape
    n = b.shape[1]
    if m == 0 or n == 0:
        return
    extras = any(t is not None for t in (z, bias, preact, rowsum)) or accumulate or activation != "none"
    cfg = config or select_config(kind, b.dtype, m, n, k, interpreted=_INTERPRETED, fused_extras=extras)
    tensors = [t for t in (a, b, c, z, preact) if t is not None]
    int64 = max(_max_offset(t) for t in tensors) >= 2**31 - 1
    grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n),)
    _gemm_kernel[grid](
        a, a if z is None else z, b, c, c if bias is None else bias, c if preact is None else preact,
        c if rowsum is None else rowsum, m, n, k,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), c.stride(0), c.stride(1),
        ACTIVATION=ACTIVATIONS[activation], SILU_GRAD_A=z is not None, HAS_BIAS=bias is not None,
        STORE_PREACT=preact is not None, ACCUMULATE=accumulate, ROW_SUM_A=rowsum is not None,
        FP32_IEEE=b.dtype == torch.float32, INT64=int64, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, num_warps=cfg.num_warps, num_stages=cfg.num_stages)


# ----------------------------------------------------------------------------- checks
def _check_matrix(t, name, rows=None, cols=None, dtype=None, device=None):
    if not isinstance(t, torch.Tensor) or t.dim() != 2:
        raise ValueError(f"{name} must be a 2-D tensor, got {getattr(t, 'shape', type(t))}")
    if (rows is not None and t.shape[0] != rows) or (cols is not None and t.shape[1] != cols):
        raise ValueError(f"{name} has shape {tuple(t.shape)}, expected ({rows}, {cols})")
    if dtype is not None and t.dtype != dtype:
        raise ValueError(f"{name} is {t.dtype} but must be {dtype}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device} but the inputs are on {device}")
    if t.shape[1] > 1 and t.stride(1) != 1:
        raise ValueError(f"{name} needs unit stride in its last dim (strides {t.stride()}): call .contiguous()")


def _check_activation(activation):
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation={activation!r}: expected one of {list(ACTIVATIONS)}")


def _check_dtype(t, name):
    if t.dtype not in _DTYPES:
        raise ValueError(f"{name} is {t.dtype}: use float32, bfloat16 or float16 (accumulation is fp32)")


def _check_main_grad(main_grad, shape, device):
    if main_grad is None:
        return
    _check_matrix(main_grad, "main_grad", *shape, dtype=torch.float32, device=device)
    if not main_grad.is_contiguous():
        raise ValueError("main_grad must be contiguous: it is updated in place")


def _check_weight(weight, in_features):
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise ValueError(f"weight must be (out_features, in_features), got {getattr(weight, 'shape', weight)}")
    if weight.shape[1] != in_features or in_features == 0:
        raise ValueError(f"x has {in_features} features but weight {tuple(weight.shape)} expects "
                         f"{weight.shape[1]} (weight is (out_features, in_features), in_features > 0)")


def _check_linear(x2d, weight, bias):
    _check_matrix(x2d, "x (flattened to 2-D)")
    _check_weight(weight, x2d.shape[1])
    _check_dtype(x2d, "x")
    _check_matrix(weight, "weight", dtype=x2d.dtype, device=x2d.device)
    n = weight.shape[0]
    if bias is not None and (bias.shape != (n,) or bias.dtype != x2d.dtype or bias.device != x2d.device):
        raise ValueError(f"bias is {bias.dtype} {tuple(bias.shape)} on {bias.device}; "
                         f"expected {x2d.dtype} ({n},) on {x2d.device}")


def _check_grad(dy, other, preact, activation, rows=None, cols=None):
    """dy (rows, cols) and the saved pre-activation must match `other` in dtype and device."""
    _check_activation(activation)
    _check_matrix(other, "input")
    _check_dtype(other, "input")
    _check_matrix(dy, "grad_output", rows, cols, dtype=other.dtype, device=other.device)
    if activation != "none":
        if preact is None:
            raise ValueError(f"activation={activation!r} needs the saved pre-activation (preact)")
        _check_matrix(preact, "preact", *dy.shape, dtype=other.dtype, device=other.device)


# ------------------------------------------------------------------- Triton launchers
def linear_forward(x, weight, bias=None, activation="none", *, save_preact=False, config=None):
    """Triton ``Z = x W^T + b``, ``y = act(Z)``: x (M, K), weight (N, K), bias (N,).

    Returns ``(y, preact)``: y (M, N) in x's dtype; preact is Z (M, N) in x's dtype when
    ``save_preact`` and activation != "none" (the backward needs it), else None.
    """
    _check_linear(x, weight, bias)
    _check_activation(activation)
    y = torch.empty((x.shape[0], weight.shape[0]), dtype=x.dtype, device=x.device)
    preact = torch.empty_like(y) if save_preact and activation != "none" else None
    _gemm("fwd", x, weight.t(), y, bias=bias, preact=preact, activation=activation, config=config)
    return y, preact


def linear_grad_input(dy, weight, preact=None, activation="none", *, config=None):
    """Triton ``dX = dZ W`` with ``dZ = dy * act'(preact)``: dy (M, N), weight (N, K) -> (M, K)."""
    _check_grad(dy, weight, preact, activation, cols=weight.shape[0])
    dx = torch.empty((dy.shape[0], weight.shape[1]), dtype=dy.dtype, device=dy.device)
    _gemm("dgrad", dy, weight, dx, z=preact if activation != "none" else None, config=config)
    return dx


def linear_grad_weight(dy, x, preact=None, activation="none", *, bias_grad=False, main_grad=None, config=None):
    """Triton ``dW = dZ^T x`` (N, K) and ``db = sum_rows dZ`` (N,): dy (M, N), x (M, K).

    With ``main_grad`` (fp32, (N, K), contiguous) computes ``main_grad += dZ^T x`` in
    place and returns it instead of a new dW. Returns ``(dW or main_grad, db or None)``.
    """
    _check_grad(dy, x, preact, activation, rows=x.shape[0])
    n, k = dy.shape[1], x.shape[1]
    _check_main_grad(main_grad, (n, k), x.device)
    dw = main_grad if main_grad is not None else torch.empty((n, k), dtype=x.dtype, device=x.device)
    db = torch.empty((n,), dtype=dy.dtype, device=dy.device) if bias_grad else None
    z_t = preact.t() if activation != "none" else None
    _gemm("wgrad", dy.t(), x, dw, z=z_t, rowsum=db, accumulate=main_grad is not None, config=config)
    return dw, db


# ------------------------------------------------------------ pure-torch reference
def _act(z, activation):
    return z if activation == "none" else torch.nn.functional.silu(z)


def linear_ref(x, weight, bias=None, activation="none"):
    """Reference ``act(x W^T + b)`` computed in fp32 and rounded once to x's dtype.

    Plain differentiable torch ops on any leading shape; the tests take its autograd
    gradients as the ground truth.
    """
    z = torch.matmul(x.float(), weight.float().t())
    if bias is not None:
        z = z + bias.float()
    return _act(z, activation).to(x.dtype)


def _grad_preact_ref(dy, preact, activation):
    if activation == "none":
        return dy
    z = preact.float()
    sig = torch.sigmoid(z)
    return (dy.float() * sig * (1.0 + z * (1.0 - sig))).to(dy.dtype)  # rounded like the kernel


def _forward_ref(x, weight, bias=None, activation="none", *, save_preact=False):
    z = torch.matmul(x.float(), weight.float().t())
    if bias is not None:
        z += bias.float()
    preact = z.to(x.dtype) if save_preact and activation != "none" else None
    return _act(z, activation).to(x.dtype), preact


def _grad_input_ref(dy, weight, preact=None, activation="none"):
    return (_grad_preact_ref(dy, preact, activation).float() @ weight.float()).to(dy.dtype)


def _grad_weight_ref(dy, x, preact=None, activation="none", *, bias_grad=False, main_grad=None):
    dz = _grad_preact_ref(dy, preact, activation).float()
    db = dz.sum(0).to(dy.dtype) if bias_grad else None
    if main_grad is not None:
        return main_grad.addmm_(dz.t(), x.float()), db
    return (dz.t() @ x.float()).to(x.dtype), db


_OPS = {True: (linear_forward, linear_grad_input, linear_grad_weight),
        False: (_forward_ref, _grad_input_ref, _grad_weight_ref)}


# ------------------------------------------------------------------------- autograd
class _LinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2d, weight, bias, activation, main_grad, use_triton):
        forward_op = _OPS[use_triton][0]
        y, preact = forward_op(x2d, weight, bias, activation, save_preact=any(ctx.needs_input_grad[:3]))
        ctx.save_for_backward(x2d, weight, preact)
        ctx.activation, ctx.main_grad, ctx.use_triton = activation, main_grad, use_triton
        return y

    @staticmethod
    def backward(ctx, grad_out):
        x2d, weight, preact = ctx.saved_tensors
        _, grad_input_op, grad_weight_op = _OPS[ctx.use_triton]
        dy = grad_out.reshape(-1, weight.shape[0])  # (M, N)
        if dy.shape[1] > 1 and dy.stride(1) != 1:  # e.g. the expanded grad of a .sum()
            dy = dy.contiguous()
        want_dx, want_dw, want_db = ctx.needs_input_grad[:3]
        dx = dw = db = None
        if want_dx:
            dx = grad_input_op(dy, weight, preact, ctx.activation)
        if want_dw or want_db:  # a frozen weight with a trainable bias still runs the GEMM
            main_grad = ctx.main_grad if want_dw else None
            dw, db = grad_weight_op(dy, x2d, preact, ctx.activation, bias_grad=want_db, main_grad=main_grad)
            if main_grad is not None or not want_dw:
                dw = None  # in main_grad already (autograd must not add it to .grad too), or unwanted
        return dx, dw, db, None, None, None


def linear(x, weight, bias=None, activation="none", main_grad=None, backend="auto"):
    """``y = act(x W^T + b)``, differentiable: x (..., K), weight (N, K), bias (N,) -> (..., N).

    activation: "none" or "silu". main_grad: optional fp32 (N, K) buffer; if given, the
    backward adds dW into it in place and gives the weight no .grad. backend: "auto"
    (Triton for CUDA tensors, reference for CPU), "triton" or "torch".
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}: expected one of {BACKENDS}")
    _check_activation(activation)
    if not isinstance(x, torch.Tensor) or x.dim() < 1:
        raise ValueError(f"x must be a tensor of shape (..., in_features), got {getattr(x, 'shape', type(x))}")
    _check_weight(weight, x.shape[-1])
    x2d = x.reshape(-1, x.shape[-1])  # (M, K), M = prod(leading dims); autograd undoes the view
    if x2d.shape[1] > 1 and x2d.stride(1) != 1:
        x2d = x2d.contiguous()
    _check_linear(x2d, weight, bias)
    _check_main_grad(main_grad, weight.shape, weight.device)
    use_triton = backend == "triton" or (backend == "auto" and x.is_cuda)
    if use_triton and not x.is_cuda and not _INTERPRETED:
        raise ValueError("backend='triton' on CPU tensors needs TRITON_INTERPRET=1 in the environment "
                         "before triton is first imported; use backend='auto' or 'torch' otherwise")
    y = _LinearFunction.apply(x2d, weight, bias, activation, main_grad, use_triton)  # (M, N)
    return y.view(*x.shape[:-1], weight.shape[0])


def autotune_linear(m, n, k, dtype, device, *, bias=False, activation="none", fuse_main_grad=False,
                    kinds=KERNEL_KINDS) -> dict:
    """Benchmark candidate tiles for this layer's GEMMs (x (m, k), W (n, k)) on a CUDA
    device and record the fastest in the table that `tuned_configs()` exports.

    Returns ``{kind: TileConfig}``. On a non-CUDA device nothing is timed or recorded and
    the heuristic configs are returned.
    """
    device = torch.device(device)
    x = torch.randn(m, k, dtype=dtype, device=device)
    w = torch.randn(n, k, dtype=dtype, device=device) * k**-0.5
    b = torch.randn(n, dtype=dtype, device=device) if bias else None
    dy = torch.randn(m, n, dtype=dtype, device=device)
    preact = torch.randn(m, n, dtype=dtype, device=device) if activation != "none" else None
    main_grad = torch.zeros(n, k, dtype=torch.float32, device=device) if fuse_main_grad else None
    launches = {  # kind -> (GEMM M, N, K as _gemm keys them, launch)
        "fwd": ((m, n, k), lambda c: linear_forward(x, w, b, activation, save_preact=True, config=c)),
        "dgrad": ((m, k, n), lambda c: linear_grad_input(dy, w, preact, activation, config=c)),
        "wgrad": ((n, k, m), lambda c: linear_grad_weight(dy, x, preact, activation, bias_grad=bias,
                                                          main_grad=main_grad, config=c)),
    }
    return {kind: autotune(kind, dtype, *launches[kind][0], launches[kind][1], device) for kind in kinds}
