"""Context parallelism's CUDA branch (``context_parallel/cuda_blocks.py``) and every cp
rank in one process (``context_parallel/local.py``), on CPU.

torch's CUDA kernels are played by ``sdpa_lookalikes`` (the signatures and return layouts
of torch 2.13's flash and memory-efficient SDPA ops and their backwards, with what the
real kernels demand checked and their awkward parts reproduced: the efficient kernel's
lse padded to 32 rows with NaN in the padding, flash's backward reading a contiguous
lse, causal alignments, no grouped-query heads in the efficient kernel). The gloo tests
of ``test_context_parallel.py`` run every attention case through this branch as well.

Tolerances: fp32 1e-5 (``test_context_parallel.py``: the same products summed in
another order).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import sdpa_lookalikes
from parallel3d.context_parallel import blocks, cuda_blocks
from parallel3d.context_parallel.blocks import CAUSAL, FULL
from test_context_parallel import _block_path as block_path


def _cuda_branch(monkeypatch, kernel: str) -> None:
    """Blocks through ``cuda_blocks`` on CPU tensors, torch's CUDA kernels played by
    ``sdpa_lookalikes``; ``kernel`` for every unmasked block (a masked one: efficient)."""
    monkeypatch.setattr(blocks, "block_path", lambda q: "cuda")
    monkeypatch.setattr(cuda_blocks, "OPS", sdpa_lookalikes.OPS)
    monkeypatch.setattr(cuda_blocks, "kernel_for", lambda q, masked: "efficient" if masked else kernel)


@pytest.mark.parametrize("kernel", ["flash", "efficient"])
@pytest.mark.parametrize("kind", [FULL, CAUSAL])
def test_a_block_by_the_cuda_kernels_equals_the_explicit_math(monkeypatch, kernel, kind):
    """The CUDA branch's slicing and fix-ups on one block: 37 queries (not a multiple of
    the efficient kernel's 32-row lse padding, which the look-alike fills with NaN) x 37
    keys causal or 53 full, 6 heads on 2 kv-heads (flash groups natively, efficient gets
    the K/V repeated and sums dK/dV back), documents leaving rows without a visible key
    (the look-alike's output NaN there: the branch must give 0 and lse -inf); forward and
    backward from a row's lse against the explicit math, the upstream gradient strided
    along the head dim (the kernels want it unit-strided). fp32: sums in another order."""
    _cuda_branch(monkeypatch, kernel)
    torch.manual_seed(2)
    ck = 37 if kind == CAUSAL else 53
    q, d_out = torch.randn(2, 6, 37, 16), torch.randn(2, 6, 16, 37).transpose(-1, -2)  # dO as if transposed
    k, v = torch.randn(2, 2, ck, 16), torch.randn(2, 2, ck, 16)
    q_docs = torch.tensor([[0] * 10 + [1] * 27, [2] * 37])  # row 1: no key of its document
    k_docs = torch.tensor([[0] * 5 + [1] * (ck - 5), [1] * ck])
    for same_doc in (None, blocks.block_mask(q_docs, k_docs)):
        out, lse = blocks.block_forward(q, k, v, kind, same_doc, 0.25)
        out_ref, lse_ref = blocks.block_forward_ref(q, k, v, kind, same_doc, 0.25)
        torch.testing.assert_close(lse, lse_ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(out, out_ref, rtol=1e-5, atol=1e-5)
        row_lse = torch.where(lse_ref.isinf(), torch.ones_like(lse_ref), lse_ref + 0.5)  # as if merged with more
        delta = (d_out * out_ref).sum(-1)
        grads = blocks.block_backward(q, k, v, out_ref, d_out, row_lse[:, :, :], delta, kind, same_doc, 0.25)
        grads_ref = blocks.block_backward_ref(q, k, v, d_out, row_lse, delta, kind, same_doc, 0.25)
        for g, g_ref in zip(grads, grads_ref):
            assert g.dtype == torch.float32 and g.shape == g_ref.shape
            torch.testing.assert_close(g, g_ref, rtol=1e-5, atol=1e-5)
    assert lse_ref[1].isinf().all() and (out[1] == 0).all()  # the last case: empty rows


def test_the_cuda_branch_calls_no_causal_kernel_on_a_non_square_block(monkeypatch):
    """SDPA's ``is_causal`` is top-left aligned, flash-attn's bottom-right: they differ
    unless the block is square, so the branch refuses any other."""
    _cuda_branch(monkeypatch, "flash")
    q, kv = torch.randn(1, 2, 8, 16), torch.randn(1, 2, 12, 16)
    with pytest.raises(AssertionError, match="square"):
        blocks.block_forward(q, kv, kv, CAUSAL, None, 0.25)


def test_the_cuda_kernel_choice(monkeypatch):
    """Flash for unmasked fp16 / bf16 blocks with a head dim it takes (a multiple of 8,
    at most 256; sm86/89 at most 192: its backward), the efficient kernel for masked or
    fp32 blocks (head dim a multiple of 16 bytes), else None (the explicit math)."""
    cap = [(9, 0)]
    monkeypatch.setattr(cuda_blocks, "capability", lambda device: cap[0])

    def pick(dtype, d, masked=False):
        return cuda_blocks.kernel_for(torch.empty(1, 2, 4, d, dtype=dtype), masked)

    assert pick(torch.bfloat16, 128) == "flash" and pick(torch.float16, 256) == "flash"
    assert pick(torch.bfloat16, 128, masked=True) == "efficient"
    assert pick(torch.float32, 64) == "efficient" and pick(torch.float32, 6) is None
    assert pick(torch.float32, 20) == "efficient" and pick(torch.bfloat16, 20) is None
    assert pick(torch.bfloat16, 264) == "efficient" and pick(torch.float64, 64) is None
    cap[0] = (8, 6)
    assert pick(torch.bfloat16, 192) == "flash" and pick(torch.bfloat16, 224) == "efficient"
    cap[0] = (7, 5)
    assert pick(torch.float16, 64) == "efficient" and pick(torch.bfloat16, 64) is None


@pytest.mark.parametrize("path", ["kernel", "cuda-flash"])
@pytest.mark.parametrize("cp", [2, 4])
def test_every_rank_in_one_process_equals_sdpa(cp, path):
    """``local.py``: both modes' own code for every cp rank in this process (the ring's
    ranks on threads, messages through mailboxes), what ``benchmarks/_acceptance_cp.py``
    runs on one GPU: out, dq, dk, dv of the whole sequence against SDPA, causal and with
    packed documents, through the CPU kernel and the CUDA branch (look-alikes). fp32."""
    from parallel3d.context_parallel.local import allgather_ranks, ring_ranks

    torch.manual_seed(5)
    S = 8 * cp
    q, d_out = torch.randn(2, 4, S, 8), torch.randn(2, 4, S, 8)
    k, v = torch.randn(2, 2, S, 8), torch.randn(2, 2, S, 8)
    ids = torch.tensor([[0] * 5 + [1] * (S - 12) + [2] * 7, [0] * (S - 3) + [1] * 3])
    starts = torch.stack([torch.searchsorted(row, row, right=False) for row in ids])  # (2, S) first index
    with block_path(path):
        for doc_starts in (None, starts):
            same = (ids.unsqueeze(-1) == ids.unsqueeze(-2)) & torch.ones(S, S, dtype=torch.bool).tril()
            mask = None if doc_starts is None else same.unsqueeze(1)  # (2, 1, S, S)
            leaves = [x.clone().requires_grad_() for x in (q, k, v)]
            if mask is None:
                ref = F.scaled_dot_product_attention(*leaves, is_causal=True, enable_gqa=True)
            else:
                ref = F.scaled_dot_product_attention(*leaves, attn_mask=mask, enable_gqa=True)
            ref.backward(d_out)
            want = [ref.detach()] + [x.grad for x in leaves]
            for fn in (allgather_ranks, ring_ranks):
                got = fn(q, k, v, d_out, cp, doc_starts)
                for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
                    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=f"{fn.__name__} {name}")
