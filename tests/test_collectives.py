"""The collective helpers of parallel3d.distributed against torch.distributed's own, on
gloo: the small all-reduce that goes by one all-to-all, and the reduce-scatter by
all-to-all; both must give every rank the same bits."""

from __future__ import annotations

import torch
import torch.distributed as dist

from parallel3d.distributed import GLOO_SMALL_BYTES, all_reduce, reduce_scatter_flat


def _check_all_reduce() -> list[str]:
    rank, p = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(list(range(p)))
    problems = []
    gen = torch.Generator().manual_seed(100 + rank)
    large = GLOO_SMALL_BYTES // (4 * p) + 7  # fp32 elements just past the all-to-all path
    cases = [((), torch.float32), ((3, 5), torch.float64), ((1, 2, 7), torch.float32), ((large,), torch.float32),
             ((33,), torch.int64)]
    for shape, dtype in cases:
        x = (torch.randn(shape, generator=gen, dtype=torch.float64) * 100).to(dtype)
        for op in (dist.ReduceOp.SUM, dist.ReduceOp.MAX, dist.ReduceOp.MIN):
            ours, ref = x.clone(), x.clone()
            out = all_reduce(ours, group, op)
            dist.all_reduce(ref, op=op, group=group)
            if out is not ours:
                problems.append(f"{shape} {dtype} {op}: not in place")
            # fp sums differ from gloo's ring order by rounding only (4 addends of |x| <= ~400:
            # a few ulps, under 1e-6 relative, or 1e-4 absolute where they cancel near 0);
            # max/min and integer sums exactly
            exact = op != dist.ReduceOp.SUM or not dtype.is_floating_point
            if not (torch.equal(ours, ref) if exact else torch.allclose(ours, ref, rtol=1e-6, atol=1e-4)):
                problems.append(f"{shape} {dtype} {op}: {ours.flatten()[:3]} vs {ref.flatten()[:3]}")
            # every rank holds the same bits
            gathered = [torch.empty_like(ours) for _ in range(p)]
            dist.all_gather(gathered, ours)
            if not all(torch.equal(g, ours) for g in gathered):
                problems.append(f"{shape} {dtype} {op}: ranks disagree")
    # reduce-scatter: this rank's slice of the sum
    flat = torch.randn(p * 11, generator=gen)
    out = torch.empty(11)
    reduce_scatter_flat(out, flat, group)
    full = flat.clone()
    dist.all_reduce(full, group=group)
    if not torch.allclose(out, full[rank * 11:(rank + 1) * 11], rtol=1e-6, atol=1e-6):
        problems.append("reduce_scatter_flat differs from the all-reduce's slice")
    return problems


def test_small_all_reduce_and_reduce_scatter_match_torch(pools):
    for rank, problems in enumerate(pools(4).run(_check_all_reduce)):
        assert problems == [], (rank, problems)
