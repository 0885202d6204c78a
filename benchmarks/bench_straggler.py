"""A straggler acted on: a pp 2 job whose second stage's "host" is throttled to half its
CPU, with the autopilot rebalancing the stages beside the same job not acting, alternating
rounds (issue 33, acceptance 3). Run as root (cgroup v1's cpu controller):

    python benchmarks/bench_straggler.py [--rounds 2] [--steps 100] [--out DIR]

Each run is ``parallel3d train`` on 2 local processes under ``torchrun --standalone`` (pp 2,
one stage per process). Each process is a "host" of one core: a cgroup of its own
(tests/throttle.py) with a weight (``cpu.shares``, HOST_SHARES) that gives it its core on
this shared machine (the other agents' processes would otherwise leave each rank about
half a core, under which a quota of half a core does not bind); the second one also has a
CFS quota of half a core (5 ms per 10 ms). Both runs have ``train.autopilot`` on with
``autopilot.layouts`` off (no move to other layouts), deciding every 10 + 10 steps on the
straggler checks of every 10th step; the one not acting has ``autopilot.act = false``: it
measures, decides and logs, and never moves. Per round it reports

* the first step at which the throttled rank is named a straggler, in each run;
* the autopilot's decision: step, split before and after, the stages' measured seconds per
  layer unit, the predicted step time against the measured one, and its check of the move;
* the steady state: the median step time over steps ``--steady-from``.. of each run, and the
  gain ``1 - acting / not acting``;
* the largest relative difference of the per-step losses between the two runs (every
  step), and against one process (pp 1, the same job, not throttled, in the first host, run
  once) over the steps up to the move's check, with the first step past 1e-5: fp32's
  reassociation differences of pp 2 against one process grow over a long run whatever
  the split;
* the seconds the quota held the throttled process back, and the wall time of each run.

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

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from throttle import HOST_SHARES, can_throttle, cpu_quota, join, throttled_seconds  # noqa: E402

# 8 micro-batches of 2 (a 1F1B step is m - 1 rounds of the slowest stage and one pass
# through both: with 4, the pass that rebalancing does not shorten is a larger share; with
# micro-batches of 1 the stages were less compute-bound and the quota bound less);
# compute-bound stages (about 45 ms per micro-batch on a stage of one core): a rank that
# waits most of its step would hardly feel a quota. 12 layers: at half speed the whole-layer
# split [8, 4] nearly balances the stages (8 layers had only [5, 3]: 17% predicted)
MODEL = {"preset": "debug", "vocab_size": 512, "n_layers": 12, "dim": 128, "n_heads": 4, "n_kv_heads": 2,
         "ffn_dim": 320}


def job(run_dir: Path, steps: int, act: bool, pp: int = 2) -> list[str]:
    sections = {
        "model": MODEL,
        "train": {"steps": steps, "seed": 7, "global_batch": 16, "micro_batch": 2, "seq_len": 128, "lr": 3e-3,
                  "warmup_steps": 5, "grad_clip": 1.0, "log_interval": 10, "autopilot": pp > 1},
        "parallel": {"tp": 1, "pp": pp, "dp": 1, "schedule": "1f1b"},
        "data": {"max_bytes": 1_000_000, "vocab_size": 512},
        "eval": {"interval": 0},
        "checkpoint": {"interval": 0},
        "observability": {"progress": "off", "straggler_interval": 10},
        "autopilot": {"layouts": False, "rebalance": True, "act": act, "skip_steps": 10, "measure_steps": 10},
        "run": {"dir": str(run_dir)},
    }
    if pp == 1:
        del sections["autopilot"]
    return [f"--{s}.{k}={json.dumps(v)}" for s, keys in sections.items() for k, v in keys.items()]


def _children(pid: int) -> list[int]:
    kids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    kids.append(int(entry.name))
            except (OSError, IndexError, ValueError):
                pass
    return kids


def _rank_of(pid: int) -> int | None:
    try:
        env = (Path("/proc") / str(pid) / "environ").read_bytes().split(b"\0")
    except OSError:
        return None
    ranks = [int(e.split(b"=", 1)[1]) for e in env if e.startswith(b"RANK=")]
    return ranks[0] if ranks else None


def place_ranks(launcher: subprocess.Popen, hosts: list[Path], timeout_s: float = 60.0) -> None:
    """Each worker of ``launcher`` (found by its ``RANK``) into ``hosts[rank]``, as soon as it exists."""
    placed: set[int] = set()
    deadline = time.time() + timeout_s
    while len(placed) < len(hosts) and time.time() < deadline and launcher.poll() is None:
        todo, seen = [launcher.pid], set()
        while todo:
            pid = todo.pop()
            seen.add(pid)
            rank = _rank_of(pid)
            if rank is not None and rank not in placed and rank < len(hosts):
                join(hosts[rank], pid)
                placed.add(rank)
            todo += [k for k in _children(pid) if k not in seen]
        time.sleep(0.05)
    if len(placed) < len(hosts):
        raise SystemExit(f"placed ranks {sorted(placed)} of {len(hosts)} before the job started or ended")


def run(run_dir: Path, steps: int, act: bool, hosts: list[Path] | None, pp: int = 2) -> dict:
    # torchrun's workers carry RANK in the environment they start with (place_ranks reads it)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={pp}",
           "-m", "parallel3d.cli", "train", *job(run_dir, steps, act, pp)]
    log = run_dir.parent / f"{run_dir.name}.log"
    held = throttled_seconds(hosts[-1]) if hosts else 0.0
    t0 = time.perf_counter()
    with open(log, "w") as f:
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd="/tmp", env=env)
        if hosts and pp > 1:
            place_ranks(proc, hosts)
        elif hosts:  # one process: the whole job in the first host
            join(hosts[0], proc.pid)
        code = proc.wait()
    wall = time.perf_counter() - t0
    if code != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({code}):\n" + "\n".join(log.read_text().splitlines()[-20:]))
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {"records": [r for r in lines if "event" not in r], "events": [r for r in lines if "event" in r],
            "wall_s": wall, "held_s": (throttled_seconds(hosts[-1]) - held) if hosts else 0.0}


def rel_diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b), (len(a), len(b))
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def over(a: list[float], b: list[float], bar: float = 1e-5) -> int | None:
    """The first step whose losses differ by more than ``bar`` (relative)."""
    return next((i + 1 for i, (x, y) in enumerate(zip(a, b)) if abs(x - y) / abs(y) > bar), None)


def named_at(res: dict, rank: int = 1) -> int | None:
    return next((r["step"] for r in res["records"] for s in r.get("stragglers", []) if s["rank"] == rank), None)


def summarize(r: int, acting: dict, idle: dict, reference: list[float], steady_from: int) -> dict:
    steady = lambda res: statistics.median(x["step_time_s"] for x in res["records"]  # noqa: E731
                                           if x["step"] >= steady_from)
    moves = [e for e in acting["events"] if e.get("kind") == "rebalance" and e["action"] == "rebalance"]
    check = next((e for e in acting["events"] if e.get("action") in ("confirmed", "move back")), None)
    first = moves[0] if moves else next(e for e in acting["events"] if e.get("kind") == "rebalance")
    losses = lambda res: [x["loss"] for x in res["records"]]  # noqa: E731
    return {"round": r, "named_at": (named_at(acting), named_at(idle)), "decision": first["action"],
            "step": first["step"], "split": first.get("split"), "target": first.get("target_split"),
            "s_per_layer": [round(v * 1e3, 1) for v in first.get("stage_s_per_layer", [])],
            "measured_before_s": first.get("measured_step_s"), "predicted_s": first.get("predicted_step_s"),
            "check": (check["action"], check["measured_step_s"]) if check else None,
            "rebalances": len(moves), "later": [e["action"] for e in acting["events"]
                                                if e.get("kind") == "rebalance" and e["step"] > first["step"]],
            "steady_acting_s": steady(acting), "steady_idle_s": steady(idle),
            "loss_diff": rel_diff(losses(acting), losses(idle)),
            # fp32 ulp differences of pp 2 against one process grow over a long run whatever
            # the split (the two pp 2 runs are compared over every step): the parity bar
            # holds over the steps up to the move's check
            "loss_diff_one_process": max(rel_diff(losses(acting)[:steady_from - 1], reference[:steady_from - 1]),
                                         rel_diff(losses(idle)[:steady_from - 1], reference[:steady_from - 1])),
            "over_1e5_from": (over(losses(acting), reference), over(losses(idle), reference)),
            "held_s": (acting["held_s"], idle["held_s"]), "wall_s": (acting["wall_s"], idle["wall_s"])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--steady-from", type=int, default=41, help="after the decision (20) and its check (40)")
    parser.add_argument("--out", default=None, help="keep the runs here (default: a temporary folder)")
    args = parser.parse_args()
    if can_throttle():
        raise SystemExit(f"bench_straggler: {can_throttle()}")
    out = Path(args.out or tempfile.mkdtemp(prefix="bench-straggler-"))
    out.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()
    rows = []
    with cpu_quota(None, "p3d-host0", HOST_SHARES) as host0, cpu_quota(0.5, "p3d-host1", HOST_SHARES) as host1:
        one = run(out / "one-process", args.steps, False, [host0], pp=1)
        reference = [x["loss"] for x in one["records"]]
        print(f"one process: {statistics.median(x['step_time_s'] for x in one['records']) * 1e3:.0f} ms per step "
              f"(median), {one['wall_s']:.0f} s", flush=True)
        for r in range(args.rounds):
            order = (True, False) if r % 2 == 0 else (False, True)
            got = {act: run(out / f"round{r}-{'acting' if act else 'not-acting'}", args.steps, act, [host0, host1])
                   for act in order}
            rows.append(summarize(r, got[True], got[False], reference, args.steady_from))
            print(json.dumps(rows[-1]), flush=True)
    load_after = os.getloadavg()
    print(f"\n{time.strftime('%Y-%m-%d %H:%M')}, load average {load_before[0]:.1f} before, {load_after[0]:.1f} after "
          f"(1 min), {os.cpu_count()} cores")
    print("| round | straggler named at step (acting / not) | decision (step) | s per layer unit, stage 0 / 1 "
          "| predicted -> measured after | steady acting | steady not acting | gain | loss diff acting vs not "
          f"/ vs one process (steps 1-{args.steady_from - 1}) | past 1e-5 from step (acting / not) "
          "| quota held back (acting / not) | wall (acting / not) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for x in rows:
        check = f"{x['check'][1] * 1e3:.0f} ms ({x['check'][0]})" if x["check"] else "-"
        print(f"| {x['round']} | {x['named_at'][0]} / {x['named_at'][1]} | {x['decision']} {x['split']} -> "
              f"{x['target']} ({x['step']}), then {', '.join(x['later'])} | {x['s_per_layer'][0]} / "
              f"{x['s_per_layer'][1]} ms | {x['measured_before_s'] * 1e3:.0f} ms -> {x['predicted_s'] * 1e3:.0f} ms "
              f"predicted -> {check} | {x['steady_acting_s'] * 1e3:.0f} ms | {x['steady_idle_s'] * 1e3:.0f} ms "
              f"| {1 - x['steady_acting_s'] / x['steady_idle_s']:.0%} | {x['loss_diff']:.1e} / "
              f"{x['loss_diff_one_process']:.1e} | {x['over_1e5_from'][0]} / {x['over_1e5_from'][1]} | {x['held_s'][0]:.0f} / {x['held_s'][1]:.0f} s "
              f"| {x['wall_s'][0]:.0f} / {x['wall_s'][1]:.0f} s |")


if __name__ == "__main__":
    main()
