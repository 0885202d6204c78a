"""Measured pipeline bubble against theory, for gpipe, 1f1b and interleaved.

    python benchmarks/bench_pipeline.py [--pp 4] [--micro-batches 8] [--t-fwd 0.1] [--steps 3]

A balanced synthetic workload (``parallel3d.pipeline.synthetic``): every stage's forward
sleeps ``t_fwd`` and its backward ``2 t_fwd``; with ``v`` virtual stages each chunk sleeps
``1/v`` of that, so every layout does the same work per stage. It runs the real runtime
(``PipelineSchedule``) and point-to-point path on ``pp`` gloo processes, and reports the
bubble the timeline measures (idle share of each stage's step window, mean over stages,
median over steps after one warm-up step) next to

    theory = (p - 1) / (m + p - 1)      gpipe, 1f1b
             (p - 1) / (v m + p - 1)    interleaved (each chunk does 1/v of the work)

Sleeping instead of computing keeps the stage costs fixed when more processes than cores
share the machine; what remains on top of theory is the real overhead of the runtime and
of gloo's sends and receives.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from parallel3d.pipeline.runtime import PipelineSchedule
from parallel3d.pipeline.simulate import theoretical_bubble
from parallel3d.pipeline.synthetic import FixedCostChunk, mean_loss
from parallel3d.testing import ProcessGroupPool
from parallel3d.topology import Topology

SHAPE = (1, 8, 16)  # (micro_batch, seq_len, dim) of the synthetic activations


def measure(pp: int, name: str, v: int, m: int, t_fwd: float, steps: int) -> dict:
    """On every rank: run ``steps + 1`` steps, return per-step bubbles and peak alive."""
    topo = Topology(1, pp, 1)
    chunks = [FixedCostChunk(t_fwd / v, 2 * t_fwd / v, SHAPE[-1], first=(topo.pp_rank == 0 and j == 0))
              for j in range(v)]
    schedule = PipelineSchedule(chunks, mean_loss, topo, name=name, virtual_stages=v,
                                activation_shape=SHAPE, activation_dtype=torch.float32,
                                device=torch.device("cpu"))
    tokens = torch.zeros(SHAPE[:2], dtype=torch.long)
    bubbles = []
    for _ in range(steps + 1):
        schedule.run([(tokens, tokens)] * m)
        bubbles.append(schedule.timeline.last_bubble)
    return {"bubbles": bubbles[1:], "peak_alive": schedule.peak_alive}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pp", type=int, default=4)
    parser.add_argument("--micro-batches", type=int, default=8)
    parser.add_argument("--t-fwd", type=float, default=0.1, help="forward seconds per stage")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    p, m = args.pp, args.micro_batches
    pool = ProcessGroupPool(p)
    rows = {}
    try:
        for name, v in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2)):
            ranks = pool.run(measure, p, name, v, m, args.t_fwd, args.steps)
            per_step = [statistics.mean(r["bubbles"][s] for r in ranks) for s in range(args.steps)]
            rows[name] = (v, statistics.median(per_step), theoretical_bubble(name, p, v, m),
                          ranks[0]["peak_alive"])
    finally:
        pool.close()
    print(f"pp={p} m={m} forward {args.t_fwd * 1e3:.0f} ms + backward {2 * args.t_fwd * 1e3:.0f} ms "
          f"per stage, {args.steps} steps (median), gloo on CPU")
    print(f"{'schedule':<12} {'v':>2} {'measured':>9} {'theory':>8} {'meas/theory':>12} "
          f"{'alive on stage 0':>17}")
    for name, (v, measured, theory, alive) in rows.items():
        print(f"{name:<12} {v:>2} {measured:>9.4f} {theory:>8.4f} {measured / theory:>12.3f} {alive:>17}")
    ratio = rows["1f1b"][1] / rows["interleaved"][1]
    print(f"1f1b / interleaved bubble: measured {ratio:.2f}x, theory "
          f"{rows['1f1b'][2] / rows['interleaved'][2]:.2f}x")


if __name__ == "__main__":
    main()
