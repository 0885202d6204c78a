"""gpu_acceptance.py's cp section: context parallelism's two modes at cp 2 against full
attention, forward and backward, bf16, on the one device (issue 32, acceptance 6).

One GPU cannot host the cp ranks as NCCL ranks (NCCL takes one rank per device), and gloo's
send/receive read host memory only (``distributed.gloo_p2p_needs_host``), so the ring's p2p
steps cannot run on CUDA tensors over gloo either. The section therefore runs both cp ranks
in one process through ``context_parallel/local.py``, each mode's own code with the
communication done in memory:

- all-gather: ``gathered.gathered_attention(q_r, KV, cp, r)`` for each rank ``r`` on its
  head-tail queries, ``KV`` the whole sequence's K/V in global order (what the all-gather
  delivers); KV's gradient is summed over the ranks and each rank keeps its chunks (what
  the reduce-scatter does).
- ring: ``ring.ring_forward`` / ``ring.ring_backward`` of every rank, each on a thread of
  its own, the K/V and the travelling dK/dV accumulators passed through in-memory
  mailboxes (what ``comm.ring_shift`` delivers): the spans, merges and accumulators that
  ``_RingAttention`` runs in training (it calls these two functions).

On a GPU the blocks run torch's CUDA kernels (``context_parallel/cuda_blocks.py``): the
flash kernel for the plain causal rows, the memory-efficient kernel (an additive bias)
for the packed-documents rows; the ``kernels`` column says which. On CPU (``--smoke``)
torch's CPU flash kernel. The reference is SDPA in float64 (the math kernel) on the same
bf16-rounded inputs over the whole sequence, causal or with the documents' block-diagonal
causal mask; torch's own bf16 SDPA (the flash kernel on a GPU) is measured against the
causal one too. Errors are max |x - ref| / max |ref| per tensor (out, dq, dk, dv), over
both ranks' rows.

Tolerance: 4 u, u = 2^-8 bf16's unit roundoff, as ``tests/test_context_parallel.py``
derives it (a value on the longest path, dq, is rounded to bf16 two or three times, each
within u of magnitudes of the result's; 4 u leaves about 2x over the worst measured on
CPU), or twice the error of torch's own bf16 SDPA on the same inputs where that is larger
(a longer sequence's sums may carry more: the bound is about the rounding pattern, not the
length). An error of the method (a wrong mask, a missing gradient share) is O(1).

What one GPU cannot show: NCCL's transfers, the ring's overlap of a transfer with the
blocks, the reduce-scatter on the device (the CPU tests run the modes on gloo ranks:
fp32 1e-5, bf16 4 u), and any speed of cp across devices. The times in the table are both
ranks' blocks on one device (the ring's two threads share it), beside one full-sequence
SDPA: the cost of the blocks' kernels, not of context parallelism.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
import torch.nn.functional as F

BF16_U = 2.0 ** -8
BF16_TOL = 4 * BF16_U  # see the module docstring
CP = 2


def _inputs(smoke: bool, device):
    """q, k, v, d_out on ``device`` in bf16 (B, H, S, D) / (B, Hkv, S, D)."""
    B, H, Hkv, D, S = (1, 4, 2, 16, 64) if smoke else (1, 8, 2, 128, 8192)
    g = torch.Generator(device=device).manual_seed(0)
    return [torch.randn(B, h, S, D, generator=g, device=device).to(torch.bfloat16) for h in (H, Hkv, Hkv, H)]


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device):
    _sync(device)
    t0 = time.perf_counter()
    out = fn()
    _sync(device)
    return out, (time.perf_counter() - t0) * 1e3


def full_sdpa(q, k, v, d_out, dtype):
    """Causal SDPA over the whole sequence in ``dtype``: out, dq, dk, dv."""
    leaves = [t.to(dtype).detach().requires_grad_() for t in (q, k, v)]
    out = F.scaled_dot_product_attention(*leaves, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])
    out.backward(d_out.to(dtype))
    return [out.detach()] + [t.grad for t in leaves]


def document_starts(S: int, device) -> torch.Tensor:
    """(1, S) each token's document start: packed documents of about 0.3, 0.25, 0.25 and
    0.2 of the window, boundaries inside the chunks (not at multiples of S / 4)."""
    cuts = [0, int(0.3 * S) + 1, int(0.55 * S) + 3, int(0.8 * S) - 1]
    starts = torch.zeros(S, dtype=torch.long, device=device)
    for a in cuts[1:]:
        starts[a:] = a
    return starts.unsqueeze(0)


def document_sdpa(q, k, v, d_out, starts, dtype):
    """SDPA over the whole sequence with the documents' causal mask, in ``dtype``."""
    S = q.shape[2]
    pos = torch.arange(S, device=q.device)
    mask = ((pos <= pos.unsqueeze(-1)) & (pos >= starts.unsqueeze(-1))).unsqueeze(1)  # (1, 1, S, S)
    leaves = [t.to(dtype).detach().requires_grad_() for t in (q, k, v)]
    out = F.scaled_dot_product_attention(*leaves, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])
    out.backward(d_out.to(dtype))
    return [out.detach()] + [t.grad for t in leaves]


def _kernels(q, masked: bool) -> str:
    """The block kernel the device runs (``context_parallel.blocks``)."""
    from parallel3d.context_parallel import blocks, cuda_blocks

    path = blocks.block_path(q)
    if path == "cpu":
        return "CPU flash"
    kernel = cuda_blocks.kernel_for(q, masked) if path == "cuda" else None
    return {"flash": "CUDA flash", "efficient": "CUDA efficient (bias)"}.get(kernel, "explicit math")


def _errors(got, ref) -> list[float]:
    return [float((a.double() - b).abs().max() / b.abs().max()) for a, b in zip(got, ref)]


def context_parallel(smoke: bool, work: Path, emit) -> None:
    """Ring and all-gather at cp 2, bf16, causal and with packed documents, against float64
    SDPA and beside torch's bf16 SDPA (module docstring): one row per side with its
    errors, its time and the check."""
    from parallel3d.context_parallel.local import allgather_ranks, ring_ranks

    device = torch.device("cpu") if smoke else torch.device("cuda", 0)
    q, k, v, d_out = _inputs(smoke, device)
    ref = full_sdpa(q, k, v, d_out, torch.float64)
    sdpa, sdpa_ms = _timed(lambda: full_sdpa(q, k, v, d_out, torch.bfloat16), device)
    sdpa_err = _errors(sdpa, ref)
    shape = f"B{q.shape[0]} H{q.shape[1]} Hkv{k.shape[1]} D{q.shape[3]} S{q.shape[2]}"
    names = ("out", "dq", "dk", "dv")
    emit({"side": "full SDPA bf16 (torch's kernel)", "shape": shape, "device": str(device), "kernels": "SDPA",
          "max rel. err vs float64 (out, dq, dk, dv)": ", ".join(f"{n} {e:.1e}" for n, e in zip(names, sdpa_err)),
          "tolerance": "-", "ms fwd+bwd": f"{sdpa_ms:.1f}", "check": "ok (reference for the tolerance)"})
    tols = [max(BF16_TOL, 2 * e) for e in sdpa_err]
    starts = document_starts(q.shape[2], device)
    doc_ref = document_sdpa(q, k, v, d_out, starts, torch.float64)
    for side, fn, docs in (("cp 2 all-gather (both ranks, one process)", allgather_ranks, None),
                           ("cp 2 ring (both ranks, one process)", ring_ranks, None),
                           ("cp 2 all-gather, packed documents", allgather_ranks, starts),
                           ("cp 2 ring, packed documents", ring_ranks, starts)):
        fn(q, k, v, d_out, CP, docs)  # warm-up (cuBLAS handles, the kernels' first calls)
        got, ms = _timed(lambda: fn(q, k, v, d_out, CP, docs), device)
        errs = _errors(got, ref if docs is None else doc_ref)
        bad = [n for n, e, t in zip(names, errs, tols) if not e <= t]
        emit({"side": side, "shape": shape, "device": str(device), "kernels": _kernels(q, docs is not None),
              "max rel. err vs float64 (out, dq, dk, dv)": ", ".join(f"{n} {e:.1e}" for n, e in zip(names, errs)),
              "tolerance": ", ".join(f"{t:.1e}" for t in tols), "ms fwd+bwd": f"{ms:.1f}",
              "check": "ok" if not bad else "FAIL (" + ", ".join(bad) + ")"})
