"""Packed documents through torch's variable-length flash kernel (GPU) instead of the
(B, S, S) mask: the loader's spans are exactly the mask's segments, the model's varlen
plumbing (flattening, heads, GQA, tensor shapes) gives the masked path's outputs and
gradients, and on a GPU the real kernel agrees with the masked SDPA in bf16.

On CPU torch's kernel does not run (it is CUDA-only), so the plumbing test replaces it
with a reference written here from its documented contract (causal attention inside each
``cu_seqlens`` span of the flattened tokens), one SDPA call per document."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import parallel3d.models.llama.documents as documents
import parallel3d.models.llama.model as llama_model
from parallel3d.data.batch import MicroBatch, document_spans
from parallel3d.data.packing import PackedWindows
from parallel3d.models.llama import Llama, config_from_preset
from parallel3d.models.llama.documents import document_mask

pytestmark = pytest.mark.usefixtures("one_thread")


def _mask_from_spans(cu: torch.Tensor, B: int, S: int) -> torch.Tensor:
    """(B, 1, S, S): causal inside each span of the flattened tokens, from the spans alone."""
    doc = torch.zeros(B * S, dtype=torch.long)
    for d, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        doc[a:b] = d
    doc = doc.view(B, S)
    same = doc.unsqueeze(-1) == doc.unsqueeze(-2)
    return (same & torch.ones(S, S, dtype=torch.bool).tril()).unsqueeze(1)


def test_spans_by_hand():
    positions = torch.tensor([[0, 1, 2, 0, 1], [3, 4, 0, 1, 2]])  # row 2 starts inside a document
    cu, longest = document_spans(positions)
    assert cu.dtype == torch.int32 and cu.tolist() == [0, 3, 5, 7, 10] and longest == 3


def test_spans_of_packed_windows_are_the_mask_segments():
    rng = np.random.default_rng(0)
    starts = np.cumsum(np.concatenate([[0], rng.integers(1, 40, size=200)]))
    tokens = rng.integers(0, 500, size=int(starts[-1]) + 1)
    for whole in (True, False):
        windows = PackedWindows(tokens, 64, starts=starts[:-1], whole=whole, pad_id=0)
        mb = windows.micro_batch(list(range(0, 12, 3)), loss_divisor=1.0)
        assert mb.cu_seqlens is not None and mb.positions.shape == (4, 64)
        assert torch.equal(_mask_from_spans(mb.cu_seqlens, 4, 64), document_mask(mb.positions))
        assert mb.max_doc_len == int((mb.cu_seqlens[1:] - mb.cu_seqlens[:-1]).max())
        assert set(mb.chunk_kwargs()) == {"positions", "cu_seqlens", "max_doc_len"}
        moved = mb.to("cpu")
        assert torch.equal(moved.cu_seqlens, mb.cu_seqlens) and moved.max_doc_len == mb.max_doc_len
    assert MicroBatch(torch.zeros(1, 4), torch.zeros(1, 4)).chunk_kwargs() == {}


def _reference_varlen(q, k, v, cu_q, cu_k, max_q, max_k, *, window_size, enable_gqa):
    """torch's varlen_attn contract, one document at a time: q (T, h, hd), k/v (T, kvh, hd)."""
    assert window_size == (-1, 0) and torch.equal(cu_q, cu_k) and max_q == max_k
    assert cu_q.dtype == torch.int32 and int((cu_q[1:] - cu_q[:-1]).max()) == max_q
    out = torch.empty_like(q)
    for a, b in zip(cu_q[:-1].tolist(), cu_q[1:].tolist()):
        piece = [t[a:b].transpose(0, 1) for t in (q, k, v)]  # (h, L, hd)
        out[a:b] = F.scaled_dot_product_attention(*piece, is_causal=True, enable_gqa=enable_gqa).transpose(0, 1)
    return out


@pytest.mark.parametrize("kv_heads", [4, 2])  # plain and grouped-query attention
def test_the_varlen_path_gives_the_masked_paths_outputs_and_gradients(monkeypatch, kv_heads):
    torch.manual_seed(0)
    cfg = config_from_preset("debug", vocab_size=300, n_layers=2, dim=64, n_heads=4, n_kv_heads=kv_heads,
                             ffn_dim=160, init_std=0.3)
    model = Llama(cfg)
    x = torch.randint(0, 300, (3, 40))
    positions = torch.cat([torch.arange(13), torch.arange(27)]).repeat(3, 1)
    positions[1] = torch.cat([torch.arange(5), torch.arange(30), torch.arange(5)])
    cu, longest = document_spans(positions)

    def run(**spans):
        model.zero_grad()
        logits = model(x, positions=positions, **spans)
        logits.square().mean().backward()
        return logits.detach(), [p.grad.clone() for p in model.parameters()]

    masked, masked_grads = run()
    calls = []
    monkeypatch.setattr(llama_model, "varlen_runs_on", lambda h, hd: calls.append(hd) or True)
    flat_inputs = []

    def kernel(q, k, v, *args, **kwargs):
        flat_inputs.append([t._is_view() for t in (q, k, v)])
        return _reference_varlen(q, k, v, *args, **kwargs)

    monkeypatch.setattr(documents, "_varlen_kernel", lambda: kernel)
    varlen, varlen_grads = run(cu_seqlens=cu, max_doc_len=longest)
    assert calls, "the varlen path was not taken"
    # (T, h, hd) q, k, v are views of what the projections and the rotation wrote (the
    # rotation keeps the projection's (B, S, h, hd) order): no copy before the kernel
    assert flat_inputs == [[True, True, True]] * cfg.n_layers, flat_inputs
    # fp32: one SDPA per document against one masked SDPA over the window, the same
    # products summed in another order (a few ulps of fp32 through two layers)
    torch.testing.assert_close(varlen, masked, rtol=1e-5, atol=1e-5)
    for a, b in zip(varlen_grads, masked_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    # the check can fail: without the documents (one causal window) the outputs differ
    leaky = model(x).detach()
    assert (leaky - masked).abs().max() > 1e-2


def test_the_cpu_takes_the_mask_path():
    assert not documents.varlen_runs_on(torch.zeros(2, dtype=torch.bfloat16), 64)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (torch's varlen kernel)")
def test_varlen_kernel_on_the_gpu_agrees_with_masked_sdpa_in_bf16():
    device = torch.device("cuda")
    torch.manual_seed(0)
    cfg = config_from_preset("debug", vocab_size=1000, n_layers=2, dim=256, n_heads=8, n_kv_heads=2,
                             ffn_dim=512, init_std=0.05)
    model = Llama(cfg).to(device, torch.bfloat16)
    x = torch.randint(0, 1000, (2, 512), device=device)
    positions = torch.cat([torch.arange(100), torch.arange(300), torch.arange(112)]).repeat(2, 1).to(device)
    cu, longest = document_spans(positions.cpu())
    assert documents.varlen_runs_on(torch.zeros(1, device=device, dtype=torch.bfloat16), cfg.head_dim)
    with torch.no_grad():
        masked = model(x, positions=positions).float()
        varlen = model(x, positions=positions, cu_seqlens=cu.to(device), max_doc_len=longest).float()
    # bf16 (8 bits of mantissa): two kernels' roundings through two layers; attending
    # across the documents would move the logits by far more
    rel = (varlen - masked).norm() / masked.norm()
    assert rel < 2e-2, float(rel)
