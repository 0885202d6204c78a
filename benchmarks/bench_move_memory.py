"""The autopilot's move, measured on CPU: peak resident memory during the move against the
steady step's, a 254 M-parameter model at 2 ranks (gloo), ``launch.host_memory = "tight"``
(resident memory follows the tensors).

    python benchmarks/bench_move_memory.py                     # this checkout
    python benchmarks/bench_move_memory.py --code /tmp/p3d-head  # another checkout (a git worktree)

Each rank trains 3 steps at tp 1 x dp 2 (ZeRO-1: full parameters and gradients, half the
moments), moves to tp 2 x dp 1 (``parallel3d.train.regroup.move``: save, let go, build,
resume) and trains 2 more. A thread samples the process's resident set (/proc/self/statm)
every 2 ms, into the phase running: the steady steps (2-3 before the move, 5 after it; the
first step of a layout allocates lazily) and the move. The ratio is the move's peak over the
steady peak before it (the layout moved from holds the larger state: full parameters and
gradients); the steady peak after the move shows whether the old trainer is still held.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

MODEL = {"preset": "debug", "vocab_size": 32000, "dim": 1024, "n_layers": 16, "n_heads": 16,
         "n_kv_heads": 8, "ffn_dim": 2816, "tie_embeddings": False}  # 254 M parameters
TRAIN = {"steps": 6, "seq_len": 64, "micro_batch": 1, "global_batch": 2, "seed": 1234,
         "lr": 1e-4, "warmup_steps": 0, "log_interval": 1000}


class RssMeter:
    """The peak resident set per phase, sampled by a thread."""

    def __init__(self, every_s: float = 0.002):
        self.phase, self.peaks, self.every_s = None, {}, every_s
        self.page = os.sysconf("SC_PAGE_SIZE")
        self._stop = False
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def rss(self) -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * self.page

    def _run(self) -> None:
        while not self._stop:
            if self.phase is not None:
                self.peaks[self.phase] = max(self.peaks.get(self.phase, 0), self.rss())
            time.sleep(self.every_s)

    def close(self) -> None:
        self._stop = True
        self._thread.join()


def _rank(rank: int, world: int, store: str, work: str, code: str, out: str) -> None:
    sys.path.insert(0, code)
    import torch
    import torch.distributed as dist
    from dataclasses import replace

    from parallel3d.config import config_from_dict
    from parallel3d.distributed import set_host_allocator
    from parallel3d.planner.spec import Layout
    from parallel3d.topology import Topology
    from parallel3d.train import regroup
    from parallel3d.train.trainer import Trainer

    import parallel3d
    assert parallel3d.__file__.startswith(code), (parallel3d.__file__, code)
    torch.set_num_threads(1)
    set_host_allocator("tight")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    job = {"model": MODEL, "train": TRAIN,
           "parallel": {"tp": 1, "pp": 1, "dp": 2, "zero": 1, "sequence_parallel": False},
           "data": {"max_bytes": 1_000_000, "vocab_size": 512, "cache_dir": f"{work}/corpus"},
           "checkpoint": {"keep": 1, "resume": "never"}, "launch": {"host_memory": "tight"},
           "observability": {"progress": "off", "straggler_interval": 0},
           "eval": {"interval": 0}, "run": {"dir": f"{work}/run"}}
    cfg = config_from_dict(job)
    meter = RssMeter()
    trainer = Trainer(cfg, Topology(1, 1, 2), log=False)
    trainer.run_steps(1)
    meter.phase = "steady before"
    trainer.run_steps(3)
    meter.phase = "move"
    target = replace(Layout.from_config(cfg), tp=2, dp=1)
    t0 = time.perf_counter()
    trainer, _ = regroup.move(trainer, target, lambda c, topo: Trainer(c, topo, log=False))
    move_s = time.perf_counter() - t0
    meter.phase = None
    trainer.run_steps(4)
    meter.phase = "steady after"
    trainer.run_steps(5)
    meter.phase = None
    meter.close()
    trainer.close(finished=False)
    Path(out, f"rank{rank}.json").write_text(json.dumps({"peaks": meter.peaks, "move_s": move_s}))
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--code", default=str(Path(__file__).resolve().parents[1]),
                    help="the checkout whose parallel3d runs (default: this one)")
    ap.add_argument("--work", default="/tmp/p3d-bench-move")
    args = ap.parse_args()
    import torch.multiprocessing as mp

    code = str(Path(args.code).resolve())
    Path(args.work).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(args.work) / "run"
        if run.exists():
            import shutil
            shutil.rmtree(run)
        mp.spawn(_rank, args=(2, f"{tmp}/store", args.work, code, tmp), nprocs=2)
        results = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(2)]
    mib = 2**20
    print(f"code: {code}")
    for r, res in enumerate(results):
        p = res["peaks"]
        print(f"rank {r}: steady peak {p['steady before'] / mib:.0f} MiB (tp1 dp2) before the move, "
              f"{p['steady after'] / mib:.0f} MiB (tp2) after it; move peak {p['move'] / mib:.0f} MiB "
              f"= {p['move'] / p['steady before']:.2f}x the steady peak before; move {res['move_s']:.1f} s")


if __name__ == "__main__":
    main()
