"""What the data checks cost per step, measured side by side in one run.

    python benchmarks/bench_data_checks.py [--steps 20]

1. **The id range check at the 8B recipe's shape** (``recipes/llama3_8b.toml``: global
   batch 512 x 8192 tokens, dp 32, uint32 ids). Every rank checks the whole global batch
   (so that all ranks stop at the same step without communicating), in the loader's
   background thread. Per step, the median over ``--steps`` batches of: building this
   rank's own 16 sequences (what the loader does anyway) and checking all 512; the ratio.
   Both read the same memory-mapped token file (in the page cache after a first pass).
2. **The checksum verdict's per-step poll**, 2 gloo ranks, while the shards are still
   being hashed in the background: the time ``ShardVerifier.poll()`` takes on the
   training thread (wait for the previous step's all-reduce of 2 int64, start the next),
   next to a blocking all-reduce of the same 2 numbers.
3. **In a training run**: the tiny debug model on one process with both checks on, each
   timed where it runs, against the step time of the same run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from parallel3d.data.checks import IdRangeCheck
from parallel3d.data.format import TokenStream
from parallel3d.data.loader import _build_step
from parallel3d.data.sampler import GlobalBatchSampler, TokenWindows


def range_check_at_8b_shape(folder: Path, steps: int) -> dict:
    G, S, dp, vocab = 512, 8192, 32, 128256
    n_windows = 4 * G
    path = folder / "train-00000.bin"
    ids = np.random.default_rng(0).integers(0, vocab, size=n_windows * S + 1, dtype=np.uint32)
    ids.tofile(path)
    del ids
    stream = TokenStream([np.memmap(path, dtype="<u4", mode="r")])
    windows = TokenWindows(stream, S)
    sampler = GlobalBatchSampler(windows.num_samples, G, 1, dp, 0, 0)
    check = IdRangeCheck(windows, sampler, vocab)
    check(0)  # page cache warm for what follows
    own, full = [], []
    for step in range(steps):
        position = (step % 4) * G
        t0 = time.perf_counter()
        _build_step(windows, sampler, position, pin=False)
        t1 = time.perf_counter()
        check(position)
        t2 = time.perf_counter()
        own.append(t1 - t0)
        full.append(t2 - t1)
    return {"own_batch_ms": 1e3 * statistics.median(own), "check_ms": 1e3 * statistics.median(full)}


def _poll_cost(folder: str, polls: int) -> dict:
    import torch
    import torch.distributed as dist

    from parallel3d.data.checks import ShardVerifier
    from parallel3d.data.format import open_dataset

    rank = dist.get_rank()
    group = dist.new_group(backend="gloo")
    verifier = ShardVerifier(open_dataset(folder), rank, 2, group)
    times, busy = [], 0
    for _ in range(polls):
        t0 = time.perf_counter()
        verifier.poll()
        times.append(time.perf_counter() - t0)
        busy += not verifier.done.is_set()
        time.sleep(0.01)  # a step's compute
    verifier.close()
    blocking = []
    for _ in range(polls):
        flags = torch.zeros(2, dtype=torch.int64)
        t0 = time.perf_counter()
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
        blocking.append(time.perf_counter() - t0)
    return {"poll_us": 1e6 * statistics.median(times), "blocking_allreduce_us": 1e6 * statistics.median(blocking),
            "polls_while_hashing": busy}


def poll_cost(folder: Path, polls: int) -> dict:
    """Two ranks polling while 1 GiB of shards is hashed (longer than the polls last)."""
    from parallel3d.data.format import write_index
    from parallel3d.testing import ProcessGroupPool

    import hashlib

    shards = []
    block = np.random.default_rng(1).integers(0, 1000, size=32 << 20, dtype=np.uint16)  # 64 MiB
    sha = hashlib.sha256(block.tobytes()).hexdigest()
    for k in range(16):
        name = f"train-{k:05d}.bin"
        block.tofile(folder / name)
        shards.append({"file": name, "num_tokens": int(block.size), "bytes": int(block.nbytes), "sha256": sha})
    write_index(folder, dtype=np.uint16, eos_id=0, vocab_size=1000, tokenizer_sha256="",
                splits={"train": {"num_tokens": 16 * int(block.size), "num_docs": 1, "shards": shards}},
                source={})
    pool = ProcessGroupPool(2)
    try:
        return pool.run(_poll_cost, str(folder), polls)[0]
    finally:
        pool.close()


def in_a_training_run(run_root: Path, steps: int) -> dict:
    """The debug model on one process with both checks on, each timed where it runs: the
    range check in the loader's thread, the poll on the training thread; against the
    step time of the same run. (Whole runs with the checks on vs off, alternating, differ
    by far more than the checks on 2 cores shared by many processes: the noise, not the
    checks.)"""
    from parallel3d.config import config_from_dict
    from parallel3d.topology import Topology
    from parallel3d.train.trainer import Trainer

    job = {"model": {"preset": "debug", "vocab_size": 512, "n_layers": 2, "dim": 64, "n_heads": 4,
                     "n_kv_heads": 2, "ffn_dim": 160},
           "parallel": {"tp": 1, "pp": 1, "dp": 1},
           "train": {"steps": steps, "global_batch": 8, "micro_batch": 2, "seq_len": 128, "log_interval": 100000},
           "data": {"max_bytes": 1_000_000, "vocab_size": 512, "cache_dir": str(run_root / "corpus")},
           "eval": {"interval": 0}, "observability": {"progress": "off"}, "run": {"dir": str(run_root / "run")}}
    trainer = Trainer(config_from_dict(job), Topology(1, 1, 1, rank=0, world_size=1), log=False)
    loader = trainer.data.loader
    spent = {"check": [], "poll": []}

    def timed(fn, key):
        def run(*args):
            t0 = time.perf_counter()
            fn(*args)
            spent[key].append(time.perf_counter() - t0)
        return run

    loader.check, loader.before_step = timed(loader.check, "check"), timed(loader.before_step, "poll")
    history = trainer.fit()
    step = statistics.median(h["step_time_s"] for h in history[1:])
    return {"step_ms": 1e3 * step, "check_us": 1e6 * statistics.median(spent["check"]),
            "poll_us": 1e6 * statistics.median(spent["poll"]),
            "data_wait_ms": 1e3 * statistics.median(h["data_wait_s"] for h in history[1:])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        (tmp / "rc").mkdir()
        rc = range_check_at_8b_shape(tmp / "rc", args.steps)
        print(f"1. 8B recipe shape (512 x 8192 uint32, dp 32), per step in the loader's thread: "
              f"own batch {rc['own_batch_ms']:.2f} ms, range check of the global batch "
              f"{rc['check_ms']:.2f} ms (x{rc['check_ms'] / rc['own_batch_ms']:.1f} the own batch)")
        (tmp / "shards").mkdir()
        pc = poll_cost(tmp / "shards", args.steps * 5)
        print(f"2. checksum verdict, 2 gloo ranks: poll() {pc['poll_us']:.0f} us per step on the "
              f"training thread ({pc['polls_while_hashing']} of {args.steps * 5} polls while hashing); "
              f"a blocking all-reduce of the same flags {pc['blocking_allreduce_us']:.0f} us")
        run = in_a_training_run(tmp / "run", args.steps)
        print(f"3. debug model, 1 process, {args.steps} steps: step {run['step_ms']:.1f} ms (median); "
              f"range check {run['check_us']:.0f} us in the loader's thread "
              f"({run['check_us'] / 1e3 / run['step_ms']:.2%} of a step), poll {run['poll_us']:.1f} us on "
              f"the training thread (verdict settled before step 1: small data); data_wait "
              f"{run['data_wait_ms']:.2f} ms")
        print(json.dumps({"range_check": rc, "poll": pc, "training_run": run}))


if __name__ == "__main__":
    main()
