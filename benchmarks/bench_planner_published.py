"""Planner-predicted MFU vs the published MFU of large training runs.

    python benchmarks/bench_planner_published.py

For each published run, the planner searches every variant of the published tp/pp/dp
(micro-batch, schedule, virtual stages, ZeRO, sequence parallelism; recomputation too
unless the source states it) and keeps the fastest that fits the GPU; its predicted MFU
is printed beside the published one, with the source of each figure. The compute
efficiency is the planner's default, inverted once from the anchor run (printed first),
which is not one of the runs compared. Acceptance: |predicted - published| <= 10 points.

The last column gives the time model's MFU for the same layout without recomputation,
memory aside, to separate the time model's error from the memory model's verdict.
"""

from __future__ import annotations

from dataclasses import replace

from parallel3d.planner.calibrate import default_efficiency
from parallel3d.planner.hardware import gpu_named
from parallel3d.planner.published import ANCHOR, PUBLISHED
from parallel3d.planner.search import recommend, search
from parallel3d.planner.timing import step_time


def run(out=print) -> list[dict]:
    eff = default_efficiency()
    out(f"anchor: {ANCHOR.name}: published MFU {ANCHOR.mfu:.1%} ({ANCHOR.how}; {ANCHOR.source})")
    out(f"        -> compute efficiency {eff.compute:.3f} of peak, used for every GPU below\n")
    rows = []
    out(f"{'run':46s} {'planner layout':52s} {'pred':>6s} {'publ':>6s} {'diff':>6s} {'no-rc':>6s}")
    for pub in PUBLISHED:
        fixed = {"tp": pub.tp, "pp": pub.pp, "dp": pub.dp}
        if pub.recompute:
            fixed["recompute"] = pub.recompute
        gpu = gpu_named(pub.gpu)
        best = recommend(search(pub.work, pub.n_gpus, pub.gpus_per_node, gpu, eff, fixed))
        if best is None:
            out(f"{pub.name:46s} NOT FEASIBLE in the planner")
            rows.append({"run": pub.name, "feasible": False})
            continue
        no_rc = step_time(pub.work, replace(best.layout, recompute="none"), gpu, pub.gpus_per_node, eff).mfu
        diff = best.time.mfu - pub.mfu
        out(f"{pub.name:46s} {best.layout.describe():52s} {best.time.mfu:6.1%} {pub.mfu:6.1%} "
            f"{diff * 100:+5.1f}p {no_rc:6.1%}")
        out(f"    published: {pub.how}; {pub.source}")
        rows.append({"run": pub.name, "feasible": True, "predicted": best.time.mfu, "published": pub.mfu})
    worst = max(abs(r["predicted"] - r["published"]) for r in rows if r["feasible"])
    out(f"\nworst |predicted - published| = {worst * 100:.1f} points (acceptance: <= 10)")
    return rows


if __name__ == "__main__":
    run()
