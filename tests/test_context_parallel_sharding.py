"""Context parallelism's host-side bookkeeping, in one process: head-tail sharding and
its balanced attention work, the ring's and the all-gather mode's plans and spans (every
block once), the document keys and masks a rank derives from its local positions (and
from the loader's host copy), the choice of mode. The attention itself against
full-sequence SDPA: tests/test_context_parallel.py."""

from __future__ import annotations

import pytest
import torch

from parallel3d.context_parallel import (choose_comm, contiguous_positions, document_keys, head_tail_chunks,
                                         score_elements, shard_documents, shard_positions, shard_sequence,
                                         unshard_sequence)
from parallel3d.context_parallel.attention import ContextParallelAttention
from parallel3d.context_parallel.blocks import CAUSAL, FULL, ring_plan
from parallel3d.context_parallel.documents import SKIP, DocumentStarts
from parallel3d.context_parallel.gathered import gathered_plan, gathered_spans
from parallel3d.context_parallel.ring import ring_spans

from test_context_parallel import _packed_positions


def test_head_tail_sharding_round_trips_with_global_positions():
    S, cp = 16, 2
    x = torch.arange(S).view(1, S)
    assert shard_sequence(x, cp, 0).tolist() == [[0, 1, 2, 3, 12, 13, 14, 15]]
    assert shard_sequence(x, cp, 1).tolist() == [[4, 5, 6, 7, 8, 9, 10, 11]]
    for cp in (1, 2, 4):
        shards = [shard_sequence(x, cp, r) for r in range(cp)]
        assert torch.equal(unshard_sequence(shards), x)
        for r in range(cp):
            assert torch.equal(shard_positions(S, cp, r), shards[r][0])
    with pytest.raises(ValueError, match="multiple of 8"):
        shard_sequence(torch.zeros(1, 12), 4, 0)


def test_document_ids_stay_whole_window_numbers_across_chunks():
    positions = _packed_positions(24)
    ids = [shard_documents(positions, 4, r)[1] for r in range(4)]
    pos = [shard_documents(positions, 4, r)[0] for r in range(4)]
    assert torch.equal(unshard_sequence(ids), (positions == 0).cumsum(-1))
    assert torch.equal(unshard_sequence(pos), positions)
    # rank 1 holds chunk 1 (tokens 3..5: documents 1, 1, 2) of the first row
    assert ids[1][0, :3].tolist() == [1, 1, 2]


@pytest.mark.parametrize("cp", [2, 4])
def test_head_tail_balances_attention_work(cp):
    """Unmasked causal score elements per rank (attention FLOPs / 4DH), S = 4096: head-tail
    within 10% across ranks (exactly equal), contiguous chunks ~(2cp-1)x from first to last.
    Both modes compute exactly the unmasked elements: the blocks of the ring's plan and
    of the all-gather mode's (full c^2, causal c(c+1)/2, fully masked ones skipped) add up
    to the same count on every rank."""
    S = 4096
    c = S // (2 * cp)
    head_tail = [score_elements(shard_positions(S, cp, r)) for r in range(cp)]
    contiguous = [score_elements(contiguous_positions(S, cp, r)) for r in range(cp)]
    assert max(head_tail) / min(head_tail) <= 1.10, head_tail
    assert contiguous[-1] / contiguous[0] >= 2.0, contiguous
    size = {FULL: c * c, CAUSAL: c * (c + 1) // 2}
    ring = [sum(size[kind] for step in ring_plan(cp, r) for _, _, kind in step) for r in range(cp)]
    gathered = [sum(size[kind] for _, _, kind in gathered_plan(cp, r)) for r in range(cp)]
    assert ring == gathered == head_tail
    assert sum(head_tail) == S * (S + 1) // 2

    def span_size(span):  # a FULL span: every pair of its chunks
        (q_lo, q_hi), (k_lo, k_hi), kind = span
        return size[kind] * (q_hi - q_lo) * (k_hi - k_lo)

    ring_as_spans = [sum(span_size(s) for step in ring_spans(cp, r) for s in step) for r in range(cp)]
    gathered_as_spans = [sum(span_size(s) for part in gathered_spans(cp, r) for s in part) for r in range(cp)]
    assert ring_as_spans == gathered_as_spans == head_tail


@pytest.mark.parametrize("cp", [2, 4])
def test_spans_cover_each_block_of_the_plans_once(cp):
    """The spans (one kernel call each) hold exactly the plans' blocks, every (query
    chunk, key chunk) pair once, and are fewer: the ring's later steps one call each."""
    def pairs(spans, chunk=lambda k: k):  # every (query half, global key chunk, kind) of the spans
        return [(qi, chunk(ki), kind) for (q_lo, q_hi), (k_lo, k_hi), kind in spans
                for qi in range(q_lo, q_hi) for ki in range(k_lo, k_hi)]

    for r in range(cp):
        own, others = gathered_spans(cp, r)
        both = pairs(own, lambda k: head_tail_chunks(cp, r)[k]) + pairs(others)
        assert sorted(both) == sorted(gathered_plan(cp, r))  # the all-gather mode's two parts
        assert all(b not in head_tail_chunks(cp, r) for _, b, _ in pairs(others))
        for plan, calls in [(ring_plan(cp, r)[t], ring_spans(cp, r)[t]) for t in range(cp)] + [(None, own + others)]:
            if plan is not None:
                assert sorted(pairs(calls)) == sorted(plan)
            assert all(kind == FULL for (q, k, kind) in calls if q[1] - q[0] > 1 or k[1] - k[0] > 1)
        assert [len(step) for step in ring_spans(cp, r)] == [3] + [1] * (cp - 1)
        assert own == ring_spans(cp, r)[0]  # the own part is the ring's step 0
        assert len(own) + len(others) <= min(5, len(gathered_plan(cp, r)) - 1)  # fewer calls than blocks


@pytest.mark.parametrize("cp", [2, 4])
def test_document_masks_from_the_query_starts_equal_the_document_ids(cp):
    """Every block a rank could run (each local query chunk or both, against every key
    chunk or pair of chunks): the keys visible by the queries' document starts equal the
    pairs of one document by the whole window's ids, under the causal order; a block
    said to need no mask has every causal pair in one document, a skipped one none."""
    S, g = 24, torch.Generator().manual_seed(0)
    c = S // (2 * cp)
    # the test's packed windows, and random ones: documents of 1 to 7 tokens starting
    # at every offset within a chunk
    lengths = [torch.randint(1, 8, (S,), generator=g).tolist() for _ in range(8)]  # >= S tokens a row
    rows = [torch.cat([torch.arange(n) for n in row])[:S] for row in lengths]
    windows = torch.cat([_packed_positions(S), torch.stack(rows)])
    seen = set()
    for positions in [windows] + list(windows.split(1)):  # all rows, and each row alone
        ids = (positions == 0).cumsum(-1)  # (B, S)
        for r in range(cp):
            q_pos = shard_positions(S, cp, r)
            docs = DocumentStarts(document_keys(shard_sequence(positions, cp, r), cp, r))
            for units in [(0, 1), (1, 2), (0, 2)]:
                q_rows = q_pos[units[0] * c:units[1] * c]
                for key_chunks in [[b] for b in range(2 * cp)] + [[a, b] for a in range(2 * cp) for b in range(a)]:
                    cols = torch.cat([torch.arange(b * c, (b + 1) * c) for b in key_chunks])
                    causal = cols.unsqueeze(0) <= q_rows.unsqueeze(1)  # (cq, ck)
                    want = (ids[:, q_rows].unsqueeze(-1) == ids[:, cols].unsqueeze(-2)) & causal  # (B, cq, ck)
                    got = docs.block(units, key_chunks)
                    seen.add("none" if got is None else "skip" if got is SKIP else "mask")
                    got = (causal.expand_as(want) if got is None else torch.zeros_like(want) if got is SKIP
                           else got.squeeze(1) & causal)
                    assert torch.equal(got, want), (cp, r, units, key_chunks, positions)
    assert seen == {"none", "skip", "mask"}  # the packed windows reach every outcome


def test_the_document_blocks_are_decided_from_the_loaders_host_copy():
    """A micro-batch moved off the CPU keeps its positions' host copy, and the hook
    decides the document blocks from it, never reading the device tensor (on a GPU that
    read waits for the device in every forward). The meta device stands in for the GPU:
    its tensors have no values, so reading one fails; the bounds equal the CPU ones."""
    from parallel3d.data.batch import MicroBatch

    cp, r = 2, 1
    positions = shard_sequence(_packed_positions(32), cp, r, dim=1)  # (B, 16), packed
    mb = MicroBatch(positions.clone(), positions.clone(), positions).to("meta")
    assert mb.positions.device.type == "meta" and mb.positions.p3d_host is positions
    hook = object.__new__(ContextParallelAttention)  # the hook without a process group
    hook.cp, hook.cp_rank, hook._docs = cp, r, (None, -1, None)
    docs = hook._documents(mb.positions)
    assert docs.starts.device.type == "meta"  # the masks are still built on the device
    assert docs.bounds == DocumentStarts(document_keys(positions, cp, r)).bounds
    with pytest.raises((RuntimeError, NotImplementedError)):  # what the host copy avoids
        DocumentStarts(document_keys(mb.positions, cp, r))


def test_document_keys_from_local_positions_compare_like_document_ids():
    """A rank with only its per-document positions gets keys equal exactly where the whole
    window's document ids are equal (any pair of tokens of any two ranks)."""
    positions = _packed_positions(24)
    for cp in (2, 4):
        keys = unshard_sequence([document_keys(shard_sequence(positions, cp, r), cp, r)
                                 for r in range(cp)])
        ids = (positions == 0).cumsum(-1)
        assert torch.equal(keys.unsqueeze(-1) == keys.unsqueeze(-2), ids.unsqueeze(-1) == ids.unsqueeze(-2))


def test_auto_comm_gathers_under_grouped_query_attention():
    assert choose_comm("auto", 32, 8) == "allgather"
    assert choose_comm("auto", 16, 16) == "ring"
    assert choose_comm("ring", 32, 8) == "ring"
