"""One block of ring attention: a chunk of local queries against a chunk of keys, with
its log-sum-exp, the merge of partial results, the block's backward, and which blocks a
rank computes.

Shapes: ``q`` (B, H, cq, D); ``k``, ``v`` (B, Hkv, ck, D) with ``G = H / Hkv`` query
heads per kv-head (head ``h`` uses kv-head ``h // G``, as SDPA's ``enable_gqa``); a
block is ``kind`` FULL (every key visible) or CAUSAL (a chunk against itself: ``tril``),
and with packed documents also ``same_doc`` (B, 1, cq, ck) bool, True where query and
key are in one document.

Forward of a block, with ``s = scale``::

    S = s q k^T (fp32)        lse = log sum_j exp S_ij        O = exp(S - lse) v

Two partial results over disjoint key sets merge exactly::

    lse = logaddexp(lse_1, lse_2)     O = O_1 exp(lse_1 - lse) + O_2 exp(lse_2 - lse)

Backward of a block, given the *final* ``O``, ``lse`` and ``dO`` of the whole row
(``delta = rowsum(dO * O)``)::

    P = exp(S - lse)   dV = P^T dO   dP = dO V^T   dS = P (dP - delta)
    dQ = s dS K        dK = s dS^T Q    (dK, dV summed over the G heads of a kv-head)

On CPU each block runs torch's flash kernel (``_scaled_dot_product_flash_attention_for_cpu``
and its backward: it returns the fp32 log-sum-exp and takes the whole row's output and
log-sum-exp in its backward; grouped-query heads natively; 20x faster than the explicit
math at 1024-token blocks); on CUDA torch's flash or memory-efficient kernel
(``cuda_blocks.py``: which one, and their differences); elsewhere, and on CUDA where no
kernel fits the dtype or head dim, the explicit ``*_ref`` math, rounded as a
flash kernel (every product takes input-dtype operands and accumulates in fp32; ``S`` and
``dP`` are never rounded; ``P`` and ``dS`` are, before their second products).
"""

from __future__ import annotations

import torch

from . import cuda_blocks

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


def block_mask(q_docs: torch.Tensor | None, k_docs: torch.Tensor | None) -> torch.Tensor | None:
    """``same_doc`` (B, 1, cq, ck) from the document ids (B, cq) and (B, ck), or None."""
    if q_docs is None:
        return None
    return (q_docs.unsqueeze(-1) == k_docs.unsqueeze(-2)).unsqueeze(1)


def _visible(kind: str, same_doc, cq: int, ck: int, device) -> torch.Tensor | None:
    """The whole bool mask of a block (B or 1, 1, cq, ck), True where a key is visible."""
    mask = torch.ones(1, 1, cq, ck, dtype=torch.bool, device=device).tril() if kind == CAUSAL else None
    if same_doc is not None:
        mask = same_doc if mask is None else same_doc & mask
    return mask


def _kernel_args(q, kind, same_doc) -> dict:
    """The CPU flash kernel's mask arguments: ``is_causal`` alone without documents (the
    caller passes None where the documents mask nothing: ``documents.DocumentStarts``;
    the kernel with a mask costs 1.3x a full block, 1.65x a causal one), else an additive
    mask in q's dtype (the kernel takes no bool mask)."""
    if same_doc is None:
        return {"is_causal": kind == CAUSAL}
    mask = _visible(kind, same_doc, q.shape[2], same_doc.shape[-1], q.device)
    bias = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill_(~mask, float("-inf"))
    return {"is_causal": False, "attn_mask": bias}


def block_path(q: torch.Tensor) -> str:
    """Where a block of ``q`` runs: ``"cpu"`` (torch's CPU flash kernel), ``"cuda"``
    (``cuda_blocks``: the flash or memory-efficient kernel, or the math where neither
    fits), else ``"ref"`` (the explicit math)."""
    return q.device.type if q.device.type in ("cpu", "cuda") else "ref"


def _cuda_kernel(q, same_doc) -> str | None:
    return cuda_blocks.kernel_for(q, same_doc is not None) if block_path(q) == "cuda" else None


def block_forward(q, k, v, kind: str, same_doc, scale: float):
    """(O (B, H, cq, D) fp32, lse (B, H, cq) fp32); a row with no visible key gets O = 0
    and lse = -inf."""
    if block_path(q) != "cpu":
        kernel = _cuda_kernel(q, same_doc)
        if kernel is None:
            return block_forward_ref(q, k, v, kind, same_doc, scale)
        visible = None if same_doc is None else _visible(kind, same_doc, q.shape[2], k.shape[2], q.device)
        return cuda_blocks.block_forward(kernel, q, k, v, kind == CAUSAL, visible, scale)
    args = _kernel_args(q, kind, same_doc)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, args["is_causal"], attn_mask=args.get("attn_mask"), scale=scale)
    if "attn_mask" in args:  # the kernel gives a row without keys lse 0: make it no mass
        empty = ~_visible(kind, same_doc, q.shape[2], k.shape[2], q.device).any(-1)  # (B, 1, cq)
        lse = lse.masked_fill(empty, float("-inf"))
    return out.float(), lse


def block_backward(q, k, v, out, d_out, lse, delta, kind: str, same_doc, scale: float):
    """(dq (B, H, cq, D), dk, dv (B, Hkv, ck, D)) fp32, the block's share of the
    gradients, from the whole row's ``out`` (input dtype), ``lse`` and ``delta`` (fp32;
    None: computed here from ``out`` and ``d_out``, as the kernels always do)."""
    if block_path(q) != "cpu":
        kernel = _cuda_kernel(q, same_doc)
        if kernel is not None:
            visible = None if same_doc is None else _visible(kind, same_doc, q.shape[2], k.shape[2], q.device)
            return cuda_blocks.block_backward(kernel, q, k, v, out, d_out, lse, kind == CAUSAL, visible, scale)
        if delta is None:
            delta = (d_out.float() * out.float()).sum(-1)  # (B, H, cq)
        return block_backward_ref(q, k, v, d_out, lse, delta, kind, same_doc, scale)
    args = _kernel_args(q, kind, same_doc)
    grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        d_out, q, k, v, out, lse, 0.0, args["is_causal"], attn_mask=args.get("attn_mask"), scale=scale)
    return tuple(g.float() for g in grads)


def merge_(out: torch.Tensor, lse: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor) -> None:
    """Fold a block's ``(out_b, lse_b)`` into the running ``(out, lse)`` in place (views
    allowed); rows with no visible key so far stay 0 / -inf. With ``w = exp(lse_b - lse')
    = sigmoid(lse_b - lse)``, the block's share of the row, ``out' = out + w (out_b - out)``:
    one fused pass over ``out`` (``lerp_``), the rest on the (B, H, c) row statistics.
    ``w`` is 1 where the row had no key yet (lse -inf) and 0 where the block has none;
    NaN (neither has one) becomes 0."""
    w = torch.sigmoid(lse_b - lse).nan_to_num_(nan=0.0).unsqueeze(-1)  # (B, H, c, 1)
    out.lerp_(out_b, w)
    torch.logaddexp(lse, lse_b, out=lse)


# -- the explicit math: the reference, and the path off CPU -------------------------------

def _grouped(x: torch.Tensor, hkv: int) -> torch.Tensor:
    """(B, H, c, D) -> (B, Hkv, G, c, D), or (B, H, c) -> (B, Hkv, G, c)."""
    return x.reshape(x.shape[0], hkv, x.shape[1] // hkv, *x.shape[2:])


def _mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` of input-dtype operands, accumulated and returned in fp32."""
    return torch.matmul(a.float(), b.float())


def _scores(q5, k, kind, same_doc, scale) -> torch.Tensor:
    s = _mm(q5, k.unsqueeze(2).transpose(-1, -2)) * scale  # (B, Hkv, G, cq, ck)
    mask = _visible(kind, same_doc, q5.shape[3], k.shape[2], q5.device)
    return s if mask is None else s.masked_fill(~mask.unsqueeze(2), float("-inf"))


def block_forward_ref(q, k, v, kind, same_doc, scale):
    """:func:`block_forward` by explicit math."""
    s = _scores(_grouped(q, k.shape[1]), k, kind, same_doc, scale)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse.masked_fill(lse == float("-inf"), 0).unsqueeze(-1))
    out = _mm(p.to(v.dtype), v.unsqueeze(2))  # (B, Hkv, G, cq, D)
    return out.flatten(1, 2), lse.flatten(1, 2)


def block_backward_ref(q, k, v, d_out, lse, delta, kind, same_doc, scale):
    """:func:`block_backward` by explicit math."""
    hkv, dt = k.shape[1], q.dtype
    q5, do5 = _grouped(q, hkv), _grouped(d_out, hkv)
    p = torch.exp(_scores(q5, k, kind, same_doc, scale) - _grouped(lse, hkv).unsqueeze(-1))
    dv = torch.einsum("bhgqk,bhgqd->bhkd", p.to(dt).float(), do5.float())
    dp = _mm(do5, v.unsqueeze(2).transpose(-1, -2))
    ds = (p * (dp - _grouped(delta, hkv).unsqueeze(-1))).to(dt).float()
    dq = _mm(ds, k.unsqueeze(2)) * scale
    dk = torch.einsum("bhgqk,bhgqd->bhkd", ds, q5.float()) * scale
    return dq.flatten(1, 2), dk, dv
