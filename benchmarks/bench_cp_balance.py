"""Context parallelism's load balance, measured: the attention work of each cp rank with
head-tail chunks (rank i holds chunks i and 2cp-1-i of 2cp) against contiguous ones (rank i
holds the i-th S/cp tokens) (issue 32, acceptance 4).

    python benchmarks/bench_cp_balance.py [--seq 4096] [--cp 2,4] [--rounds 5]

cp gloo ranks, one thread each; q (1, 8, S, 64), k and v on 2 kv-heads, fp32. Each rank
runs the blocks its attention computes (forward and backward through the CPU flash kernel,
``context_parallel.blocks``): head-tail, the all-gather mode's own plan (``gathered_plan``,
2cp+1 blocks of S/2cp; the ring's plan has the same blocks); contiguous, its chunk of S/cp
against the chunks up to it (the causal diagonal one and the full ones before; later ones
skipped alike). No communication: the work alone. The figure is the process CPU time of
the blocks (the ranks share the machine's cores, so wall time would measure the
scheduler), median over rounds, the two layouts alternating; printed per rank with the
max / min over ranks and the last / first ratio.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from parallel3d.context_parallel import head_tail_chunks
from parallel3d.context_parallel.blocks import CAUSAL, FULL, block_backward, block_forward
from parallel3d.context_parallel.gathered import gathered_plan
from parallel3d.testing import ProcessGroupPool

B, H, HKV, D = 1, 8, 2, 64


def _blocks(seq: int, layout: str) -> list[tuple[slice, slice, str]]:
    """(query rows, key rows, kind) of every block this rank computes."""
    r, p = dist.get_rank(), dist.get_world_size()
    if layout == "head-tail":
        c = seq // (2 * p)
        own = head_tail_chunks(p, r)
        return [(slice(own[qi] * c, own[qi] * c + c), slice(b * c, b * c + c), kind)
                for qi, b, kind in gathered_plan(p, r)]
    c = seq // p
    return [(slice(r * c, r * c + c), slice(b * c, b * c + c), CAUSAL if b == r else FULL)
            for b in range(r + 1)]


def cpu_seconds(seq: int, layout: str) -> float:
    """This rank's blocks, forward and backward: process CPU seconds."""
    torch.manual_seed(0)
    q, k, v, d_out = (torch.randn(B, h, seq, D) for h in (H, HKV, HKV, H))
    plan = _blocks(seq, layout)
    dist.barrier()
    t0 = time.process_time()
    for rows, cols, kind in plan:
        out, lse = block_forward(q[:, :, rows], k[:, :, cols], v[:, :, cols], kind, None, D ** -0.5)
        out = out.to(q.dtype)
        delta = (d_out[:, :, rows] * out).sum(-1)
        block_backward(q[:, :, rows], k[:, :, cols], v[:, :, cols], out, d_out[:, :, rows], lse, delta,
                       kind, None, D ** -0.5)
    seconds = time.process_time() - t0
    dist.barrier()
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--cp", default="2,4")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    print(f"attention blocks per rank, forward + backward, S = {args.seq}, (B, H, Hkv, D) = "
          f"({B}, {H}, {HKV}, {D}), fp32: CPU ms, median of {args.rounds} rounds")
    for cp in (int(x) for x in args.cp.split(",")):
        pool = ProcessGroupPool(cp)
        runs: dict[str, list[list[float]]] = {"head-tail": [], "contiguous": []}
        try:
            pool.run(cpu_seconds, 16 * cp, "head-tail")  # warm-up
            for i in range(args.rounds):
                for layout in (("head-tail", "contiguous") if i % 2 == 0 else ("contiguous", "head-tail")):
                    runs[layout].append(pool.run(cpu_seconds, args.seq, layout))
        finally:
            pool.close()
        for layout, rounds in runs.items():
            per_rank = [statistics.median(run[r] for run in rounds) * 1e3 for r in range(cp)]
            print(f"cp {cp} {layout:<11} " + "  ".join(f"{t:7.0f}" for t in per_rank)
                  + f"   max / min {max(per_rank) / min(per_rank):.2f}"
                  + f"   last / first {per_rank[-1] / per_rank[0]:.2f}")


if __name__ == "__main__":
    main()
