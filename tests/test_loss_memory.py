"""The loss at tp 1 allocates nothing of the logits' size: no fp32 copy, no log-softmax,
and its gradient written over the logits (issue 30, point 4: a 128K vocabulary at 8K tokens
held 12-16 GB in the loss alone)."""

from __future__ import annotations

import torch

from parallel3d.config import ParallelConfig
from parallel3d.models.llama import Llama, LlamaConfig
from parallel3d.models.llama.parallelize import parallelize_llama
from parallel3d.topology import Topology
from parallel3d.zero.memory import AllocationMeter

VOCAB, TOKENS = 32768, 4096


def _loss_peak(loss_fn, tokens: int = TOKENS) -> tuple[int, int]:
    """(peak bytes the loss's forward and backward allocate, one bf16 copy of the logits)
    for bf16 logits of ``tokens`` tokens over a 32K vocabulary, already computed (the
    model's head output: the one copy that exists before the loss; made here without a
    head, whose bf16 GEMM takes tens of seconds on this CPU)."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(1, tokens, VOCAB, generator=gen, dtype=torch.bfloat16).mul_(3).requires_grad_()
    targets = torch.randint(0, VOCAB, (1, tokens), generator=gen)
    with AllocationMeter() as meter:
        loss_fn(logits, targets).backward()
    return meter.peak, tokens * VOCAB * 2


def test_the_tp1_loss_allocates_nothing_of_the_logits_size():
    """Peak of the whole loss = the logits' one bf16 copy and no more: the gradient takes
    their storage (it becomes ``logits.grad`` without a copy)."""
    from parallel3d.kernels.cross_entropy import REF_BLOCK_BYTES

    model = Llama(LlamaConfig(vocab_size=VOCAB, dim=16, n_layers=1, n_heads=2, n_kv_heads=2, ffn_dim=16))
    _, loss_fn = parallelize_llama(model, Topology.single(), ParallelConfig())
    peak, logits = _loss_peak(loss_fn)
    # what is not of the logits' size: the reference's fp32 row block and its exp (two
    # blocks) and per-token vectors
    others = 2 * REF_BLOCK_BYTES + 16 * TOKENS * 4
    assert peak <= others < logits / 4, (peak, logits, others)


def test_an_fp32_log_softmax_loss_would_not():
    """The same meter on ``F.cross_entropy`` of the upcast logits (the tp 1 loss before):
    several copies of the logits (the measure can fail; fewer tokens, the ratio holds)."""
    peak, logits = _loss_peak(
        lambda z, t: torch.nn.functional.cross_entropy(z.float().flatten(0, 1), t.flatten()), TOKENS // 8)
    assert peak > 3 * logits, (peak / logits)
