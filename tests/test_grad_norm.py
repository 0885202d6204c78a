"""The squared gradient norm (parallel3d/grad_norm.py) against float64, and its cost in
views: one 2-D piece per tensor (rows of NORM_ROW) and a tail, not thousands of pieces."""

from __future__ import annotations

import torch

from parallel3d.grad_norm import NORM_ROW, norm_pieces, squared_norm


def test_squared_norm_matches_float64_on_long_and_ragged_tensors():
    """6M elements (torch's own CPU fp32 norm drifts by ~1e-4 at this length), in tensors
    whose lengths are not multiples of a row, and a bf16 gradient (squared in fp32). The
    bound, 1e-7, is the fp32 result's own rounding (2^-24 = 6e-8) with a margin: the row
    sums' error is ~1e-9 at these lengths."""
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(n, generator=gen) * 1e-3 for n in (6_000_001, 3 * NORM_ROW, 17)]
    grads.append(torch.randn(5, 333, generator=gen).to(torch.bfloat16))
    exact = sum(g.double().square().sum() for g in grads)
    got = squared_norm(grads, torch.device("cpu"))
    assert got.dtype == torch.float32 and got.shape == ()
    assert abs(got.double() - exact) / exact < 1e-7, (got.item(), exact.item())
    assert squared_norm([], torch.device("cpu")).item() == 0.0


def test_a_billion_elements_are_a_handful_of_views():
    """A rank's 1B-element flat gradient in 16 buckets: one (rows, NORM_ROW) view per
    bucket, a tail only where a bucket is not whole rows (the former 16k-element pieces
    were 65536 views, each a norm and a stacked scalar per step). On the meta device: no
    memory."""
    n = 1 << 30
    buckets = list(torch.empty(n, device="meta").split(n // 16))
    pieces = norm_pieces(buckets)
    assert len(pieces) == 16 and all(p.shape == (n // 16 // NORM_ROW, NORM_ROW) for p in pieces)
    ragged = norm_pieces([torch.empty(NORM_ROW * 3 + 5, device="meta"), torch.empty(7, device="meta")])
    assert [tuple(p.shape) for p in ragged] == [(3, NORM_ROW), (1, 5), (1, 7)]
