"""The one dispatch rule of the elementwise and row kernels (``cross_entropy.py``,
``dropout_mask.py``): ``backend`` "auto" runs Triton on CUDA tensors and the torch
reference elsewhere, "triton" forces the kernel (on CPU tensors only under
``TRITON_INTERPRET=1`` set before triton is first imported), "torch" the reference."""

from __future__ import annotations

import torch

try:
    import triton
except ImportError:  # pragma: no cover - the references still work without triton
    triton = None

BACKENDS = ("auto", "triton", "torch")


def use_triton(x: torch.Tensor, backend: str, interpreted: bool) -> bool:
    """Whether ``x`` goes to the Triton kernel; ``interpreted``: the calling module's
    kernels run under the interpreter. Raises ``ValueError`` naming what to change."""
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}: expected one of {BACKENDS}")
    use = backend == "triton" or (backend == "auto" and x.is_cuda and triton is not None)
    if use and triton is None:
        raise ValueError("backend='triton' needs triton installed; use backend='auto' or 'torch'")
    if use and not x.is_cuda and not interpreted:
        raise ValueError("backend='triton' on CPU tensors needs TRITON_INTERPRET=1 in the environment "
                         "before triton is first imported; use backend='auto' or 'torch' otherwise")
    return use
