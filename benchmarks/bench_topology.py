"""Start-up cost of the process groups: a Topology with no group for an axis of degree 1
against one that also makes the singleton groups (the earlier behaviour), alternating.

    python benchmarks/bench_topology.py [--rounds 6] [--layouts 1x1x8,2x4x1,8x1x1,2x2x2]

On 8 gloo ranks, each round builds the topology of each layout (tp x pp x dp) both ways,
in alternating order, each after a barrier; the time is the slowest rank's (``new_group``
is collective over the world, so the job waits for that one), and the groups are
destroyed after each build. It prints, per layout, the groups made and the median time
of each way, and their ratio.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch.distributed as dist

from parallel3d.distributed import all_reduce
from parallel3d.testing import ProcessGroupPool
from parallel3d.topology import Topology


class _WithSingletons(Topology):
    """Every axis gets groups, one per rank where its degree is 1 (the earlier Topology)."""

    def grouped_axes(self) -> tuple[str, ...]:
        return ("tp", "dp", "pp", "mp") + (("embed",) if self.pp > 1 else ())


def build(tp: int, pp: int, dp: int, singletons: bool) -> dict:
    import torch

    dist.barrier()
    t0 = time.perf_counter()
    topo = (_WithSingletons if singletons else Topology)(tp, pp, dp)
    seconds = torch.tensor([time.perf_counter() - t0])
    made = sum(len(topo.grid.all_groups(a)) for a in topo.grouped_axes())
    for axis in ("tp", "dp", "pp", "mp", "embed"):
        group = getattr(topo, f"{axis}_group")
        if group is not None:
            dist.destroy_process_group(group)
    all_reduce(seconds, dist.group.WORLD, dist.ReduceOp.MAX)
    return {"seconds": float(seconds), "groups": made}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--layouts", default="1x1x8,2x4x1,8x1x1,2x2x2")
    args = parser.parse_args()
    layouts = [tuple(int(x) for x in text.split("x")) for text in args.layouts.split(",")]
    pool = ProcessGroupPool(8)
    times: dict = {(layout, s): [] for layout in layouts for s in (True, False)}
    groups: dict = {}
    try:
        for i in range(args.rounds):
            for layout in layouts:
                for singletons in ((True, False) if i % 2 == 0 else (False, True)):
                    r = pool.run(build, *layout, singletons)[0]
                    times[layout, singletons].append(r["seconds"])
                    groups[layout, singletons] = r["groups"]
    finally:
        pool.close()
    print(f"{'tp x pp x dp':>12} | {'groups (singletons / none)':>26} | {'ms singletons':>13} | "
          f"{'ms none':>8} | ratio none/singletons")
    for layout in layouts:
        old = statistics.median(times[layout, True])
        new = statistics.median(times[layout, False])
        name = "x".join(map(str, layout))
        print(f"{name:>12} | {groups[layout, True]:>12} / {groups[layout, False]:<11} | "
              f"{old * 1e3:>13.1f} | {new * 1e3:>8.1f} | {new / old:.2f}")


if __name__ == "__main__":
    main()
