"""gpu_acceptance.py's cp section: context parallelism's two modes at cp 2 against full
attention, forward and backward, bf16, on the one device (issue 32, acceptance 6).

One GPU cannot host the cp ranks as NCCL ranks (NCCL takes one rank per device), and gloo's
send/receive read host memory only (``distributed.gloo_p2p_needs_host``), so the ring's p2p
steps cannot run on CUDA tensors over gloo either. The section therefore computes both cp
ranks in one process, calling each mode's own block code with the communication replaced
by indexing:

- all-gather: ``gathered.gathered_attention(q_r, KV, cp, r)`` for each rank ``r`` on its
  head-tail queries, ``KV`` the whole sequence's K/V in global order (what the all-gather
  delivers); KV's gradient is summed over the ranks and each rank keeps its chunks (what
  the reduce-scatter does).
- ring: for each rank ``r``, the steps of ``blocks.ring_plan(cp, r)`` with the K/V of rank
  ``(r - t) % cp`` at step ``t`` (what the ring delivers): ``block_forward`` and ``merge_``,
  then ``block_backward`` from the final output and log-sum-exp, each block's dK/dV added
  to the K/V's owner (where the accumulator travelling round the ring ends). The same
  order of blocks and merges as ``ring.py``.

On a GPU the blocks run the explicit math (``blocks.block_forward_ref``: cuBLAS products of
bf16 operands accumulated in fp32); on CPU (``--smoke``) torch's CPU flash kernel. The
reference is SDPA in float64 (the math kernel) on the same bf16-rounded inputs, causal,
over the whole sequence; torch's own bf16 SDPA (the flash kernel on a GPU) is measured
against it too. Errors are max |x - ref| / max |ref| per tensor (out, dq, dk, dv), over
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
ranks' blocks one after the other on one device, beside one full-sequence SDPA: the cost
of the blocks' kernels, not of context parallelism.
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


def allgather_ranks(q, k, v, d_out):
    """Every cp rank's all-gather mode (module docstring): out, dq, dk, dv of the whole
    sequence, each rank's rows put back in global order."""
    from parallel3d.context_parallel import shard_sequence, unshard_sequence
    from parallel3d.context_parallel.gathered import gathered_attention

    kv = torch.stack([k, v]).detach().requires_grad_()  # (2, B, Hkv, S, D): the gathered K/V
    outs, dqs = [], []
    for r in range(CP):
        q_r = shard_sequence(q, CP, r, dim=2).requires_grad_()
        out = gathered_attention(q_r, kv, CP, r)
        out.backward(shard_sequence(d_out, CP, r, dim=2))  # KV's gradient sums over ranks
        outs.append(out.detach())
        dqs.append(q_r.grad)
    return [unshard_sequence(outs, dim=2), unshard_sequence(dqs, dim=2), kv.grad[0], kv.grad[1]]


def _ring_rank(q, kvs, d_out, r: int, dkvs, scale: float):
    """Rank ``r``'s ring forward and backward; adds its dK/dV shares into ``dkvs`` (the
    owners' accumulators, fp32); returns (out, dq)."""
    from parallel3d.context_parallel.blocks import block_backward, block_forward, merge_, ring_plan

    qh = q.tensor_split(2, dim=2)
    out = [torch.zeros(h.shape, dtype=torch.float32, device=q.device) for h in qh]
    lse = [torch.full(h.shape[:-1], float("-inf"), device=q.device) for h in qh]
    plan = ring_plan(CP, r)
    for t, blocks in enumerate(plan):
        src = (r - t) % CP
        kh, vh = kvs[src][0].tensor_split(2, dim=2), kvs[src][1].tensor_split(2, dim=2)
        for qi, ki, kind in blocks:
            merge_(out[qi], lse[qi], *block_forward(qh[qi], kh[ki], vh[ki], kind, None, scale))
    o = torch.cat(out, dim=2).to(q.dtype)
    lse_all = torch.cat(lse, dim=2)
    delta = (d_out.float() * o.float()).sum(-1)
    oh, doh, lseh, deltah = (x.tensor_split(2, dim=2) for x in (o, d_out, lse_all, delta))
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dqh = dq.tensor_split(2, dim=2)
    for t, blocks in enumerate(plan):
        src = (r - t) % CP
        kh, vh = kvs[src][0].tensor_split(2, dim=2), kvs[src][1].tensor_split(2, dim=2)
        dkh, dvh = dkvs[src][0].tensor_split(2, dim=2), dkvs[src][1].tensor_split(2, dim=2)
        for qi, ki, kind in blocks:
            dq_b, dk_b, dv_b = block_backward(qh[qi], kh[ki], vh[ki], oh[qi], doh[qi], lseh[qi], deltah[qi],
                                              kind, None, scale)
            dqh[qi].add_(dq_b)
            dkh[ki].add_(dk_b)
            dvh[ki].add_(dv_b)
    return o, dq.to(q.dtype)


def ring_ranks(q, k, v, d_out):
    """Every cp rank's ring mode (module docstring): out, dq, dk, dv in global order."""
    from parallel3d.context_parallel import shard_sequence, unshard_sequence

    scale = q.shape[-1] ** -0.5
    kvs = [torch.stack([shard_sequence(k, CP, r, dim=2), shard_sequence(v, CP, r, dim=2)]) for r in range(CP)]
    dkvs = [torch.zeros(kv.shape, dtype=torch.float32, device=q.device) for kv in kvs]
    outs, dqs = [], []
    for r in range(CP):
        o, dq = _ring_rank(shard_sequence(q, CP, r, dim=2), kvs, shard_sequence(d_out, CP, r, dim=2), r, dkvs, scale)
        outs.append(o)
        dqs.append(dq)
    dk = unshard_sequence([d[0].to(k.dtype) for d in dkvs], dim=2)
    dv = unshard_sequence([d[1].to(v.dtype) for d in dkvs], dim=2)
    return [unshard_sequence(outs, dim=2), unshard_sequence(dqs, dim=2), dk, dv]


def _errors(got, ref) -> list[float]:
    return [float((a.double() - b).abs().max() / b.abs().max()) for a, b in zip(got, ref)]


def context_parallel(smoke: bool, work: Path, emit) -> None:
    """Ring and all-gather at cp 2, bf16, against float64 SDPA and beside torch's bf16 SDPA
    (module docstring): one row per side with its errors, its time and the check."""
    device = torch.device("cpu") if smoke else torch.device("cuda", 0)
    q, k, v, d_out = _inputs(smoke, device)
    ref = full_sdpa(q, k, v, d_out, torch.float64)
    sdpa, sdpa_ms = _timed(lambda: full_sdpa(q, k, v, d_out, torch.bfloat16), device)
    sdpa_err = _errors(sdpa, ref)
    shape = f"B{q.shape[0]} H{q.shape[1]} Hkv{k.shape[1]} D{q.shape[3]} S{q.shape[2]}"
    names = ("out", "dq", "dk", "dv")
    emit({"side": "full SDPA bf16 (torch's kernel)", "shape": shape, "device": str(device),
          "max rel. err vs float64 (out, dq, dk, dv)": ", ".join(f"{n} {e:.1e}" for n, e in zip(names, sdpa_err)),
          "tolerance": "-", "ms fwd+bwd": f"{sdpa_ms:.1f}", "check": "ok (reference for the tolerance)"})
    tols = [max(BF16_TOL, 2 * e) for e in sdpa_err]
    for side, fn in (("cp 2 all-gather (both ranks, one process)", allgather_ranks),
                     ("cp 2 ring (both ranks, one process)", ring_ranks)):
        fn(q, k, v, d_out)  # warm-up (cuBLAS handles, the CPU kernel's first call)
        got, ms = _timed(lambda: fn(q, k, v, d_out), device)
        errs = _errors(got, ref)
        bad = [n for n, e, t in zip(names, errs, tols) if not e <= t]
        emit({"side": side, "shape": shape, "device": str(device),
              "max rel. err vs float64 (out, dq, dk, dv)": ", ".join(f"{n} {e:.1e}" for n, e in zip(names, errs)),
              "tolerance": ", ".join(f"{t:.1e}" for t in tols), "ms fwd+bwd": f"{ms:.1f}",
              "check": "ok" if not bad else "FAIL (" + ", ".join(bad) + ")"})
