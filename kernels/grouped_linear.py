"""The experts' grouped GEMMs, each sent to one of three backends, and the choice.

Rows sorted by expert, ``counts[g]`` rows for expert g (``kernels/grouped_gemm.py`` has
the math and shapes); w (G, N, K) stacked expert weights:

    fwd    y[rows_g]  = x[rows_g] w[g]^T     (R, N)
    dgrad  dx[rows_g] = dy[rows_g] w[g]      (R, K)
    wgrad  dw[g]      = dy[rows_g]^T x[rows_g]  (G, N, K)

Backends:

* "triton": ``kernels/grouped_gemm.py`` through ``torch.ops.parallel3d.grouped_mm_*`` (on
  CPU only under ``TRITON_INTERPRET=1``);
* "grouped_mm": ``torch._grouped_mm`` (CUTLASS on CUDA, where it takes bf16 only and wants
  N and K multiples of 8, i.e. 16-byte strides; on CPU torch's reference fallback, any
  dtype). Its output past ``offs[-1]`` is never read here: the offsets end at R;
* "loop": one torch GEMM per expert in the input dtype, what the MoE block ran before;
* "auto": "loop" on CPU. On CUDA, per GEMM kind, what :func:`pick_grouped_backend`
  measured faster for this GPU model, kind, dtype and (G, N, K) (Triton only if at least
  as fast); unmeasured: "grouped_mm" in bf16, "loop" otherwise. Nothing unmeasured runs
  Triton. The table is keyed without the row count R, which varies from step to step
  (routing; the all-to-all under expert parallelism): the choice measured at one R with
  balanced counts stands for every R. Ship it between ranks with
  ``grouped_backend_choices`` / ``load_grouped_backend_choices`` so every rank runs the
  same kernels.

:func:`grouped_mm` is differentiable in x and the stacked w; :func:`grouped_linear` takes
the experts' separate weights, stacks them (a copy, see there) and lets autograd hand each
expert's slice of dW to its own parameter. Not here yet: an fp32 ``main_grad`` epilogue
and deferral of dW to a zero-bubble W step (``kernels/deferred.py``): dW is computed in
the backward, as the loop did.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import grouped_gemm as _tg  # registers the torch.ops.parallel3d.grouped_mm_* ops
from ._matmul_common import _DTYPE_NAMES
from .gemm import _cuda_seconds, gpu_name

__all__ = ["grouped_linear", "grouped_mm", "run_grouped_gemm", "pick_grouped_backend", "measure_grouped_backends",
           "grouped_backend_choices", "load_grouped_backend_choices", "clear_grouped_backend_choices",
           "GROUPED_BACKENDS"]

GROUPED_BACKENDS = ("auto", "triton", "grouped_mm", "loop")
KINDS = ("fwd", "dgrad", "wgrad")
_ops = torch.ops.parallel3d
_CHOICES: dict[str, str] = {}  # "GPU name|kind:dtype:GxNxK" -> "triton" | "grouped_mm" | "loop"


def _check_backend(backend: str) -> None:
    if backend not in GROUPED_BACKENDS:
        raise ValueError(f"grouped GEMM backend {backend!r}: expected one of {GROUPED_BACKENDS}")


def choice_key(device_name: str, kind: str, dtype: torch.dtype, groups: int, n: int, k: int) -> str:
    """The table key, e.g. ``"NVIDIA H200|wgrad:bfloat16:8x1536x4096"`` (G x N x K of w)."""
    if not device_name or "|" in device_name or kind not in KINDS or dtype not in _DTYPE_NAMES:
        raise ValueError(f"grouped choice key ({device_name!r}, {kind!r}, {dtype}): expected a GPU name "
                         f"without '|', a kind of {KINDS} and a dtype of {list(_DTYPE_NAMES)}")
    return f"{device_name}|{kind}:{_DTYPE_NAMES[dtype]}:{groups}x{n}x{k}"


def _grouped_mm_takes(dtype: torch.dtype, n: int, k: int) -> bool:
    """torch._grouped_mm (2.13) wants every operand's row stride a multiple of 16 bytes."""
    size = torch.empty((), dtype=dtype).element_size()
    return hasattr(torch, "_grouped_mm") and (n * size) % 16 == 0 and (k * size) % 16 == 0


def _torch_side(dtype: torch.dtype, n: int, k: int) -> str:
    """What Triton is measured against on CUDA: torch._grouped_mm where it takes the operands."""
    return "grouped_mm" if dtype == torch.bfloat16 and _grouped_mm_takes(dtype, n, k) else "loop"


def auto_backend(kind: str, t: torch.Tensor, groups: int, n: int, k: int) -> str:
    """The backend "auto" runs for this GEMM (module docstring)."""
    if not t.is_cuda:
        return "loop"
    chosen = _CHOICES.get(choice_key(gpu_name(t.device), kind, t.dtype, groups, n, k))
    return chosen or _torch_side(t.dtype, n, k)


def _resolve(backend: str, kind: str, t: torch.Tensor, w_shape) -> str:
    groups, n, k = w_shape
    if backend == "auto":
        return auto_backend(kind, t, groups, n, k)
    if backend == "triton":
        if _tg.triton is None:
            raise ValueError("grouped GEMM backend 'triton' needs triton installed (pip install triton)")
        if not t.is_cuda and not _tg._INTERPRETED:
            raise ValueError("backend='triton' on CPU tensors needs TRITON_INTERPRET=1 in the environment "
                             "before triton is first imported; use backend='auto' or 'loop' otherwise")
    if backend == "grouped_mm":
        if not hasattr(torch, "_grouped_mm"):
            raise ValueError(f"backend='grouped_mm' needs torch._grouped_mm (torch >= 2.8), not in {torch.__version__}")
        if not _grouped_mm_takes(t.dtype, n, k):
            raise ValueError(f"backend='grouped_mm' needs out and in features of 16 bytes' multiples, got "
                             f"{n} x {k} in {t.dtype}: use 'triton' or 'loop'")
        if t.is_cuda and t.dtype != torch.bfloat16:
            raise ValueError(f"backend='grouped_mm' on CUDA takes bfloat16 only, got {t.dtype}: use 'triton' or 'loop'")
    return backend


def run_grouped_gemm(kind: str, a: torch.Tensor, b: torch.Tensor, counts: list[int], backend: str) -> torch.Tensor:
    """One grouped GEMM without autograd: ("fwd", x, w), ("dgrad", dy, w) or ("wgrad", dy, x),
    shapes as in the module docstring; ``backend`` one of GROUPED_BACKENDS."""
    groups = len(counts)
    w_shape = tuple(b.shape) if kind != "wgrad" else (groups, a.shape[1], b.shape[1])
    chosen = _resolve(backend, kind, a, w_shape)
    if chosen == "triton":
        op = {"fwd": _ops.grouped_mm_fwd, "dgrad": _ops.grouped_mm_dgrad, "wgrad": _ops.grouped_mm_wgrad}[kind]
        return op(a.contiguous(), b.contiguous(), counts)
    if chosen == "grouped_mm":
        if a.shape[0] == 0:  # no rows at all: _grouped_mm refuses a zero-length jagged dim
            return run_grouped_gemm(kind, a, b, counts, "loop")
        offs = _tg.row_offsets(counts, a.device, first=False)
        if kind == "fwd":
            return torch._grouped_mm(a, b.transpose(-2, -1), offs=offs)
        if kind == "dgrad":
            return torch._grouped_mm(a, b, offs=offs)
        return torch._grouped_mm(a.t(), b, offs=offs)
    parts_a = a.split(counts)
    if kind == "wgrad":
        parts_b = b.split(counts)
        return torch.stack([pa.t() @ pb for pa, pb in zip(parts_a, parts_b)])
    if kind == "fwd":
        outs = [F.linear(rows, b[g]) for g, rows in enumerate(parts_a)]
    else:
        outs = [rows @ b[g] for g, rows in enumerate(parts_a)]
    return torch.cat(outs) if outs else a.new_empty((0, w_shape[1] if kind == "fwd" else w_shape[2]))


class _GroupedFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, counts, backend):
        ctx.save_for_backward(x, w)
        ctx.counts, ctx.backend = counts, backend
        return run_grouped_gemm("fwd", x, w, counts, backend)

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        dy = dy.contiguous()
        dx = run_grouped_gemm("dgrad", dy, w, ctx.counts, ctx.backend) if ctx.needs_input_grad[0] else None
        dw = run_grouped_gemm("wgrad", dy, x, ctx.counts, ctx.backend) if ctx.needs_input_grad[1] else None
        return dx, dw, None, None


def grouped_mm(x: torch.Tensor, w: torch.Tensor, counts, backend: str = "auto") -> torch.Tensor:
    """Differentiable ``y[rows_g] = x[rows_g] w[g]^T``: x (R, K) rows sorted by group,
    w (G, N, K), ``counts`` G ints summing to R -> y (R, N) in x's dtype (in the autocast
    dtype inside an autocast region, as F.linear)."""
    _check_backend(backend)
    if isinstance(x, torch.Tensor) and torch.is_autocast_enabled(x.device.type):
        # as F.linear under autocast: both operands in the autocast dtype (the Function
        # runs its GEMMs on what it is given; gradients flow back through the casts)
        dtype = torch.get_autocast_dtype(x.device.type)
        x, w = x.to(dtype), w.to(dtype)
    _tg._check_weights(w)
    _tg._check_2d(x, "x", w.shape[2], w.dtype, w.device)
    counts = _tg.check_counts(counts, w.shape[0], x.shape[0])
    return _GroupedFunction.apply(x, w, counts, backend)


def grouped_linear(x: torch.Tensor, counts, weights: list[torch.Tensor], backend: str = "auto") -> torch.Tensor:
    """Expert g's ``F.linear(rows_g, weights[g])`` for every expert in one grouped GEMM.

    x (R, K) sorted by expert, ``counts[g]`` rows for expert g; weights: G tensors (N, K),
    the experts' own parameters. They are stacked into one (G, N, K) tensor first: a copy
    of all G weights per call (G N K elements, e.g. 8 x 1536 x 4096 bf16 = 96 MiB, the
    size of the weights themselves), freed after the backward; the backward's dW (G, N, K)
    goes back through the stack, so each expert's parameter receives its own slice. When
    every GEMM resolves to "loop" (CPU under "auto") nothing is stacked: F.linear per
    expert on its own weight. Returns (R, N).
    """
    if not isinstance(weights, (list, tuple)) or not weights:
        raise ValueError("weights must be a non-empty list of (out_features, in_features) tensors, one per expert")
    shapes = {tuple(w.shape) for w in weights}
    if len(shapes) != 1:
        raise ValueError(f"expert weights must share one shape, got {sorted(shapes)}")
    _check_backend(backend)
    n, k = weights[0].shape
    if all(_resolve(backend, kind, x, (len(weights), n, k)) == "loop" for kind in KINDS):
        # the loop reads each expert's own weight: no stacked copy, and the very GEMMs the
        # MoE block ran before (bit for bit: a slice of a stack may be aligned differently)
        _tg._check_2d(x, "x", k, weights[0].dtype, weights[0].device)
        counts = _tg.check_counts(counts, len(weights), x.shape[0])
        return torch.cat([F.linear(rows, w) for rows, w in zip(x.split(counts), weights)])
    return grouped_mm(x, torch.stack(list(weights)), counts, backend)


# ------------------------------------------------------------- choosing by measurement
def measure_grouped_backends(groups: int, rows: int, n: int, k: int, dtype, device, *, timer=None,
                             device_name=None, kinds=KINDS) -> dict:
    """Time each grouped GEMM of w (G, N, K) on ``rows`` rows split evenly over the groups,
    Triton against the torch side (``torch._grouped_mm`` in bf16, the loop otherwise) on the
    same operands; record the faster per kind (Triton only if at least as fast) and return
    ``{kind: (triton s, torch-side s, choice)}``. ``timer(fn) -> seconds`` defaults to the
    median of CUDA-event timings, which needs a CUDA device; tests inject one."""
    device = torch.device(device)
    if timer is None:
        if device.type != "cuda" or _tg.triton is None:
            raise ValueError("measuring the grouped GEMM backends needs a CUDA device and triton "
                             "(or an injected timer): CPU timings would mean nothing")
        timer = _cuda_seconds
    name = device_name or gpu_name(device)
    counts = [rows // groups + (g < rows % groups) for g in range(groups)]
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(rows, k, device=device, generator=gen).to(dtype)
    w = (torch.randn(groups, n, k, device=device, generator=gen) * k**-0.5).to(dtype)
    dy = torch.randn(rows, n, device=device, generator=gen).to(dtype)
    operands = {"fwd": (x, w), "dgrad": (dy, w), "wgrad": (dy, x)}
    other = _torch_side(dtype, n, k)
    out = {}
    for kind in kinds:
        a, b = operands[kind]
        triton_s = timer(lambda: run_grouped_gemm(kind, a, b, counts, "triton"))
        other_s = timer(lambda: run_grouped_gemm(kind, a, b, counts, other))
        if not (triton_s > 0 and other_s > 0):
            raise ValueError(f"timings must be positive seconds, got triton {triton_s!r}, {other} {other_s!r}")
        choice = "triton" if triton_s <= other_s else other
        _CHOICES[choice_key(name, kind, dtype, groups, n, k)] = choice
        out[kind] = (triton_s, other_s, choice)
    return out


def pick_grouped_backend(shapes, device, dtype=torch.bfloat16, *, timer=None, device_name=None) -> dict:
    """The backend of each grouped GEMM of each shape ``(G, R, N, K)`` (w (G, N, K), R rows):
    ``{shape: {kind: backend}}``. On CPU "loop" everywhere (the reference path; nothing is
    timed). On CUDA each (G, N, K) not yet in the table is measured once
    (:func:`measure_grouped_backends` at its R) and the table answers."""
    device = torch.device(device)
    picked = {}
    for shape in shapes:
        groups, rows, n, k = (int(v) for v in shape)
        if device.type != "cuda" and timer is None:
            picked[tuple(shape)] = {kind: "loop" for kind in KINDS}
            continue
        name = device_name or gpu_name(device)
        if any(choice_key(name, kind, dtype, groups, n, k) not in _CHOICES for kind in KINDS):
            measure_grouped_backends(groups, rows, n, k, dtype, device, timer=timer, device_name=name)
        picked[tuple(shape)] = {kind: _CHOICES[choice_key(name, kind, dtype, groups, n, k)] for kind in KINDS}
    return picked


def grouped_backend_choices() -> dict:
    """The measured choices of this process (JSON-serialisable), to ship to other ranks."""
    return dict(sorted(_CHOICES.items()))


def load_grouped_backend_choices(table: dict, *, replace: bool = True) -> None:
    """Adopt another rank's `grouped_backend_choices()`; validated whole before anything changes."""
    if not isinstance(table, dict):
        raise ValueError(f"expected a dict from grouped_backend_choices(), got {type(table).__name__}")
    names = {v: k for k, v in _DTYPE_NAMES.items()}
    for key, value in table.items():
        name, _, rest = key.partition("|") if isinstance(key, str) else ("", "", "")
        parts = rest.split(":")
        dims = parts[2].split("x") if len(parts) == 3 else []
        if (not name or len(parts) != 3 or parts[0] not in KINDS or parts[1] not in names or len(dims) != 3
                or not all(d.isdigit() for d in dims) or value not in GROUPED_BACKENDS[1:]):
            raise ValueError(f"grouped backend choice {key!r}: {value!r}: expected 'GPU|kind:dtype:GxNxK': "
                             f"one of {GROUPED_BACKENDS[1:]}")
    if replace:
        _CHOICES.clear()
    _CHOICES.update(table)


def clear_grouped_backend_choices() -> None:
    _CHOICES.clear()
