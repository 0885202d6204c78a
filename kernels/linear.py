"""Fused linear-layer GEMMs in Triton: ``Y = X W^T + b`` and its two backward GEMMs.

Shapes: X (M, K) (the layer flattens its leading dims); W (N, K) is the nn.Linear layout of
one column- or row-parallel shard; b (N,); Y (M, N). Inputs are fp32, bf16 or fp16 (all
the same dtype); every GEMM accumulates in fp32 and rounds once to the input dtype.

    forward  Y  = X W^T + b     (M, N)  "fwd"; the bias added in the epilogue
    backward dX = dY W          (M, K)  "dgrad"
             dW = dY^T X        (N, K)  "wgrad"; db = sum over rows of dY in the same K loop

Gradient-accumulation fusion: with ``main_grad`` (fp32, shape of W) the wgrad epilogue
does ``main_grad += dY^T X`` from its fp32 accumulator, in place: micro-batches sum into
one fp32 buffer with no bf16 rounding of dW and no extra pass.

Here: the kernel, its host launchers (which check inputs and build the grid), the
launchers as torch custom ops with fake implementations (``torch.ops.parallel3d.
linear_fwd`` with its autograd registered, ``linear_dgrad``, ``linear_wgrad``,
``linear_wgrad_into``), so activation-checkpointing policies and ``torch.compile`` see each
GEMM as one op, and the pure-torch reference ``linear_ref``. Which GEMM runs where
(Triton or torch, per call) and the differentiable ``linear`` are in ``kernels/gemm.py``.

On CPU the kernel runs only under ``TRITON_INTERPRET=1`` set before triton is imported;
without triton installed this module still imports (the torch path needs nothing here).

Tile configs (see _matmul_common): tuned if `autotune_linear` ran or a table was loaded,
else a shape-only heuristic. Tuned entries are keyed on (kind, dtype, M, N, K) only, so
tune with the bias/main_grad options the layer really uses. To make every rank run the
same tiles::

    if rank == 0:
        autotune_linear(m, n, k, torch.bfloat16, "cuda")
    table = [tuned_configs()]
    torch.distributed.broadcast_object_list(table, src=0)
    load_tuned_configs(table[0])
"""
from __future__ import annotations

from typing import Optional

import torch

try:
    import triton
    import triton.language as tl
    _jit = triton.jit
except ImportError:  # pragma: no cover - the torch GEMMs still work without triton
    triton = tl = None

    def _jit(fn):
        return fn

from ._matmul_common import (KERNEL_KINDS, TileConfig, autotune, clear_tuned_configs, load_tuned_configs,
                             select_config, tuned_configs)

__all__ = ["linear_ref", "linear_forward", "linear_grad_input", "linear_grad_weight", "autotune_linear",
           "tuned_configs", "load_tuned_configs", "clear_tuned_configs", "TileConfig"]

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@_jit
def _gemm_kernel(a_ptr, b_ptr, c_ptr, bias_ptr, rowsum_ptr, M, N, K,
                 stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
                 HAS_BIAS: tl.constexpr, ACCUMULATE: tl.constexpr, ROW_SUM_A: tl.constexpr,
                 FP32_IEEE: tl.constexpr, INT64: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    """C[M, N] (+)= A[M, K] @ B[K, N] (+ bias[n]), all operands strided.

    ROW_SUM_A:  rowsum[m] = sum_k A[m, k], stored by pid_n == 0 (the bias gradient).
    ACCUMULATE: C is fp32 and read back: C += A @ B (the main-grad accumulation).
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
    a_ptrs = a_ptr + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    rowsum = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - k * BLOCK_K
        a = tl.load(a_ptrs, mask=mask_m[:, None] & (offs_k[None, :] < k_left), other=0.0)
        if ROW_SUM_A:
            rowsum += tl.sum(a.to(tl.float32), axis=1)
        b = tl.load(b_ptrs, mask=(offs_k[:, None] < k_left) & mask_n[None, :], other=0.0)
        if FP32_IEEE:  # fp32 means fp32: TF32 would lose 13 mantissa bits vs. the reference
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk

    c_offs = offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn
    c_mask = mask_m[:, None] & mask_n[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
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


def _gemm(kind, a, b, c, *, bias=None, rowsum=None, accumulate=False, config=None):
    """Launch C (+)= A @ B (views with any strides; see _gemm_kernel for the options)."""
    m, k = a.shape
    n = b.shape[1]
    if m == 0 or n == 0:
        return
    extras = bias is not None or rowsum is not None or accumulate
    cfg = config or select_config(kind, b.dtype, m, n, k, interpreted=_INTERPRETED, fused_extras=extras)
    int64 = max(_max_offset(t) for t in (a, b, c)) >= 2**31 - 1
    grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n),)
    _gemm_kernel[grid](
        a, b, c, c if bias is None else bias, c if rowsum is None else rowsum, m, n, k,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), c.stride(0), c.stride(1),
        HAS_BIAS=bias is not None, ACCUMULATE=accumulate, ROW_SUM_A=rowsum is not None,
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


def _check_grad(dy, other, rows=None, cols=None):
    """dy (rows, cols) must match `other` in dtype and device."""
    _check_matrix(other, "input")
    _check_dtype(other, "input")
    _check_matrix(dy, "grad_output", rows, cols, dtype=other.dtype, device=other.device)


# ------------------------------------------------------------------- Triton launchers
def linear_forward(x, weight, bias=None, *, config=None):
    """Triton ``x W^T + b``: x (M, K), weight (N, K), bias (N,) -> (M, N) in x's dtype."""
    _check_linear(x, weight, bias)
    y = torch.empty((x.shape[0], weight.shape[0]), dtype=x.dtype, device=x.device)
    _gemm("fwd", x, weight.t(), y, bias=bias, config=config)
    return y


def linear_grad_input(dy, weight, *, config=None):
    """Triton ``dX = dy W``: dy (M, N), weight (N, K) -> (M, K)."""
    _check_grad(dy, weight, cols=weight.shape[0])
    dx = torch.empty((dy.shape[0], weight.shape[1]), dtype=dy.dtype, device=dy.device)
    _gemm("dgrad", dy, weight, dx, config=config)
    return dx


def linear_grad_weight(dy, x, *, bias_grad=False, main_grad=None, config=None):
    """Triton ``dW = dy^T x`` (N, K) and ``db = sum_rows dy`` (N,): dy (M, N), x (M, K).

    With ``main_grad`` (fp32, (N, K), contiguous) computes ``main_grad += dy^T x`` in
    place and returns it instead of a new dW. Returns ``(dW or main_grad, db or None)``.
    """
    _check_grad(dy, x, rows=x.shape[0])
    n, k = dy.shape[1], x.shape[1]
    _check_main_grad(main_grad, (n, k), x.device)
    dw = main_grad if main_grad is not None else torch.empty((n, k), dtype=x.dtype, device=x.device)
    db = torch.empty((n,), dtype=dy.dtype, device=dy.device) if bias_grad else None
    _gemm("wgrad", dy.t(), x, dw, rowsum=db, accumulate=main_grad is not None, config=config)
    return dw, db


# ------------------------------------------------- the Triton GEMMs as torch custom ops
@torch.library.custom_op("parallel3d::linear_fwd", mutates_args=())
def _fwd_op(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    return linear_forward(x, weight, bias)


@torch.library.custom_op("parallel3d::linear_dgrad", mutates_args=())
def _dgrad_op(dy: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return linear_grad_input(dy, weight)


@torch.library.custom_op("parallel3d::linear_wgrad", mutates_args=())
def _wgrad_op(dy: torch.Tensor, x: torch.Tensor, bias_grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(dW, db); db is an empty (0,) tensor when not ``bias_grad`` (an op returns tensors)."""
    dw, db = linear_grad_weight(dy, x, bias_grad=bias_grad)
    return dw, db if db is not None else dy.new_empty(0)


@torch.library.custom_op("parallel3d::linear_wgrad_into", mutates_args=("main_grad",))
def _wgrad_into_op(dy: torch.Tensor, x: torch.Tensor, main_grad: torch.Tensor, bias_grad: bool) -> torch.Tensor:
    """main_grad += dy^T x; returns db, or an empty (0,) tensor when not ``bias_grad``."""
    _, db = linear_grad_weight(dy, x, bias_grad=bias_grad, main_grad=main_grad)
    return db if db is not None else dy.new_empty(0)


@_fwd_op.register_fake
def _(x, weight, bias):
    return x.new_empty((x.shape[0], weight.shape[0]))


@_dgrad_op.register_fake
def _(dy, weight):
    return dy.new_empty((dy.shape[0], weight.shape[1]))


@_wgrad_op.register_fake
def _(dy, x, bias_grad):
    return x.new_empty((dy.shape[1], x.shape[1])), dy.new_empty(dy.shape[1] if bias_grad else 0)


@_wgrad_into_op.register_fake
def _(dy, x, main_grad, bias_grad):
    return dy.new_empty(dy.shape[1] if bias_grad else 0)


def _fwd_op_setup(ctx, inputs, output):
    x, weight, bias = inputs
    ctx.save_for_backward(x, weight)
    ctx.has_bias = bias is not None


def _fwd_op_backward(ctx, dy):
    x, weight = ctx.saved_tensors
    want_dx, want_dw, want_db = ctx.needs_input_grad[:3]
    dy = dy.contiguous()
    dx = _dgrad_op(dy, weight) if want_dx else None
    dw = db = None
    if want_dw or (want_db and ctx.has_bias):
        dw, db = _wgrad_op(dy, x, bool(want_db and ctx.has_bias))
        dw, db = (dw if want_dw else None), (db if want_db and ctx.has_bias else None)
    return dx, dw, db


torch.library.register_autograd("parallel3d::linear_fwd", _fwd_op_backward, setup_context=_fwd_op_setup)


# ------------------------------------------------------------ pure-torch reference
def linear_ref(x, weight, bias=None):
    """Reference ``x W^T + b`` computed in fp32 and rounded once to x's dtype.

    Plain differentiable torch ops on any leading shape; the tests take its autograd
    gradients as the ground truth.
    """
    z = torch.matmul(x.float(), weight.float().t())
    if bias is not None:
        z = z + bias.float()
    return z.to(x.dtype)


def autotune_linear(m, n, k, dtype, device, *, bias=False, fuse_main_grad=False, kinds=KERNEL_KINDS) -> dict:
    """Benchmark candidate tiles for this layer's GEMMs (x (m, k), W (n, k)) on a CUDA
    device and record the fastest in the table that `tuned_configs()` exports.

    Returns ``{kind: TileConfig}``. On a non-CUDA device nothing is timed or recorded and
    the heuristic configs are returned.
    """
    x, w, dy = example_operands(m, n, k, dtype, device)
    b = torch.randn(n, dtype=dtype, device=device) if bias else None
    main_grad = torch.zeros(n, k, dtype=torch.float32, device=device) if fuse_main_grad else None
    launches = {  # kind -> (GEMM M, N, K as _gemm keys them, launch)
        "fwd": ((m, n, k), lambda c: linear_forward(x, w, b, config=c)),
        "dgrad": ((m, k, n), lambda c: linear_grad_input(dy, w, config=c)),
        "wgrad": ((n, k, m), lambda c: linear_grad_weight(dy, x, bias_grad=bias, main_grad=main_grad, config=c)),
    }
    return {kind: autotune(kind, dtype, *launches[kind][0], launches[kind][1], torch.device(device))
            for kind in kinds}


def example_operands(m, n, k, dtype, device):
    """Seeded random x (m, k), W (n, k) scaled by k**-0.5 and dy (m, n) for timing."""
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(m, k, dtype=dtype, device=device, generator=gen)
    w = torch.randn(n, k, dtype=dtype, device=device, generator=gen) * k**-0.5
    return x, w, torch.randn(m, n, dtype=dtype, device=device, generator=gen)


