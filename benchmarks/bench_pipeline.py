"""Measured pipeline bubble against the simulator and theory, for every schedule.

    python benchmarks/bench_pipeline.py [--pp 4] [--micro-batches 8] [--t-fwd 0.1] [--steps 3]
                                        [--rounds 2]

A balanced synthetic workload (``parallel3d.pipeline.synthetic``): every stage's forward
sleeps ``t_fwd`` and its backward ``2 t_fwd``; with ``v`` chunks per stage each chunk sleeps
``1/v`` of that, so every layout does the same work per stage. Zero-bubble schedules split
that backward into B (input gradient) and W (weight gradient), ``t_fwd`` each. It runs the
real runtime (``PipelineSchedule``) and point-to-point path on ``pp`` gloo processes, the
schedules' steps alternating (one step of each in turn, the order rotated every round, so
a change of the machine's load falls on all alike), and reports per schedule:

* the bubble the timeline measures (idle share of each stage's step window, mean over
  stages, median over steps after one warm-up step), with the forward / B / W shares;
* the simulator's bubble for the same plan and costs (``pipeline/simulate.py``);
* theory: ``(p-1)/(m+p-1)`` (gpipe, 1f1b), ``(p-1)/(v m+p-1)`` (interleaved),
  ``(p-1)/(3m+p-1)`` (zb-h1), ``(p-1)/(6m+p-1)`` (zb-v, m >= 2p-1);
* the planner's prediction from the costs *measured* in the same steps (median F, B, W
  span per stage: ``planner.timing.bubble_fraction``), against the measured bubble.

Sleeping instead of computing keeps the stage costs fixed when more processes than cores
share the machine; what remains on top of the simulator is the real overhead of the
runtime and of gloo's sends and receives (a process woken late after a receive).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from parallel3d.pipeline.partition import rank_chunks
from parallel3d.pipeline.runtime import PipelineSchedule
from parallel3d.pipeline.schedules import SPLIT_BACKWARD
from parallel3d.pipeline.simulate import simulate, theoretical_bubble
from parallel3d.pipeline.synthetic import FixedCostChunk, mean_loss
from parallel3d.planner.timing import bubble_fraction
from parallel3d.testing import ProcessGroupPool
from parallel3d.topology import Topology

SHAPE = (1, 8, 16)  # (micro_batch, seq_len, dim) of the synthetic activations
SCHEDULES = (("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1), ("zb-v", 2))


def costs(name: str, v: int, t_fwd: float) -> tuple[float, float, float]:
    """(F, B, W) seconds of one chunk: a stage's backward is 2 t_fwd, split B = W = t_fwd
    when the schedule splits it."""
    if name in SPLIT_BACKWARD:
        return t_fwd / v, t_fwd / v, t_fwd / v
    return t_fwd / v, 2 * t_fwd / v, 0.0


def build(topo: Topology, name: str, v: int, t_fwd: float) -> PipelineSchedule:
    f, b, w = costs(name, v, t_fwd)
    chunks = [FixedCostChunk(f, b, SHAPE[-1], first=c == 0, t_w=w)
              for c in rank_chunks(topo.pp_rank, topo.pp, v, name)]
    return PipelineSchedule(chunks, mean_loss, topo, name=name, virtual_stages=v,
                            activation_shape=SHAPE, activation_dtype=torch.float32,
                            device=torch.device("cpu"))


def measure(pp: int, schedules, m: int, t_fwd: float, steps: int) -> dict:
    """On every rank: one warm-up step and ``steps`` steps of each schedule, alternating;
    per schedule the per-step bubbles and shares and this rank's median F, B, W spans."""
    topo = Topology(1, pp, 1)
    built = {name: build(topo, name, v, t_fwd) for name, v in schedules}
    tokens = torch.zeros(SHAPE[:2], dtype=torch.long)
    out = {name: {"metrics": [], "spans": {"F": [], "B": [], "W": []}} for name in built}
    for step in range(steps + 1):
        order = list(built)[step % len(built):] + list(built)[:step % len(built)]
        for name in order:
            sched = built[name]
            sched.timeline.record_steps = 10**9
            sched.run([(tokens, tokens)] * m)
            metrics = sched.step_metrics()
            if step == 0:
                continue
            out[name]["metrics"].append(metrics)
            for span_name, _, _, t0, t1, args in sched.timeline.export()[-1]["spans"]:
                # a first chunk's undivided backward (B and W in one span) says nothing of
                # either alone: the other chunks' B and W spans do
                if span_name[:1] in "FBW" and span_name[1:2].isdigit() and not args.get("with_weight"):
                    out[name]["spans"][span_name[0]].append(t1 - t0)
    for name in out:
        out[name]["peak_alive"] = built[name].peak_alive
        # a stage's F, B, W per micro-batch: the median chunk span times the chunks per rank
        # (None where this rank ran no such span: zb-h1's first stage has no split backward)
        v = dict(schedules)[name]
        out[name]["stage_costs"] = tuple(v * statistics.median(s) if s else None
                                         for s in out[name]["spans"].values())
    return out


def slowest_stage_costs(ranks: list[dict], name: str) -> tuple[float, float, float]:
    """(F, B, W) of the slowest stage: each the largest over the ranks that measured it
    (an unsplit schedule has no W: 0)."""
    per_rank = [r[name]["stage_costs"] for r in ranks]
    return tuple(max((c[k] for c in per_rank if c[k] is not None), default=0.0) for k in range(3))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pp", type=int, default=4)
    parser.add_argument("--micro-batches", type=int, default=8)
    parser.add_argument("--t-fwd", type=float, default=0.1, help="forward seconds per stage")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--schedules", default=",".join(n for n, _ in SCHEDULES))
    args = parser.parse_args()
    p, m = args.pp, args.micro_batches
    wanted = [(n, v) for n, v in SCHEDULES if n in args.schedules.split(",")]
    pool = ProcessGroupPool(p)
    try:
        ranks = pool.run(measure, p, wanted, m, args.t_fwd, args.steps)
    finally:
        pool.close()
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, load average "
          f"{os.getloadavg()[0]:.1f}; pp={p} m={m} forward {args.t_fwd * 1e3:.0f} ms + backward "
          f"{2 * args.t_fwd * 1e3:.0f} ms per stage (split: B {args.t_fwd * 1e3:.0f} + W "
          f"{args.t_fwd * 1e3:.0f} ms), {args.steps} steps alternating (median), gloo on CPU")
    print(f"{'schedule':<12} {'v':>2} {'measured':>9} {'sim':>7} {'meas/sim':>9} {'theory':>7} "
          f"{'planner*':>9} {'meas/plan':>10} {'F':>5} {'B':>5} {'W':>5} {'alive r0':>9}")
    rows = {}
    for name, v in wanted:
        per_step = [statistics.mean(r[name]["metrics"][s]["bubble_fraction"] for r in ranks)
                    for s in range(args.steps)]
        measured = statistics.median(per_step)
        shares = {k: statistics.median(statistics.mean(r[name]["metrics"][s][f"{k}_fraction"] for r in ranks)
                                       for s in range(args.steps)) for k in ("forward", "backward", "weight")}
        sim = simulate(name, p, v, m, *costs(name, v, args.t_fwd)).mean_bubble()
        try:
            theory = f"{theoretical_bubble(name, p, v, m):7.4f}"
        except ValueError:
            theory = f"{'-':>7}"
        # planner from the measured costs of the slowest stage
        f, b, w = slowest_stage_costs(ranks, name)
        planned = bubble_fraction(name, p, v, m, f, b, w)
        rows[name] = measured
        print(f"{name:<12} {v:>2} {measured:>9.4f} {sim:>7.4f} {measured / sim:>9.3f} {theory} "
              f"{planned:>9.4f} {measured / planned:>10.3f} {shares['forward']:>5.2f} "
              f"{shares['backward']:>5.2f} {shares['weight']:>5.2f} {ranks[0][name]['peak_alive']:>9}")
    print("planner*: planner.timing.bubble_fraction from the F, B, W spans measured in the same steps")
    for zb in ("zb-h1", "zb-v"):
        if zb in rows and "1f1b" in rows:
            print(f"{zb} / 1f1b bubble: measured {rows[zb] / rows['1f1b']:.2f}")


if __name__ == "__main__":
    main()
