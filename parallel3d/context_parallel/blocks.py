"""One block of ring attention: a chunk of local queries against a chunk of keys, with
its log-sum-exp, the merge of partial results, the block's backward, and which blocks a
rank computes.

Shapes: queries grouped by their kv-head, ``q`` (B, Hkv, G, cq, D) with ``G = H / Hkv``
(head ``h`` uses kv-head ``h // G``, as SDPA's ``enable_gqa``); ``k``, ``v``
(B, Hkv, ck, D); ``mask`` None (all visible) or bool broadcastable to (B, 1, 1, cq, ck),
True where a query may attend.

Forward of a block, with ``s = scale``::

    S = s q k^T (fp32)        lse = log sum_j exp S_ij        O = exp(S - lse) v

Two partial results over disjoint key sets merge exactly::

    lse = logaddexp(lse_1, lse_2)     O = O_1 exp(lse_1 - lse) + O_2 exp(lse_2 - lse)

Backward of a block, given the *final* ``O``, ``lse`` and ``dO`` of the whole row
(``delta = rowsum(dO * O)``)::

    P = exp(S - lse)   dV = P^T dO   dP = dO V^T   dS = P (dP - delta)
    dQ = s dS K        dK = s dS^T Q    (dK, dV summed over the G heads of a kv-head)

Precision as a flash kernel's: every product takes operands in the input dtype (``P``
and ``dS`` rounded to it, as flash rounds them before its second GEMMs) and accumulates
and returns fp32 (``S`` and ``dP`` are never rounded: they feed ``exp`` and the
cancelling ``dP - delta``); softmax, merge and accumulators are fp32. On this explicit
path the fp32 products are ``_mm`` of upcast operands, a copy of the block's operands.
"""

from __future__ import annotations

import torch

FULL, CAUSAL = "full", "causal"


def ring_plan(cp: int, cp_rank: int) -> list[list[tuple[int, int, str]]]:
    """For each ring step ``t`` (this rank then holding the K/V of cp rank
    ``(cp_rank - t) % cp``), the blocks it computes: ``(q_half, k_half, kind)`` with
    halves 0 (head chunk) / 1 (tail chunk) of the local queries and of the held keys.
    Global chunk ``b`` against ``a``: after it (``b > a``) fully masked, skipped; the same
    chunk causal; earlier, full. Every rank computes 2 causal + 1 full blocks at step 0
    and 2 full blocks at each later step."""
    def chunks(r):
        return (r, 2 * cp - 1 - r)

    plan = []
    for t in range(cp):
        src = (cp_rank - t) % cp
        step = []
        for qi, a in enumerate(chunks(cp_rank)):
            for ki, b in enumerate(chunks(src)):
                if b < a:
                    step.append((qi, ki, FULL))
                elif b == a:
                    step.append((qi, ki, CAUSAL))
        plan.append(step)
    return plan


def block_mask(kind: str, n: int, q_docs: torch.Tensor | None, k_docs: torch.Tensor | None,
               device) -> torch.Tensor | None:
    """The block's mask: causal blocks are one chunk against itself (``tril``); with
    document ids (B, n) each, also same-document. (B or 1, 1, 1, n, n) bool, or None."""
    mask = None
    if kind == CAUSAL:
        mask = torch.ones(n, n, dtype=torch.bool, device=device).tril()
    if q_docs is not None:
        same = q_docs.unsqueeze(-1) == k_docs.unsqueeze(-2)  # (B, n, n)
        mask = same if mask is None else same & mask
    return None if mask is None else mask.view(-1, 1, 1, n, n)


def _mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` of input-dtype operands, accumulated and returned in fp32."""
    return torch.matmul(a.float(), b.float())


def _scores(q, k, mask, scale) -> torch.Tensor:
    s = _mm(q, k.unsqueeze(2).transpose(-1, -2)) * scale  # (B, Hkv, G, cq, ck)
    return s if mask is None else s.masked_fill(~mask, float("-inf"))


def block_forward(q, k, v, mask, scale) -> tuple[torch.Tensor, torch.Tensor]:
    """(O (B, Hkv, G, cq, D) fp32, lse (B, Hkv, G, cq) fp32); a row with no visible key
    gets O = 0 and lse = -inf."""
    s = _scores(q, k, mask, scale)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse.masked_fill(lse == float("-inf"), 0).unsqueeze(-1))
    out = _mm(p.to(v.dtype), v.unsqueeze(2))
    return out, lse


def merge_(out: torch.Tensor, lse: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor) -> None:
    """Fold a block's ``(out_b, lse_b)`` into the running ``(out, lse)`` in place; rows
    with no visible key so far stay 0 / -inf (no NaN from -inf - -inf)."""
    new = torch.logaddexp(lse, lse_b)
    ref = new.masked_fill(new == float("-inf"), 0)
    out.mul_(torch.exp(lse - ref).unsqueeze(-1)).add_(out_b * torch.exp(lse_b - ref).unsqueeze(-1))
    lse.copy_(new)


def block_backward(q, k, v, d_out, lse, delta, mask, scale):
    """(dq (B, Hkv, G, cq, D), dk, dv (B, Hkv, ck, D)), fp32, the block's share of the
    gradients; ``d_out`` (B, Hkv, G, cq, D) in the input dtype, ``lse`` and ``delta``
    (B, Hkv, G, cq) fp32 of the whole row."""
    dt = q.dtype
    p = torch.exp(_scores(q, k, mask, scale) - lse.unsqueeze(-1))  # masked: exp(-inf) = 0
    dv = torch.einsum("bhgqk,bhgqd->bhkd", p.to(dt).float(), d_out.float())
    dp = _mm(d_out, v.unsqueeze(2).transpose(-1, -2))
    ds = (p * (dp - delta.unsqueeze(-1))).to(dt).float()
    dq = _mm(ds, k.unsqueeze(2)) * scale
    dk = torch.einsum("bhgqk,bhgqd->bhkd", ds, q.float()) * scale
    return dq, dk, dv
