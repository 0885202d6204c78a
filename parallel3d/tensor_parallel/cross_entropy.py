"""Cross-entropy over logits split by vocabulary, without ever gathering them.

Rank r holds the logits of vocabulary rows ``[start_r, start_r + v)``, (N, v), v = Vp/p.
Columns at or past the true vocabulary size (padding up to a multiple of p) are left out
of every sum, as if they were -inf. For token i with target t_i::

    local    m_ir, s_ir = max, sum exp(z - m_ir) over my columns; z_it if t_i is mine
    MAX      m_i  = max_r m_ir                                     all-reduce of N floats
    SUM      s_i  = sum_r s_ir exp(m_ir - m_i),  z_it = sum_r z_it  one all-reduce of 2N
    loss_i = log s_i + m_i - z_it
    dloss_i/dz_ij = exp(z_ij - m_i) / s_i - [j == t_i]    on the local (N, v) shard only

A target equal to ``ignore_index`` (-100, as torch's) is not trained on: its loss is 0 and
its row's upstream gradient is set to 0, which the gradient pass turns into a zero row.

The local passes are ``parallel3d.kernels.cross_entropy`` (one fused Triton pass each on
CUDA, the torch reference on CPU). The forward saves the logits and two N-vectors, not
the softmax; nothing of size V is allocated anywhere, and with ``inplace`` the gradient
takes the logits' own storage (their last reader is the gradient pass itself).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from parallel3d.distributed import all_reduce

from parallel3d.kernels.cross_entropy import ce_local_grad, ce_local_stats


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, vocab_start, vocab_size, group, backend, ignore_index, inplace):
        v = logits.shape[1]  # (N, v): this rank's columns
        valid = max(0, min(v, vocab_size - vocab_start))  # columns past vocab_size are padding
        local = targets - vocab_start  # (N,), outside [0, valid) when another rank owns it
        m_mine, s_mine, z_t = ce_local_stats(logits, local, valid, backend)  # (N,) fp32 each
        m = all_reduce(m_mine.clone(), group, dist.ReduceOp.MAX)
        rescale = torch.exp(m_mine - m).masked_fill(m_mine == float("-inf"), 0.0)
        summed = all_reduce(torch.stack([s_mine * rescale, z_t]), group, dist.ReduceOp.SUM)
        s, z_t = summed[0], summed[1]
        ignored = targets == ignore_index  # (N,)
        ctx.save_for_backward(logits, local, m, s, ignored)
        ctx.valid, ctx.backend, ctx.inplace = valid, backend, inplace
        return (torch.log(s) + m - z_t).masked_fill(ignored, 0.0)  # (N,)

    @staticmethod
    def backward(ctx, grad_loss):
        logits, local, m, s, ignored = ctx.saved_tensors
        grad_loss = grad_loss.masked_fill(ignored, 0.0)  # ignored rows: a zero gradient
        grad = ce_local_grad(logits, local, ctx.valid, m, s, grad_loss, ctx.backend, ctx.inplace)  # (N, v)
        return grad, None, None, None, None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, *,
                                 vocab_start: int, vocab_size: int, group,
                                 backend: str = "auto", ignore_index: int = -100,
                                 inplace: bool = False) -> torch.Tensor:
    """Per-token loss (shape of ``targets``) from this rank's logit columns.

    logits (..., v): columns ``[vocab_start, vocab_start + v)`` of the full (..., Vp);
    targets (...): global token ids < ``vocab_size``; group: the tp group holding the
    other columns. Equals ``F.cross_entropy(full_logits[..., :vocab_size], targets,
    reduction="none", ignore_index=ignore_index)`` (0 where the target is ``ignore_index``).
    backend: "auto" (Triton on CUDA, torch on CPU), "triton", "torch". ``inplace``: the
    backward writes the logits' gradient over the logits (no buffer of their size; the
    caller must not read them after the backward: training's loss, never a test's logits).
    """
    v = logits.shape[-1]
    z = logits.reshape(-1, v)
    if v > 1 and z.stride(1) != 1:
        z = z.contiguous()
    loss = _VocabParallelCrossEntropy.apply(z, targets.reshape(-1), vocab_start, vocab_size,
                                            group, backend, ignore_index, inplace)
    return loss.view(targets.shape)
