"""Context parallelism (parallel3d/context_parallel) against full-sequence SDPA.

Every rank builds the whole sequence's q, k, v and upstream gradient from one seed, runs
torch's SDPA on it (causal, or the block-diagonal document mask of the model,
``models/llama/documents.document_mask``) as the reference, then runs its own head-tail
shard through ``context_parallel_attention`` and compares its output and the gradients
of its q, k, v with the matching rows of the reference's. Grouped-query heads (4 query
heads on 2 kv-heads) throughout; packed documents whose boundaries fall inside chunks.

Pool of 4 gloo ranks: cp 4 on the world, and cp 2 as the groups {0, 2} and {1, 3} (the
strided groups cp gets with tp 2 innermost: the ring's peers are group ranks, not global
ranks).

Tolerances, as error max|a - b| over max|ref| of the tensor compared:

- fp32: 1e-5. The sharded computation sums the same products in another order (blocks
  merged by their log-sum-exp, gradients summed over ranks); measured 1e-7 .. 6e-7.
- bf16 (inputs rounded to bf16; the reference is fp32 SDPA on those rounded inputs):
  ``4 u`` with u = 2^-8 bf16's unit roundoff. Both modes compute by blocks, rounded as a
  flash kernel does (the CPU kernel and the explicit math alike): products accumulate in
  fp32, and along the longest path (dq: P or dS before a product, a block's result, the
  final cast) a value is rounded to bf16 two or three times, each within u of magnitudes
  of the order of the result's. 4 u leaves 2x over the worst measured: 4.1e-3 .. 7.1e-3
  (1.8 u); torch's own bf16 SDPA on the whole sequence is 5.5e-3 (1.4 u) off the same
  reference. An error of the method (a block of the wrong mask,
  a missing gradient share) is O(1).

Sharding, the plans and spans and the document keys and masks, host-side:
tests/test_context_parallel_sharding.py.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import sdpa_lookalikes
from parallel3d.context_parallel import (context_parallel_attention, document_keys, head_tail_chunks,
                                         shard_positions, shard_sequence)
from parallel3d.context_parallel import blocks, cuda_blocks, gathered, spans
from parallel3d.context_parallel.attention import ContextParallelAttention
from parallel3d.context_parallel.blocks import CAUSAL, FULL
from parallel3d.context_parallel.documents import DocumentStarts
from parallel3d.context_parallel.gathered import gathered_attention
from parallel3d.models.llama.documents import document_mask

FP32_TOL = 1e-5  # see the module docstring
BF16_TOL = 4 * 2.0 ** -8  # see the module docstring

_GROUPS: dict[int, object] = {}


def _cp_group(cp: int):
    """This rank's cp group: the world at cp 4; {0, 2} / {1, 3} at cp 2. Created once per
    worker (every rank takes part in creating every group)."""
    if cp not in _GROUPS:
        world = dist.get_world_size()
        mine = None
        for start in range(world // cp):
            ranks = list(range(start, world, world // cp))
            g = dist.new_group(ranks)
            if dist.get_rank() in ranks:
                mine = g
        _GROUPS[cp] = mine
    return _GROUPS[cp]


def _packed_positions(S: int) -> torch.Tensor:
    """(2, S) per-document positions; the documents cross chunk boundaries at any cp here
    (chunks of 6 or 3 tokens at S = 24: lengths 5, 9, 3 ... and S-7, 7)."""
    rows = [[5, 9, 3, S - 17], [S - 7, 7]]
    return torch.stack([torch.cat([torch.arange(n) for n in row]) for row in rows])


def _errors(cp: int, comm: str, dtype: torch.dtype, docs: bool, heads=(4, 2)) -> list[float]:
    group = _cp_group(cp)
    r = dist.get_rank(group)
    torch.manual_seed(0)
    (H, Hkv), B, D, S = heads, 2, 8, 24
    q, k, v, d_out = (torch.randn(B, h, S, D).to(dtype) for h in (H, Hkv, Hkv, H))
    positions = _packed_positions(S)
    ref_q, ref_k, ref_v = (t.float().clone().requires_grad_() for t in (q, k, v))
    mask = document_mask(positions) if docs else None
    ref = F.scaled_dot_product_attention(ref_q, ref_k, ref_v, attn_mask=mask, is_causal=not docs,
                                         enable_gqa=H != Hkv)
    ref.backward(d_out.float())

    def mine(t):
        return shard_sequence(t, cp, r, dim=2)

    lq, lk, lv = (mine(t).requires_grad_() for t in (q, k, v))
    doc_starts = document_keys(shard_sequence(positions, cp, r, dim=1), cp, r) if docs else None
    out = context_parallel_attention(lq, lk, lv, group, comm=comm, doc_starts=doc_starts)
    out.backward(mine(d_out))
    pairs = [(out, ref), (lq.grad, ref_q.grad), (lk.grad, ref_k.grad), (lv.grad, ref_v.grad)]
    assert all(a.dtype == dtype for a, _ in pairs)
    return [float((a.detach().float() - mine(b)).abs().max() / mine(b).abs().max()) for a, b in pairs]


@contextlib.contextmanager
def _block_path(path: str):
    """The blocks (both modes compute by blocks) through the CPU flash kernel ("kernel",
    the CPU default) or the explicit math ("ref", what other devices run); "pieces": the
    kernel with every unmasked causal block cut into rows of 2 queries (``CAUSAL_PIECE``:
    256 in use, more than these chunks of 6 or 3 tokens hold); "cuda-flash" /
    "cuda-efficient": the CUDA branch (``cuda_blocks``) with torch's CUDA kernels played
    by ``sdpa_lookalikes`` (same signatures and return layouts: the efficient kernel's
    padded lse, flash's contiguous-lse backward), flash for every unmasked block or the
    efficient kernel for all (a masked block always takes the efficient one)."""
    default = blocks.block_path, spans.CAUSAL_PIECE, cuda_blocks.OPS, cuda_blocks.kernel_for
    blocks.block_path = lambda q: {"ref": "ref", "cuda-flash": "cuda", "cuda-efficient": "cuda"}.get(path, "cpu")
    spans.CAUSAL_PIECE = 2 if path == "pieces" else default[1]
    cuda_blocks.OPS = sdpa_lookalikes.OPS
    cuda_blocks.kernel_for = lambda q, masked: "efficient" if masked or path == "cuda-efficient" else "flash"
    try:
        yield
    finally:
        blocks.block_path, spans.CAUSAL_PIECE, cuda_blocks.OPS, cuda_blocks.kernel_for = default


def _all_cases(cp: int, comm: str) -> dict:
    out = {}
    for path in ("kernel", "ref", "pieces", "cuda-flash", "cuda-efficient"):
        with _block_path(path):
            out.update({(path, dtype, docs): _errors(cp, comm, dtype, docs)
                        for dtype in (torch.float32, torch.bfloat16) for docs in (False, True)})
    return out


@pytest.mark.parametrize("comm", ["allgather", "ring"])
@pytest.mark.parametrize("cp", [2, 4])
def test_attention_equals_full_sequence_sdpa(pools, cp, comm):
    """Output and dq, dk, dv of every rank, fp32 and bf16, with and without documents."""
    results = pools(4).run(_all_cases, cp, comm)
    for rank, cases in enumerate(results):
        for (path, dtype, docs), errs in cases.items():
            tol = FP32_TOL if dtype == torch.float32 else BF16_TOL
            assert max(errs) < tol, (f"rank {rank} {path} {dtype} docs={docs}: out, dq, dk, dv off "
                                     f"by {errs} (tolerance {tol})")


def _allgather_events(cp: int) -> list[tuple]:
    """The all-gather mode's collectives and block runs, in the order they happen."""
    events = []

    class Traced:
        def __init__(self, work, name):
            self.work, self.name = work, name

        def wait(self):
            events.append(("wait", self.name))
            return self.work.wait()

    def traced(fn, name):
        def call(*args, **kwargs):
            events.append(("issue", name, kwargs.get("async_op")))
            return Traced(fn(*args, **kwargs), name)
        return call

    def spans_of(fn, name, at):  # at: the position of the K/V's chunk indices among fn's arguments
        def call(*args):
            events.append((name, "own" if tuple(args[at]) == head_tail_chunks(cp, r) else "others"))
            return fn(*args)
        return call

    group = _cp_group(cp)
    r = dist.get_rank(group)
    saved = {n: getattr(gathered, n) for n in ("all_gather_flat", "reduce_scatter_flat", "forward_spans",
                                               "backward_spans")}
    gathered.all_gather_flat = traced(saved["all_gather_flat"], "all-gather")
    gathered.reduce_scatter_flat = traced(saved["reduce_scatter_flat"], "reduce-scatter")
    gathered.forward_spans = spans_of(saved["forward_spans"], "forward", 3)
    gathered.backward_spans = spans_of(saved["backward_spans"], "backward", 6)
    try:
        torch.manual_seed(0)
        q, k, v = (torch.randn(2, h, 4 * cp, 8, requires_grad=True) for h in (4, 2, 2))
        context_parallel_attention(q, k, v, group, comm="allgather").sum().backward()
    finally:
        for n, fn in saved.items():
            setattr(gathered, n, fn)
    return events


def test_allgather_mode_runs_the_own_blocks_under_its_collectives(pools):
    """Forward: the K/V all-gather is issued, the blocks of the rank's own chunks run, and
    only then is it waited for; backward: the other chunks' blocks, their dK/dV's
    reduce-scatter issued, the own blocks under it, then the wait."""
    expected = [("issue", "all-gather", True), ("forward", "own"), ("wait", "all-gather"), ("forward", "others"),
                ("backward", "others"), ("issue", "reduce-scatter", True), ("backward", "own"),
                ("wait", "reduce-scatter")]
    for cp in (2, 4):
        assert pools(4).run(_allgather_events, cp) == [expected] * 4


def _ring_backward_events(cp: int) -> list[tuple]:
    """The ring's backward messages (by tag) and block runs (by the K/V's owner), in order."""
    from parallel3d.context_parallel import ring

    group = _cp_group(cp)
    r = dist.get_rank(group)
    events, saved = [], (ring.ring_shift, ring.backward_spans)

    def shift(x, g, tag=0):
        events.append(("send", "K/V" if tag == ring.KV_TAG else "dK/dV"))
        return saved[0](x, g, tag)

    def run_spans(*args):  # args[6]: the global chunks of the K/V at hand; its owner is the cp rank of the first
        events.append(("blocks", "own" if args[6][0] == r else "other"))
        return saved[1](*args)

    torch.manual_seed(0)
    q, k, v = (torch.randn(2, h, 4 * cp, 8, requires_grad=True) for h in (4, 2, 2))
    out = context_parallel_attention(q, k, v, group, comm="ring")
    ring.ring_shift, ring.backward_spans = shift, run_spans
    try:
        out.sum().backward()
    finally:
        ring.ring_shift, ring.backward_spans = saved
    return events


def test_ring_backward_sends_cp_minus_1_accumulators_and_hides_the_last(pools):
    """Backward of the ring: cp - 1 K/V sends and cp - 1 dK/dV sends (the owner's share
    stays home); the own chunks' blocks run first and last, the last after the final
    dK/dV message is posted, so that it runs under them."""
    for cp in (2, 4):
        for events in pools(4).run(_ring_backward_events, cp):
            sends = [e[1] for e in events if e[0] == "send"]
            assert sends.count("K/V") == cp - 1 and sends.count("dK/dV") == cp - 1, events
            assert events[-2:] == [("send", "dK/dV"), ("blocks", "own")], events
            assert events[:2] == [("send", "K/V"), ("blocks", "own")], events


def _mha(cp: int, comm: str) -> list[float]:
    return _errors(cp, comm, torch.float32, True, heads=(2, 2))


def test_multi_head_attention_without_grouping(pools):
    for comm in ("allgather", "ring"):
        for errs in pools(4).run(_mha, 4, comm):
            assert max(errs) < FP32_TOL, (comm, errs)


@pytest.mark.parametrize("kind", [FULL, CAUSAL])
def test_a_block_by_the_cpu_kernel_equals_the_explicit_math(kind):
    """One block, 37 queries x 37 keys (odd), 6 heads on 2 kv-heads, with documents
    that leave some rows without a visible key (lse -inf, output 0, as the merge needs),
    forward and backward from a row's lse / output. fp32: sums in another order."""
    torch.manual_seed(1)
    q, d_out = torch.randn(2, 6, 37, 16), torch.randn(2, 6, 37, 16)
    k, v = torch.randn(2, 2, 37, 16), torch.randn(2, 2, 37, 16)
    q_docs = torch.tensor([[0] * 10 + [1] * 27, [2] * 37])  # row 1: no key of its document
    k_docs = torch.tensor([[0] * 5 + [1] * 32, [1] * 37])
    one_doc = blocks.block_mask(torch.zeros(2, 37), torch.zeros(2, 37))  # a plain window's
    for same_doc in (None, one_doc, blocks.block_mask(q_docs, k_docs)):
        out, lse = blocks.block_forward(q, k, v, kind, same_doc, 0.25)
        out_ref, lse_ref = blocks.block_forward_ref(q, k, v, kind, same_doc, 0.25)
        torch.testing.assert_close(lse, lse_ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(out, out_ref, rtol=1e-5, atol=1e-5)
        row_lse = torch.where(lse.isinf(), torch.ones_like(lse), lse + 0.5)  # as if merged with more
        delta = (d_out * out).sum(-1)
        grads = blocks.block_backward(q, k, v, out, d_out, row_lse, delta, kind, same_doc, 0.25)
        grads_ref = blocks.block_backward_ref(q, k, v, d_out, row_lse, delta, kind, same_doc, 0.25)
        for g, g_ref in zip(grads, grads_ref):
            torch.testing.assert_close(g, g_ref, rtol=1e-5, atol=1e-5)
    assert lse_ref[1].isinf().all() and not lse_ref[0].isinf().any()  # the last case: empty rows


def test_causal_blocks_in_uneven_rows_equal_sdpa(monkeypatch):
    """The all-gather mode's local part (both cp 2 ranks in this process, the K/V given
    whole) with its causal blocks of c = 10 tokens cut into rows of 3, 3 and 4
    (``CAUSAL_PIECE`` 3): output and gradients against causal SDPA, fp32."""
    monkeypatch.setattr(spans, "CAUSAL_PIECE", 3)
    torch.manual_seed(4)
    S = 40
    q, d_out = torch.randn(2, 4, S, 8), torch.randn(2, 4, S, 8)
    kv = torch.randn(2, 2, 2, S, 8, requires_grad=True)
    ref_q = q.clone().requires_grad_()
    ref = F.scaled_dot_product_attention(ref_q, kv[0], kv[1], is_causal=True, enable_gqa=True)
    ref_kv_grad, = torch.autograd.grad(ref, kv, d_out, retain_graph=True)
    ref.backward(d_out)
    kv.grad = None
    for r in range(2):
        q_r = shard_sequence(q, 2, r, dim=2).requires_grad_()
        out = gathered_attention(q_r, kv, 2, r)
        out.backward(shard_sequence(d_out, 2, r, dim=2))
        torch.testing.assert_close(out, shard_sequence(ref, 2, r, dim=2), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(q_r.grad, shard_sequence(ref_q.grad, 2, r, dim=2), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(kv.grad, ref_kv_grad, rtol=1e-5, atol=1e-5)  # summed over the ranks
    calls = spans._calls((0, 1), (0, 1), CAUSAL, None, 10)
    assert [(r.start, r.stop, c.start, c.stop, kind) for r, c, kind, _ in calls] == [
        (0, 3, 0, 3, CAUSAL), (3, 6, 0, 3, FULL), (3, 6, 3, 6, CAUSAL), (6, 10, 0, 6, FULL), (6, 10, 6, 10, CAUSAL)]


def test_cp_1_is_plain_attention():
    """No group: causal or document-masked SDPA on the whole sequence."""
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 12, 8), torch.randn(2, 2, 12, 8), torch.randn(2, 2, 12, 8)
    positions = _packed_positions(24)[:, :12]
    out = context_parallel_attention(q, k, v, None, doc_starts=document_keys(positions, 1, 0))
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=document_mask(positions), enable_gqa=True)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)


def _plain_window_documents() -> tuple[bool, bool, bool]:
    hook = ContextParallelAttention(dist.group.WORLD, "ring")
    r = dist.get_rank()
    plain = shard_positions(32, 2, r).expand(2, 16)
    packed = shard_sequence(_packed_positions(32), 2, r, dim=1)
    return (hook._documents(plain) is None, isinstance(hook._documents(packed), DocumentStarts),
            hook._documents(packed) is hook._documents(packed))


def test_a_plain_window_needs_no_document_work(pools):
    """The hook's positions of an unpacked window (global positions): no document starts
    at all (no mask, no check per block); a packed window's are derived once for all the
    layers of a forward (the same positions tensor)."""
    assert pools(2).run(_plain_window_documents) == [(True, True, True)] * 2


def test_merge_equals_the_log_sum_exp_formula():
    """The in-place merge (lerp by sigmoid weights) against ``O = O_1 e^(lse_1 - lse) +
    O_2 e^(lse_2 - lse)``, with rows that have no key on one side or on both (0 / -inf
    kept, no NaN). fp32: the same sums in another order."""
    torch.manual_seed(2)
    out, out_b = torch.randn(2, 3, 5, 4), torch.randn(2, 3, 5, 4)
    lse, lse_b = torch.randn(2, 3, 5) * 3, torch.randn(2, 3, 5) * 3
    lse[0, 0, :2] = lse_b[0, 0, 1:3] = float("-inf")  # row 1: neither side has a key
    out[0, 0, :2] = out_b[0, 0, 1:3] = 0
    new = torch.logaddexp(lse, lse_b)
    ref_lse = new.masked_fill(new == float("-inf"), 0)
    want = out * torch.exp(lse - ref_lse).unsqueeze(-1) + out_b * torch.exp(lse_b - ref_lse).unsqueeze(-1)
    blocks.merge_(out, lse, out_b, lse_b)
    torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(lse, new, rtol=0, atol=0)
    assert not out.isnan().any() and out[0, 0, 1].eq(0).all() and lse[0, 0, 1] == float("-inf")
