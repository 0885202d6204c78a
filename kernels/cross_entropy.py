"""The local part of a vocabulary-parallel cross-entropy, fused in Triton.

A rank holds logits Z (N, v): v columns of the vocabulary, the first ``n_valid`` real
(the rest pad the vocabulary to a multiple of tp and are ignored), and for each row a
target column ``t`` in local numbering (outside [0, n_valid) when another rank owns it).

    stats   one pass over each row, online softmax:
            m_i = max_j Z_ij,  s_i = sum_j exp(Z_ij - m_i),  z_i = Z_i,t_i (0 if not mine)
    grad    one pass:  G_ij = (exp(Z_ij - M_i) / S_i - [j == t_i]) * c_i   (0 on padding)
            with the global max M and sum S (after the collectives) and the upstream
            gradient c of each row's loss. A row with c = 0 (a target that is not
            trained on, ``ignore_index``) is a zero row: the kernel reads none of its
            logits; the reference multiplies by the 0.

Nothing here communicates: ``parallel3d.tensor_parallel.cross_entropy`` runs ``stats``,
combines (m, s, z) over the tp ranks and saves Z; its backward runs ``grad``. Neither
pass allocates anything of size (N, v) but the gradient itself: the softmax is never
stored. Arithmetic is fp32 whatever the logits' dtype; the gradient comes back in it.

Dispatch: ``backend`` "auto" runs Triton on CUDA tensors and the torch reference
(``*_ref``) on CPU, "triton" forces the kernels (on CPU under ``TRITON_INTERPRET=1``
set before triton is imported), "torch" the reference. The two Triton passes are torch
custom ops (``torch.ops.parallel3d.ce_local_stats`` / ``ce_local_grad``, with fake
implementations), so ``torch.compile`` and checkpointing policies see each as one op.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
    _jit = triton.jit
except ImportError:  # pragma: no cover - the torch reference still works without triton
    triton = tl = None

    def _jit(fn):
        return fn

from ._backend import use_triton

__all__ = ["ce_local_stats", "ce_local_grad", "ce_local_stats_ref", "ce_local_grad_ref"]



@_jit
def _stats_kernel(z_ptr, t_ptr, m_ptr, s_ptr, zt_ptr, n_valid, stride_row, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = z_ptr + row * stride_row
    cols = tl.arange(0, BLOCK_V)
    # Per-lane online softmax: lane k sees columns k, k + BLOCK_V, ...
    m = tl.full([BLOCK_V], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK_V], tl.float32)
    for start in range(0, n_valid, BLOCK_V):
        mask = start + cols < n_valid
        z = tl.load(base + start + cols, mask=mask, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, z)
        shift = tl.where(m_new > float("-inf"), m_new, 0.0)  # no -inf - -inf = nan
        s = s * tl.exp(m - shift) + tl.exp(z - shift)
        m = m_new
    m_row = tl.max(m, axis=0)
    shift_row = tl.where(m_row > float("-inf"), m_row, 0.0)
    s_row = tl.sum(s * tl.exp(m - shift_row), axis=0)
    t = tl.load(t_ptr + row)
    mine = (t >= 0) & (t < n_valid)
    zt = tl.load(base + tl.where(mine, t, 0), mask=mine, other=0.0).to(tl.float32)
    tl.store(m_ptr + row, m_row)
    tl.store(s_ptr + row, s_row)
    tl.store(zt_ptr + row, zt)


@_jit
def _grad_kernel(z_ptr, g_ptr, t_ptr, m_ptr, s_ptr, c_ptr, n_valid, n_cols, stride_z, stride_g,
                 BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_V)
    m = tl.load(m_ptr + row)
    inv_s = 1.0 / tl.load(s_ptr + row)
    c = tl.load(c_ptr + row).to(tl.float32)
    t = tl.load(t_ptr + row)
    n_read = tl.where(c != 0.0, n_valid, 0)  # a row with c = 0 reads no logit
    for start in range(0, n_cols, BLOCK_V):
        j = start + cols
        # padding columns, and every column of a row with c = 0, read as -inf: p = 0
        z = tl.load(z_ptr + row * stride_z + j, mask=j < n_read, other=float("-inf")).to(tl.float32)
        p = tl.exp(z - m) * inv_s
        g = (p - tl.where((j == t) & (t < n_valid), 1.0, 0.0)) * c
        tl.store(g_ptr + row * stride_g + j, g.to(g_ptr.dtype.element_ty), mask=j < n_cols)


# The kernel object says whether triton was imported under the interpreter.
_INTERPRETED = type(_stats_kernel).__name__ == "InterpretedFunction"


def _block(v: int) -> int:
    return min(4096, max(16, triton.next_power_of_2(max(v, 1)))) if not _INTERPRETED else 64


def _use_triton(z: torch.Tensor, backend: str) -> bool:
    return use_triton(z, backend, _INTERPRETED)


def _check(z: torch.Tensor, target: torch.Tensor, n_valid: int) -> None:
    if z.dim() != 2 or (z.shape[1] > 1 and z.stride(1) != 1):
        raise ValueError(f"logits must be (N, v) with contiguous rows, got {tuple(z.shape)} "
                         f"strides {z.stride()}")
    if z.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"logits are {z.dtype}: use float32, bfloat16 or float16")
    if target.shape != (z.shape[0],) or target.dtype != torch.int64:
        raise ValueError(f"target must be int64 of shape ({z.shape[0]},), got {target.dtype} "
                         f"{tuple(target.shape)}")
    if not 0 <= n_valid <= z.shape[1]:
        raise ValueError(f"n_valid {n_valid} outside [0, {z.shape[1]}]")


# -------------------------------------------------------------------------- launchers
def ce_local_stats(z: torch.Tensor, target: torch.Tensor, n_valid: int, backend: str = "auto"):
    """(m, s, z_t), each fp32 (N,): row max and sum of exp(z - m) over the first
    ``n_valid`` columns, and the logit of the target column (0 where not in them)."""
    _check(z, target, n_valid)
    if not _use_triton(z, backend):
        return ce_local_stats_ref(z, target, n_valid)
    return torch.ops.parallel3d.ce_local_stats(z, target, n_valid)


def ce_local_grad(z: torch.Tensor, target: torch.Tensor, n_valid: int, m: torch.Tensor,
                  s: torch.Tensor, scale: torch.Tensor, backend: str = "auto",
                  inplace: bool = False) -> torch.Tensor:
    """(N, v) in z's dtype: ``(exp(z - m) / s - onehot(target)) * scale`` per row on the
    first ``n_valid`` columns, 0 on the rest. m, s, scale: (N,). ``inplace``: written over
    ``z`` itself (each block of a row is read before it is written), so the loss's backward
    allocates no (N, v) buffer: the logits are not read again once their gradient exists."""
    _check(z, target, n_valid)
    if not _use_triton(z, backend):
        return ce_local_grad_ref(z, target, n_valid, m, s, scale, out=z if inplace else None)
    scale = scale.expand(z.shape[0]).contiguous()  # the expanded grad of a mean
    if inplace:
        torch.ops.parallel3d.ce_local_grad_into(z, z, target, n_valid, m, s, scale)
        return z
    return torch.ops.parallel3d.ce_local_grad(z, target, n_valid, m, s, scale)


# --------------------------------------------------- the Triton passes as custom ops
@torch.library.custom_op("parallel3d::ce_local_stats", mutates_args=())
def _stats_op(z: torch.Tensor, target: torch.Tensor, n_valid: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    n = z.shape[0]
    m, s, zt = (torch.empty(n, dtype=torch.float32, device=z.device) for _ in range(3))
    if n:
        _stats_kernel[(n,)](z, target, m, s, zt, n_valid, z.stride(0), BLOCK_V=_block(n_valid))
    return m, s, zt


@torch.library.custom_op("parallel3d::ce_local_grad", mutates_args=())
def _grad_op(z: torch.Tensor, target: torch.Tensor, n_valid: int, m: torch.Tensor, s: torch.Tensor,
             scale: torch.Tensor) -> torch.Tensor:
    g = torch.empty_like(z, memory_format=torch.contiguous_format)
    if z.shape[0] and z.shape[1]:
        _grad_kernel[(z.shape[0],)](z, g, target, m, s, scale, n_valid, z.shape[1], z.stride(0),
                                    g.stride(0), BLOCK_V=_block(z.shape[1]))
    return g


@torch.library.custom_op("parallel3d::ce_local_grad_into", mutates_args=("g",))
def _grad_into_op(z: torch.Tensor, g: torch.Tensor, target: torch.Tensor, n_valid: int, m: torch.Tensor,
                  s: torch.Tensor, scale: torch.Tensor) -> None:
    """:func:`_grad_op` into ``g``, which may be ``z`` (each program reads a block of its row
    before writing that block)."""
    if z.shape[0] and z.shape[1]:
        _grad_kernel[(z.shape[0],)](z, g, target, m, s, scale, n_valid, z.shape[1], z.stride(0),
                                    g.stride(0), BLOCK_V=_block(z.shape[1]))


@_stats_op.register_fake
def _(z, target, n_valid):
    return tuple(z.new_empty(z.shape[0], dtype=torch.float32) for _ in range(3))


@_grad_op.register_fake
def _(z, target, n_valid, m, s, scale):
    return torch.empty_like(z, memory_format=torch.contiguous_format)


# ---------------------------------------------------------------------- torch reference
# The reference works on runs of rows whose fp32 copy is at most this size, so that no
# temporary of the logits' size exists (the fused kernels hold one row block at a time):
# the loss adds O(rows) to what the logits themselves take, whatever the vocabulary.
REF_BLOCK_BYTES = 8 * 2**20


def _row_blocks(z: torch.Tensor, n_valid: int):
    rows = max(1, REF_BLOCK_BYTES // (4 * max(n_valid, 1)))
    return [slice(i, min(i + rows, z.shape[0])) for i in range(0, z.shape[0], rows)]


def ce_local_stats_ref(z: torch.Tensor, target: torch.Tensor, n_valid: int):
    n = z.shape[0]
    if n_valid == 0:
        m = torch.full((n,), float("-inf"), device=z.device)
        return m, torch.zeros(n, device=z.device), torch.zeros(n, device=z.device)
    m, s, zt = (torch.empty(n, dtype=torch.float32, device=z.device) for _ in range(3))
    for rows in _row_blocks(z, n_valid):
        zv = z[rows, :n_valid].float()  # (rows, n_valid); a view when z is fp32
        m[rows] = zv.max(dim=-1).values
        s[rows] = (zv - m[rows].unsqueeze(1)).exp_().sum(dim=-1)
        zt[rows] = zv.gather(1, target[rows].clamp(0, n_valid - 1).unsqueeze(1)).squeeze(1)
    mine = (target >= 0) & (target < n_valid)
    return m, s, zt.masked_fill(~mine, 0.0)


def ce_local_grad_ref(z, target, n_valid, m, s, scale, out=None):
    """Row block by row block in fp32, each rounded to z's dtype once into ``out`` (a new
    tensor, or z itself: a block is read before it is written)."""
    out = torch.empty_like(z) if out is None else out
    out[:, n_valid:] = 0
    scale = scale.float().expand(z.shape[0])
    for rows in _row_blocks(z, n_valid) if n_valid else []:
        p = z[rows, :n_valid].to(torch.float32, copy=True).sub_(m[rows].unsqueeze(1))
        p.exp_().div_(s[rows].unsqueeze(1))
        t = target[rows]
        mine = (t >= 0) & (t < n_valid)
        p.scatter_add_(1, t.clamp(0, n_valid - 1).unsqueeze(1), -mine.float().unsqueeze(1))
        p.mul_(scale[rows].reshape(-1, 1))
        out[rows, :n_valid] = p
    return out
