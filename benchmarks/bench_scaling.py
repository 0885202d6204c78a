"""`parallel3d scaling` on the default model: its measured points against separate runs.

    python benchmarks/bench_scaling.py [--pairs 2] [--ranks 1,2,4,8] [--out DIR]

First ``parallel3d scaling --ranks ...`` runs once (timed: the acceptance asks for a few
minutes; its table, extension and flattening point are printed). Then, size by size, the
command's own run of that size (``parallel3d.scaling.sweep.run_size``, what the command
executes for a point: the autopilot measuring, ``act = false``) and a separate plain
``parallel3d train`` at the same layout, steps, global batch and one thread per rank,
``--pairs`` times back to back in alternating order (A B B A ...): on this shared machine
a configuration's step time drifts by 2-3x within minutes, so only runs close in time
compare. A run's step time is the median over the command's measured window. Reported per
size: the median over pairs of each side, their ratio, and the spread of the separate
runs (the noise floor of the comparison).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from parallel3d.scaling.sweep import MEASURE, SKIP


def scaling(out: Path, ranks: str) -> tuple[dict, float]:
    t0 = time.perf_counter()
    log = out.parent / f"{out.name}.log"
    with open(log, "w") as f:
        code = subprocess.run([sys.executable, "-m", "parallel3d.cli", "scaling", "--ranks", ranks,
                               "--out", str(out)], stdout=f, stderr=subprocess.STDOUT).returncode
    if code:
        raise SystemExit(f"scaling failed ({code}):\n{log.read_text()[-3000:]}")
    return json.loads((out / "scaling.json").read_text()), time.perf_counter() - t0


def separate(point: dict, run_dir: Path) -> float:
    """The median step of a plain run at ``point``'s layout over the command's window."""
    config = json.loads((Path(point["run_dir"]) / "config.json").read_text())
    par, train = config["parallel"], config["train"]
    keys = {"parallel": {k: par[k] for k in ("tp", "pp", "dp", "schedule", "virtual_stages", "zero",
                                             "sequence_parallel")},
            "train": {"global_batch": train["global_batch"], "micro_batch": train["micro_batch"],
                      "recompute": train["recompute"], "steps": SKIP + MEASURE + 1, "autopilot": False},
            "launch": {"nproc": point["ranks"], "threads_per_proc": config["launch"]["threads_per_proc"]},
            "eval": {"interval": 0}, "checkpoint": {"interval": 0, "resume": "never"},
            "observability": {"progress": "off"}, "run": {"dir": str(run_dir)}}
    cmd = [sys.executable, "-m", "parallel3d.cli", "train",
           *[f"--{s}.{k}={json.dumps(v)}" for s, kv in keys.items() for k, v in kv.items()]]
    with open(run_dir.parent / f"{run_dir.name}.log", "w") as f:
        if subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT).returncode:
            raise SystemExit(f"{' '.join(cmd)} failed")
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return statistics.median(r["step_time_s"] for r in records if SKIP < r.get("step", 0) <= SKIP + MEASURE)


def main() -> None:
    from parallel3d.planner.spec import Layout
    from parallel3d.scaling.sweep import run_size

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--ranks", default="1,2,4,8")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="bench-scaling-"))
    out.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()
    data, wall = scaling(out / "scaling", args.ranks)
    print((out / "scaling" / "scaling.txt").read_text(), flush=True)
    from parallel3d.cli import default_recipe

    rows = []
    for p in data["points"]:
        n, cfg = p["ranks"], json.loads((Path(p["run_dir"]) / "config.json").read_text())
        par, train = cfg["parallel"], cfg["train"]
        layout = Layout(tp=par["tp"], pp=par["pp"], dp=par["dp"], micro_batch=train["micro_batch"],
                        schedule=par["schedule"], virtual_stages=par["virtual_stages"], zero=par["zero"],
                        recompute=train["recompute"], sequence_parallel=par["sequence_parallel"])
        mine, theirs = [], []
        for i in range(args.pairs):
            order = ("command", "separate") if i % 2 == 0 else ("separate", "command")
            for side in order:
                run_dir = out / f"n{n}-{side}{i}"
                if side == "command":
                    mine.append(run_size(default_recipe(), [], n, layout, train["global_batch"], train["seq_len"],
                                         run_dir, lambda line: None).step_s)
                else:
                    theirs.append(separate(p, run_dir))
        rows.append((n, p["layout"], statistics.median(mine), statistics.median(theirs), theirs))
        print(f"{n} ranks: command {[round(x * 1e3) for x in mine]} ms, separate {[round(x * 1e3) for x in theirs]} ms",
              flush=True)
    load_after = os.getloadavg()
    print(f"\n{time.strftime('%Y-%m-%d %H:%M')}, load average {load_before[0]:.1f} before, {load_after[0]:.1f} "
          f"after (1 min), {os.cpu_count()} cores; the command took {wall:.0f} s")
    print("| ranks | layout | command's run: median step | separate run | command / separate | separate runs' spread |")
    print("|---|---|---|---|---|---|")
    for n, layout, mine, theirs, all_theirs in rows:
        spread = max(all_theirs) / min(all_theirs) - 1
        print(f"| {n} | {layout} | {mine * 1e3:.0f} ms | {theirs * 1e3:.0f} ms | {mine / theirs:.2f} | {spread:.0%} |")


if __name__ == "__main__":
    main()
