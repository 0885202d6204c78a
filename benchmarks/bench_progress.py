"""Cost of rank 0's progress bar on a 2x2x2 run: bar forced on vs off, alternating.

    python benchmarks/bench_progress.py [--rounds 4] [--steps 12]

Each round trains the same tiny Llama for ``steps`` steps on 8 gloo ranks (tp 2 x pp 2 x
dp 2), once with ``observability.progress = "on"`` and once with ``"off"`` (log lines
every 1000 steps, so the "off" run prints nothing per step), in alternating order so
drift of the machine's load hits both alike. It reports the median over rounds of

* wall time per step on rank 0 (``fit()``'s wall time over the steps after the first):
  this includes the bar's redraw, which happens after each step's clock stops;
* ``step_time_s`` as recorded (the median over steps after the first),

and the on/off ratio of each. The bar's line goes to rank 0's stdout (this terminal when
run by hand).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

from parallel3d.config import config_from_dict
from parallel3d.testing import ProcessGroupPool
from parallel3d.topology import Topology


def job(run_dir: str, steps: int, progress: str) -> dict:
    return {
        "model": {"preset": "debug", "vocab_size": 512, "n_layers": 4, "dim": 64, "n_heads": 4,
                  "n_kv_heads": 2, "ffn_dim": 160},
        "parallel": {"tp": 2, "pp": 2, "dp": 2},
        "train": {"steps": steps, "global_batch": 16, "micro_batch": 2, "seq_len": 32, "log_interval": 1000},
        "data": {"max_bytes": 1_000_000, "vocab_size": 512},
        "run": {"dir": run_dir},
        "observability": {"progress": progress},
    }


def train(cfg_dict: dict) -> dict:
    from parallel3d.train.trainer import Trainer

    cfg = config_from_dict(cfg_dict)
    trainer = Trainer(cfg, Topology(2, 2, 2))
    trainer.train_step()  # step 1 (allocations, first collectives) outside the clock
    trainer.finish_records()
    trainer.completed_records()  # not reported: fit() runs its own step 1
    trainer.step = 0  # fit() then runs the full count; step 1's record is dropped below
    t0 = time.perf_counter()
    history = trainer.fit()
    wall = time.perf_counter() - t0
    steps = [r["step_time_s"] for r in history[1:]]
    return {"wall_per_step": wall / len(history), "step_time": statistics.median(steps)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=12)
    args = parser.parse_args()
    pool = ProcessGroupPool(8)
    results = {"on": [], "off": []}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for i in range(args.rounds):
                for mode in (("on", "off") if i % 2 == 0 else ("off", "on")):
                    r = pool.run(train, job(f"{tmp}/{mode}{i}", args.steps, mode))[0]
                    results[mode].append(r)
                    print(f"\nround {i} bar {mode:>3}: wall {r['wall_per_step'] * 1e3:.1f} ms/step, "
                          f"step_time_s {r['step_time'] * 1e3:.1f} ms", flush=True)
    finally:
        pool.close()
    for key, what in (("wall_per_step", "wall time per step"), ("step_time", "recorded step_time_s")):
        on = statistics.median(r[key] for r in results["on"])
        off = statistics.median(r[key] for r in results["off"])
        print(f"{what}: bar on {on * 1e3:.1f} ms, off {off * 1e3:.1f} ms, ratio on/off {on / off:.3f}")


if __name__ == "__main__":
    main()
