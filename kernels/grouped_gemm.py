"""Grouped GEMMs in Triton for Mixture-of-Experts experts: one launch for all experts.

The ``R`` routed rows are sorted by expert (group); group ``g`` owns rows
``[o_g, o_g + n_g)`` (``o`` the prefix sums of ``counts``, ``n_g = 0`` allowed) and the
weight ``w[g]`` of a stack ``w`` (G, N, K) in nn.Linear layout. Inputs are fp32, bf16 or
fp16 (all the same dtype); every GEMM accumulates in fp32 and rounds once to that dtype.

    forward  y[rows_g]  = x[rows_g] @ w[g]^T      x (R, K)  -> y (R, N)   "fwd"
    backward dx[rows_g] = dy[rows_g] @ w[g]       dy (R, N) -> dx (R, K)  "dgrad"
             dw[g]      = dy[rows_g]^T x[rows_g]  -> dw (G, N, K)         "wgrad" (0 for n_g = 0)

Two kernels. ``_rows_kernel`` (fwd, dgrad) walks a tile table made on the host from
``counts``: one entry per BLOCK_M-row tile of a group (its group, first row, end row), so
no program is spent on padding between groups and an empty group has no tiles; each
entry runs every BLOCK_N column tile of its group's output. ``_wgrad_kernel`` runs one
program per (group, BLOCK_M x BLOCK_N tile of dw[g]) and reduces over the group's rows,
whose bounds it reads from the offsets; an empty group stores zeros. Row indices times
strides switch to int64 when a tensor spans 2**31 elements.

Here: the kernels, their host launchers (which check inputs and build the grid), the
launchers as torch custom ops with fake implementations (``torch.ops.parallel3d.
grouped_mm_fwd`` with its autograd registered, ``grouped_mm_dgrad``, ``grouped_mm_wgrad``)
and the pure-torch reference ``grouped_mm_ref``. Which backend runs where (Triton,
``torch._grouped_mm``, a loop of torch GEMMs) and ``grouped_linear`` are in
``kernels/grouped_linear.py``.

On CPU the kernels run only under ``TRITON_INTERPRET=1`` set before triton is imported;
without triton installed this module still imports. Tiles: the shape-only heuristic of
``_matmul_common`` at the mean rows per non-empty group (every rank derives the same), or
an explicit ``config``.
"""
from __future__ import annotations

import functools

import numpy as np
import torch

try:
    import triton
    import triton.language as tl
    _jit = triton.jit
except ImportError:  # pragma: no cover - the torch backends still work without triton
    triton = tl = None

    def _jit(fn):
        return fn

from ._matmul_common import heuristic_config

__all__ = ["grouped_mm_ref", "grouped_forward", "grouped_grad_input", "grouped_grad_weight", "check_counts"]

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@_jit
def _rows_kernel(a_ptr, b_ptr, c_ptr, tiles_ptr, n_tiles, N, K,
                 stride_am, stride_ak, stride_bg, stride_bk, stride_bn, stride_cm, stride_cn,
                 FP32_IEEE: tl.constexpr, INT64: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    """C[r0:r1, :N] = A[r0:r1, :K] @ B_g[:K, :N] for each tile-table entry (g, r0, r1);
    B_g starts at b_ptr + g * stride_bg. tiles_ptr: int32 (3, n_tiles)."""
    pid = tl.program_id(0)
    # Grouped launch order over the table's row tiles, as in kernels/linear.py: GROUP_M
    # row tiles swept column by column share their B panels in L2 (mostly one group's).
    num_pid_n = tl.cdiv(N, BLOCK_N)
    group_size = GROUP_M * num_pid_n
    first_pid_m = (pid // group_size) * GROUP_M
    group_m = tl.minimum(n_tiles - first_pid_m, GROUP_M)
    pid_m = first_pid_m + (pid % group_size) % group_m
    pid_n = (pid % group_size) // group_m

    g = tl.load(tiles_ptr + pid_m)
    row0 = tl.load(tiles_ptr + n_tiles + pid_m)
    row_end = tl.load(tiles_ptr + 2 * n_tiles + pid_m)
    offs_m = row0 + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    if INT64:  # some tensor spans more than 2**31 elements: index products would wrap
        offs_m = offs_m.to(tl.int64)
        offs_n = offs_n.to(tl.int64)
        g = g.to(tl.int64)
    mask_m = offs_m < row_end
    mask_n = offs_n < N
    a_ptrs = a_ptr + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + g * stride_bg + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - k * BLOCK_K
        a = tl.load(a_ptrs, mask=mask_m[:, None] & (offs_k[None, :] < k_left), other=0.0)
        b = tl.load(b_ptrs, mask=(offs_k[:, None] < k_left) & mask_n[None, :], other=0.0)
        if FP32_IEEE:  # fp32 means fp32: TF32 would lose 13 mantissa bits vs. the reference
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    c_ptrs = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@_jit
def _wgrad_kernel(a_ptr, b_ptr, c_ptr, offs_ptr, M, N,
                  stride_ar, stride_am, stride_br, stride_bn, stride_cg, stride_cm, stride_cn,
                  FP32_IEEE: tl.constexpr, INT64: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """C_g[:M, :N] = A[o_g:o_g+1, :M]^T @ B[o_g:o_g+1, :N] summed over the group's rows
    (BLOCK_K rows a step); offs_ptr: int32 (G + 1,) row offsets. One program per
    (group, tile of C_g); an empty group stores zeros."""
    pid = tl.program_id(0)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    tiles = tl.cdiv(M, BLOCK_M) * num_pid_n
    g = pid // tiles
    pid_m = (pid % tiles) // num_pid_n
    pid_n = (pid % tiles) % num_pid_n
    row0 = tl.load(offs_ptr + g)
    row_end = tl.load(offs_ptr + g + 1)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_r = row0 + tl.arange(0, BLOCK_K)
    if INT64:
        offs_m = offs_m.to(tl.int64)
        offs_n = offs_n.to(tl.int64)
        offs_r = offs_r.to(tl.int64)
        g = g.to(tl.int64)
    mask_m = offs_m < M
    mask_n = offs_n < N
    a_ptrs = a_ptr + offs_m[:, None] * stride_am + offs_r[None, :] * stride_ar  # (BLOCK_M, BLOCK_K): A^T
    b_ptrs = b_ptr + offs_r[:, None] * stride_br + offs_n[None, :] * stride_bn  # (BLOCK_K, BLOCK_N)

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r in range(row0, row_end, BLOCK_K):
        r_left = row_end - r
        a = tl.load(a_ptrs, mask=mask_m[:, None] & (tl.arange(0, BLOCK_K)[None, :] < r_left), other=0.0)
        b = tl.load(b_ptrs, mask=(tl.arange(0, BLOCK_K)[:, None] < r_left) & mask_n[None, :], other=0.0)
        if FP32_IEEE:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K * stride_ar
        b_ptrs += BLOCK_K * stride_br
    c_ptrs = c_ptr + g * stride_cg + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


# The kernel object says whether triton was imported under the interpreter; the host code
# never reads TRITON_INTERPRET itself.
_INTERPRETED = type(_rows_kernel).__name__ == "InterpretedFunction"


def _max_offset(t: torch.Tensor) -> int:
    return sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()) if size > 0)


def _needs_int64(*tensors) -> bool:
    return max(_max_offset(t) for t in tensors) >= 2**31 - 1


def _to_device(table, device: torch.device) -> torch.Tensor:
    """``table`` (ints) as int32 on ``device``; to a GPU from pinned memory without blocking
    the host (a pageable copy would wait for the stream: a device sync inside the step)."""
    host = torch.as_tensor(table, dtype=torch.int32)
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def _row_tiles(counts: list[int], block_m: int) -> tuple[torch.Tensor, int]:
    """The tile table on the host, int32 (3 * T,): each tile's group, then first rows, then
    end rows; and T. numpy (torch's own dependency): 75 us for 256 tiles on a loaded CPU
    where torch's small ops took 400 and a Python loop 320; 0.3 ms against 9 at 8k tiles."""
    n = np.asarray(counts, dtype=np.int64)
    ends = np.cumsum(n)
    starts = ends - n
    tiles = -(-n // block_m)
    groups = np.repeat(np.arange(n.size), tiles)
    first_tile = np.cumsum(tiles) - tiles
    firsts = starts[groups] + (np.arange(groups.size) - first_tile[groups]) * block_m
    return torch.from_numpy(np.concatenate([groups, firsts, ends[groups]]).astype(np.int32)), int(groups.size)


@functools.lru_cache(maxsize=16)
def _cuda_tiles(counts: tuple, block_m: int, device: torch.device) -> tuple[torch.Tensor, int]:
    """The tile table on a GPU, made once per (counts, tile height): gate and up of a layer,
    and its dgrads, share it. Entries are read only."""
    table, n_tiles = _row_tiles(list(counts), block_m)
    return _to_device(table, device), n_tiles


def row_offsets(counts: list[int], device: torch.device, *, first: bool = True) -> torch.Tensor:
    """int32 prefix sums of ``counts`` on ``device``: (G + 1,) from 0, or without the 0 (the
    end rows, ``torch._grouped_mm``'s ``offs``); on a GPU made once per counts (cached)."""
    if device.type == "cuda":
        return _cuda_offsets(tuple(counts), first, device)
    return _to_device(np.cumsum([0] + list(counts))[0 if first else 1:], device)


@functools.lru_cache(maxsize=16)
def _cuda_offsets(counts: tuple, first: bool, device: torch.device) -> torch.Tensor:
    return _to_device(np.cumsum((0,) + counts)[0 if first else 1:], device)


def _mean_rows(counts: list[int]) -> int:
    busy = [n for n in counts if n > 0]
    return max(1, sum(busy) // max(1, len(busy)))


def _launch_rows(kind, a, w, c, counts, w_strides, config=None):
    """C[rows_g] = A[rows_g] @ B_g, B_g the (K, N) view of w[g] given by ``w_strides``
    (stride along K, stride along N)."""
    k, n = a.shape[1], c.shape[1]
    if a.shape[0] == 0 or n == 0:
        return
    cfg = config or heuristic_config(w.dtype, _mean_rows(counts), n, k, interpreted=_INTERPRETED)
    if a.is_cuda:
        table, n_tiles = _cuda_tiles(tuple(counts), cfg.block_m, a.device)
    else:
        table, n_tiles = _row_tiles(counts, cfg.block_m)
    grid = (n_tiles * triton.cdiv(n, cfg.block_n),)
    _rows_kernel[grid](
        a, w, c, table, n_tiles, n, k, a.stride(0), a.stride(1), w.stride(0),
        *w_strides, c.stride(0), c.stride(1), FP32_IEEE=w.dtype == torch.float32,
        INT64=_needs_int64(a, w, c), BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        GROUP_M=cfg.group_m, num_warps=cfg.num_warps, num_stages=cfg.num_stages)


# ----------------------------------------------------------------------------- checks
def check_counts(counts, groups: int, rows: int) -> list[int]:
    """``counts`` as a list of ``groups`` non-negative ints summing to ``rows``."""
    try:
        counts = [int(n) for n in counts]
    except (TypeError, ValueError):
        raise ValueError(f"counts must be a list of ints (rows per group), got {counts!r}") from None
    if len(counts) != groups or any(n < 0 for n in counts) or sum(counts) != rows:
        raise ValueError(f"counts {counts} must be {groups} non-negative row counts (one per expert) "
                         f"summing to the {rows} rows of x")
    if rows >= 2**31:
        raise ValueError(f"{rows} rows: the grouped GEMM indexes rows in int32; split the call below 2**31")
    return counts


def _check_2d(t, name, cols=None, dtype=None, device=None):
    if not isinstance(t, torch.Tensor) or t.dim() != 2:
        raise ValueError(f"{name} must be a 2-D tensor, got {getattr(t, 'shape', type(t))}")
    if cols is not None and t.shape[1] != cols:
        raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {cols} columns")
    if t.dtype not in _DTYPES:
        raise ValueError(f"{name} is {t.dtype}: use float32, bfloat16 or float16 (accumulation is fp32)")
    if dtype is not None and (t.dtype != dtype or t.device != device):
        raise ValueError(f"{name} is {t.dtype} on {t.device} but the weights are {dtype} on {device}")
    if t.shape[1] > 1 and t.stride(1) != 1:
        raise ValueError(f"{name} needs unit stride in its last dim (strides {t.stride()}): call .contiguous()")


def _check_weights(w):
    if not isinstance(w, torch.Tensor) or w.dim() != 3 or w.dtype not in _DTYPES:
        raise ValueError(f"weights must be a (groups, out_features, in_features) float32/bfloat16/float16 "
                         f"stack, got {getattr(w, 'dtype', type(w))} {tuple(getattr(w, 'shape', ()))}")
    if w.shape[2] > 1 and w.stride(2) != 1:
        raise ValueError(f"weights need unit stride in their last dim (strides {w.stride()}): call .contiguous()")


# ------------------------------------------------------------------- Triton launchers
def grouped_forward(x, w, counts, *, config=None):
    """Triton ``y[rows_g] = x[rows_g] w[g]^T``: x (R, K), w (G, N, K) -> (R, N)."""
    _check_weights(w)
    _check_2d(x, "x", w.shape[2], w.dtype, w.device)
    counts = check_counts(counts, w.shape[0], x.shape[0])
    y = torch.empty((x.shape[0], w.shape[1]), dtype=x.dtype, device=x.device)
    _launch_rows("fwd", x, w, y, counts, (w.stride(2), w.stride(1)), config)
    return y


def grouped_grad_input(dy, w, counts, *, config=None):
    """Triton ``dx[rows_g] = dy[rows_g] w[g]``: dy (R, N), w (G, N, K) -> (R, K)."""
    _check_weights(w)
    _check_2d(dy, "grad_output", w.shape[1], w.dtype, w.device)
    counts = check_counts(counts, w.shape[0], dy.shape[0])
    dx = torch.empty((dy.shape[0], w.shape[2]), dtype=dy.dtype, device=dy.device)
    _launch_rows("dgrad", dy, w, dx, counts, (w.stride(1), w.stride(2)), config)
    return dx


def grouped_grad_weight(dy, x, counts, *, config=None):
    """Triton ``dw[g] = dy[rows_g]^T x[rows_g]``: dy (R, N), x (R, K) -> (G, N, K); zero for
    an empty group."""
    _check_2d(x, "x")
    _check_2d(dy, "grad_output", dtype=x.dtype, device=x.device)
    if dy.shape[0] != x.shape[0]:
        raise ValueError(f"grad_output has {dy.shape[0]} rows but x has {x.shape[0]}")
    counts = check_counts(counts, len(counts) if isinstance(counts, (list, tuple)) else -1, x.shape[0])
    groups, n, k = len(counts), dy.shape[1], x.shape[1]
    if x.shape[0] == 0 or groups * n * k == 0:  # no rows: every group is empty, dW is 0
        return torch.zeros((groups, n, k), dtype=x.dtype, device=x.device)
    dw = torch.empty((groups, n, k), dtype=x.dtype, device=x.device)
    cfg = config or heuristic_config(x.dtype, n, k, _mean_rows(counts), interpreted=_INTERPRETED)
    grid = (groups * triton.cdiv(n, cfg.block_m) * triton.cdiv(k, cfg.block_n),)
    _wgrad_kernel[grid](
        dy, x, dw, row_offsets(counts, x.device), n, k, dy.stride(0), dy.stride(1), x.stride(0), x.stride(1),
        dw.stride(0), dw.stride(1), dw.stride(2), FP32_IEEE=x.dtype == torch.float32,
        INT64=_needs_int64(dy, x, dw), BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return dw


# ------------------------------------------------- the Triton GEMMs as torch custom ops
@torch.library.custom_op("parallel3d::grouped_mm_fwd", mutates_args=())
def _fwd_op(x: torch.Tensor, w: torch.Tensor, counts: list[int]) -> torch.Tensor:
    return grouped_forward(x, w, counts)


@torch.library.custom_op("parallel3d::grouped_mm_dgrad", mutates_args=())
def _dgrad_op(dy: torch.Tensor, w: torch.Tensor, counts: list[int]) -> torch.Tensor:
    return grouped_grad_input(dy, w, counts)


@torch.library.custom_op("parallel3d::grouped_mm_wgrad", mutates_args=())
def _wgrad_op(dy: torch.Tensor, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
    return grouped_grad_weight(dy, x, counts)


@_fwd_op.register_fake
def _(x, w, counts):
    return x.new_empty((x.shape[0], w.shape[1]))


@_dgrad_op.register_fake
def _(dy, w, counts):
    return dy.new_empty((dy.shape[0], w.shape[2]))


@_wgrad_op.register_fake
def _(dy, x, counts):
    return x.new_empty((len(counts), dy.shape[1], x.shape[1]))


def _fwd_op_setup(ctx, inputs, output):
    x, w, counts = inputs
    ctx.save_for_backward(x, w)
    ctx.counts = list(counts)


def _fwd_op_backward(ctx, dy):
    x, w = ctx.saved_tensors
    dy = dy.contiguous()
    dx = _dgrad_op(dy, w, ctx.counts) if ctx.needs_input_grad[0] else None
    dw = _wgrad_op(dy, x, ctx.counts) if ctx.needs_input_grad[1] else None
    return dx, dw, None


torch.library.register_autograd("parallel3d::grouped_mm_fwd", _fwd_op_backward, setup_context=_fwd_op_setup)


# ------------------------------------------------------------ pure-torch reference
def grouped_mm_ref(x, w, counts):
    """Reference ``y[rows_g] = x[rows_g] w[g]^T`` in fp32, rounded once to x's dtype.

    x (R, K), w (G, N, K) -> (R, N). Plain differentiable torch ops (a loop over groups);
    the tests take its autograd gradients (dx, and dw through the stack) as ground truth.
    """
    counts = check_counts(counts, w.shape[0], x.shape[0])
    parts = [rows.float() @ w[g].float().t() for g, rows in enumerate(x.split(counts))]
    y = torch.cat(parts) if parts else x.new_zeros((0, w.shape[1]), dtype=torch.float32)
    return y.to(x.dtype)
