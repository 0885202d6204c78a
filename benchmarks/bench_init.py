"""Counter-based initialisation (``parallel3d.tensor_parallel.init.counter_normal_``) on the
host: seconds for a share of a 1 B-parameter shard, scaled to 1 B, at this process's threads.

    python benchmarks/bench_init.py                          # this checkout
    python benchmarks/bench_init.py --code /tmp/p3d-head     # another checkout (a git worktree)
    python benchmarks/bench_init.py --elements 67108864 --threads 8

It fills one fp32 tensor of ``--elements`` (default 2^25, 1/30 of 1 B) whole, and one
row-parallel block (columns 1/2 of a matrix: the rows generated one by one), and prints
ns per element and the time a 1 B-parameter shard would take at that rate, and a checksum
(the same in every checkout whose values are the same).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--code", default=str(Path(__file__).resolve().parents[1]))
    ap.add_argument("--elements", type=int, default=1 << 25)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args()
    sys.path.insert(0, str(Path(args.code).resolve()))
    import torch

    from parallel3d.tensor_parallel.init import counter_normal_

    if args.threads:
        torch.set_num_threads(args.threads)
    n = args.elements
    whole = torch.empty(n)
    t0 = time.perf_counter()
    counter_normal_(whole, 0.02, seed=1, name="bench.whole")
    whole_s = time.perf_counter() - t0
    cols = 4096
    block = torch.empty(n // cols, cols // 2)
    t0 = time.perf_counter()
    counter_normal_(block, 0.02, seed=1, name="bench.rows", full_shape=(n // cols, cols), dim=1,
                    start=cols // 2)
    rows_s = time.perf_counter() - t0
    print(f"code {args.code}, {torch.get_num_threads()} threads")
    for what, s, count in (("whole tensor", whole_s, n), ("row-parallel block", rows_s, block.numel())):
        print(f"{what}: {count:,} elements in {s:.2f} s = {s / count * 1e9:.1f} ns/element, "
              f"1 B elements: {s / count * 1e9:.0f} s")
    print(f"checksum {float(whole.double().sum()):.10e} {float(block.double().sum()):.10e}")


if __name__ == "__main__":
    main()
