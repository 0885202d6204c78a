"""The autopilot on the default job: `parallel3d train` with `train.autopilot=true` beside
the same job staying at tp 2 x pp 2 x dp 2, alternating rounds.

    python benchmarks/bench_autopilot.py [--rounds 2] [--out DIR]

Each round runs the embedded default (recipes/debug_cpu.toml: 8 processes, 200 steps)
twice through the CLI, once with the autopilot and once without, the order swapped every
round so that drift of the machine's load falls on both. Held-out evaluation is off in
both (it would put the same extra pause in both curves). Per round it reports

* where and when the autopilot moved, the step time it predicted for the new layout and
  the median it then measured (the autopilot's own check, over its measured window), and
  their ratio: the prediction's error;
* the steady state: the median step time over steps ``--steady-from``..200 of each run
  (after the autopilot's check of the move), and the gain ``1 - autopilot / staying``;
* the largest relative difference between the two runs' per-step losses, all 200 steps
  (every layout computes the same numbers up to fp32 reassociation: the bar is 1e-5);
* the wall time of each run, start-up included.

The load average before and after is printed with the table (the machine is shared).
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


def run(run_dir: Path, autopilot: bool) -> dict:
    cmd = [sys.executable, "-m", "parallel3d.cli", "train", f"--run.dir={json.dumps(str(run_dir))}",
           "--eval.interval=0", "--observability.progress=\"off\"", f"--train.autopilot={str(autopilot).lower()}"]
    t0 = time.perf_counter()
    log = run_dir.parent / f"{run_dir.name}.log"
    with open(log, "w") as f:
        code = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT).returncode
    wall = time.perf_counter() - t0
    if code != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({code}):\n" + "\n".join(log.read_text().splitlines()[-20:]))
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {"records": [r for r in lines if "event" not in r], "events": [r for r in lines if "event" in r],
            "wall_s": wall}


def rel_diff(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steady-from", type=int, default=60)
    parser.add_argument("--out", default=None, help="keep the runs here (default: a temporary folder)")
    args = parser.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="bench-autopilot-"))
    out.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()
    rows = []
    for r in range(args.rounds):
        order = (True, False) if r % 2 == 0 else (False, True)
        got = {ap: run(out / f"round{r}-{'autopilot' if ap else 'stay'}", ap) for ap in order}
        pilot, stay = got[True], got[False]
        steady = lambda res: statistics.median(x["step_time_s"] for x in res["records"]  # noqa: E731
                                               if x["step"] >= args.steady_from)
        decision = next(e for e in pilot["events"] if e.get("action") in ("move", "stay") and "terms" in e)
        check = next((e for e in pilot["events"] if e.get("action") in ("confirmed", "move back")), None)
        done = [e for e in pilot["events"] if e.get("action", "").endswith("done")]
        rows.append({
            "round": r, "decision": decision["action"], "step": decision["step"], "from": decision["from"],
            "to": decision["to"], "measured_before_s": decision["measured_step_s"],
            "predicted_s": decision["predicted_step_s"],
            "measured_after_s": check["measured_step_s"] if check else None,
            "check": check["action"] if check else "-", "moves": [(e["step"], e["to"]) for e in done],
            "steady_autopilot_s": steady(pilot), "steady_stay_s": steady(stay),
            "loss_diff": rel_diff([x["loss"] for x in pilot["records"]], [x["loss"] for x in stay["records"]]),
            "steps": (len(pilot["records"]), len(stay["records"])),
            "wall_s": (pilot["wall_s"], stay["wall_s"])})
        print(json.dumps(rows[-1]), flush=True)
    load_after = os.getloadavg()
    print(f"\n{time.strftime('%Y-%m-%d %H:%M')}, load average {load_before[0]:.1f} before, {load_after[0]:.1f} after "
          f"(1 min), {os.cpu_count()} cores")
    print("| round | decision (step) | predicted | measured after | measured / predicted - 1 | steady autopilot | steady staying "
          "| gain | loss diff (200 steps) | wall autopilot / staying |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for x in rows:
        err = (f"{x['measured_after_s'] / x['predicted_s'] - 1:+.0%}" if x["measured_after_s"] else "-")
        after = f"{x['measured_after_s'] * 1e3:.0f} ms ({x['check']})" if x["measured_after_s"] else "-"
        print(f"| {x['round']} | {x['decision']} {x['from']} -> {x['to']} ({x['step']}) | {x['predicted_s'] * 1e3:.0f} ms "
              f"| {after} | {err} | {x['steady_autopilot_s'] * 1e3:.0f} ms | {x['steady_stay_s'] * 1e3:.0f} ms "
              f"| {1 - x['steady_autopilot_s'] / x['steady_stay_s']:.0%} | {x['loss_diff']:.1e} "
              f"| {x['wall_s'][0]:.0f} / {x['wall_s'][1]:.0f} s |")


if __name__ == "__main__":
    main()
