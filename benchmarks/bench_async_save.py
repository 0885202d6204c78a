"""The training thread's time in an ``async_save`` checkpoint, on CPU: a 124 M-parameter model
(fp32, AdamW: 1.5 GB of parameters and moments to save) in one process.

    python benchmarks/bench_async_save.py                        # this checkout
    python benchmarks/bench_async_save.py --code /tmp/p3d-head   # another checkout (a git worktree)

It trains 3 steps, then saves 3 times, one step apart, with ``checkpoint.async_save``; for
each save it times the training thread's ``Checkpointer.save`` call (what the step loop
waits for) and the step after it, against the median step without a save in flight.
``launch.host_memory = "tight"``, as the 2-core test machine runs the trainer's benchmarks.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

MODEL = {"preset": "debug", "vocab_size": 32000, "dim": 768, "n_layers": 12, "n_heads": 12,
         "n_kv_heads": 4, "ffn_dim": 2048, "tie_embeddings": False}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--code", default=str(Path(__file__).resolve().parents[1]))
    ap.add_argument("--work", default="/tmp/p3d-bench-async-save")
    args = ap.parse_args()
    sys.path.insert(0, str(Path(args.code).resolve()))
    import shutil

    from parallel3d.config import config_from_dict
    from parallel3d.distributed import set_host_allocator
    from parallel3d.topology import Topology
    from parallel3d.train.trainer import Trainer

    set_host_allocator("tight")
    shutil.rmtree(f"{args.work}/run", ignore_errors=True)
    job = {"model": MODEL,
           "train": {"steps": 20, "seq_len": 64, "micro_batch": 1, "global_batch": 1, "seed": 1,
                     "lr": 1e-4, "warmup_steps": 0, "log_interval": 1000},
           "data": {"max_bytes": 1_000_000, "vocab_size": 512, "cache_dir": f"{args.work}/corpus"},
           "checkpoint": {"async_save": True, "keep": 1, "resume": "never"},
           "observability": {"progress": "off"}, "eval": {"interval": 0}, "run": {"dir": f"{args.work}/run"}}
    trainer = Trainer(config_from_dict(job), Topology.single(), log=False)
    plain = []
    for _ in range(5):
        t0 = time.perf_counter()
        trainer.train_step()
        plain.append(time.perf_counter() - t0)
    saves, after = [], []
    for _ in range(3):
        t0 = time.perf_counter()
        trainer.checkpointer.save(trainer)
        saves.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        trainer.train_step()
        after.append(time.perf_counter() - t0)
        trainer.checkpointer.writer.wait()
    trainer.close(finished=False)
    step = statistics.median(plain[2:])
    print(f"code {args.code}")
    print(f"median step without a save: {step * 1e3:.0f} ms")
    print("training thread in Checkpointer.save: " + ", ".join(f"{s * 1e3:.0f}" for s in saves) + " ms")
    print("the step after each save: " + ", ".join(f"{s * 1e3:.0f}" for s in after) + " ms")
    print(f"median: save {statistics.median(saves) * 1e3:.0f} ms + step {statistics.median(after) * 1e3:.0f} ms "
          f"= {(statistics.median(saves) + statistics.median(after)) / step:.2f} steps")


if __name__ == "__main__":
    main()
