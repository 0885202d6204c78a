"""Cross-entropy over logits split by vocabulary, without ever gathering them.

Rank r holds the logits of vocabulary rows ``[start_r, start_r + v)``, (N, v), v = Vp/p.
Columns at or past the true vocabulary size (padding up to a multiple of p) are left out
of every sum, as if they were -inf. For token i with target t_i::

    m_i   = max_j z_ij                 all-reduce MAX of each rank's local max    (N,)
    s_i   = sum_j exp(z_ij - m_i)      all-reduce SUM of local sums               (N,)
    z_it  = z_i,t_i                    all-reduce SUM (only the owner of t_i adds it)
    loss_i = log s_i + m_i - z_it
    dloss_i/dz_ij = softmax_ij - [j == t_i]   computed on the local (N, v) shard only

Three all-reduces of N floats cross the wire; nothing of size V is allocated anywhere.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .comm import group_size


def _all_reduce(t: torch.Tensor, group, op) -> torch.Tensor:
    if group_size(group) > 1:
        dist.all_reduce(t, op=op, group=group)
    return t


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, vocab_start, vocab_size, group):
        n, v = logits.shape  # (N, v): this rank's columns
        valid = max(0, min(v, vocab_size - vocab_start))  # columns past vocab_size are padding
        z = logits[:, :valid].float()  # (N, valid); a view when logits are already fp32
        if valid > 0:
            m = z.max(dim=-1).values  # (N,)
        else:
            m = torch.full((n,), float("-inf"), device=logits.device)
        _all_reduce(m, group, dist.ReduceOp.MAX)

        probs = torch.exp(z - m.unsqueeze(1))  # (N, valid), exp-shifted, softmax after /s
        s = _all_reduce(probs.sum(dim=-1), group, dist.ReduceOp.SUM)  # (N,)

        local = targets - vocab_start  # (N,)
        mine = (local >= 0) & (local < valid)
        local = local.clamp(0, max(valid - 1, 0))
        if valid > 0:
            z_t = z.gather(1, local.unsqueeze(1)).squeeze(1).masked_fill(~mine, 0.0)
        else:
            z_t = torch.zeros(n, device=logits.device)
        _all_reduce(z_t, group, dist.ReduceOp.SUM)

        loss = torch.log(s) + m - z_t  # (N,)
        probs.div_(s.unsqueeze(1))
        ctx.save_for_backward(probs, local, mine)
        ctx.v, ctx.dtype = v, logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        probs, local, mine = ctx.saved_tensors
        grad = probs  # reused in place: the saved softmax is needed by nobody else
        if grad.shape[1] > 0:
            grad.scatter_add_(1, local.unsqueeze(1), -mine.to(grad.dtype).unsqueeze(1))
        grad.mul_(grad_loss.unsqueeze(1))  # (N, valid)
        if grad.shape[1] < ctx.v:  # padding columns get zero gradient
            grad = torch.nn.functional.pad(grad, (0, ctx.v - grad.shape[1]))
        return grad.to(ctx.dtype), None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, *,
                                 vocab_start: int, vocab_size: int, group) -> torch.Tensor:
    """Per-token loss (shape of ``targets``) from this rank's logit columns.

    logits (..., v): columns ``[vocab_start, vocab_start + v)`` of the full (..., Vp);
    targets (...): global token ids < ``vocab_size``; group: the tp group holding the
    other columns. Equals ``F.cross_entropy(full_logits[..., :vocab_size], targets,
    reduction="none")``.
    """
    v = logits.shape[-1]
    loss = _VocabParallelCrossEntropy.apply(logits.reshape(-1, v), targets.reshape(-1),
                                            vocab_start, vocab_size, group)
    return loss.view(targets.shape)
