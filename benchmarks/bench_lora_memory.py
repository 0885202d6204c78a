"""LoRA's memory per process at tp 2 x pp 2 on a ~250M-parameter base (issue 35,
acceptance 3): the measured peak against the frozen share + the adapters' state + the
process's base, and against full training at the same layout.

    python benchmarks/bench_lora_memory.py             # 254M base, LoRA rank 16, and full training
    python benchmarks/bench_lora_memory.py --smoke     # tiny model: the code path, seconds
    python benchmarks/bench_lora_memory.py --no-full   # LoRA only
    python benchmarks/bench_lora_memory.py --layout dp4-zero3   # the base sharded over dp 4 (FSDP-LoRA)
    python benchmarks/bench_lora_memory.py --dtype bf16          # the base frozen in bf16 (fp32 adapters' masters)

Each run is the trainer (``Trainer(cfg, Topology.of(cfg.parallel)).run_steps(2)``, fp32
or ``--dtype bf16``, micro_batch 1, seq_len 128 or ``--seq-len``, 2 micro-batches: pp 2's
1F1B, ``launch.host_memory = "tight"`` so resident memory follows the tensors) in 4 fresh processes (gloo, spawned,
one thread each). The model is built on the meta device and each rank materialises and
initialises only its shard. Per rank:

- ``base``: the peak of the same run on a tiny model (4 layers of dim 64, under 1 MiB of
  weights and state) in fresh processes: the interpreter, torch, parallel3d's imports,
  gloo's process groups, the data loader, what any run at this layout holds;
- ``frozen``: bytes of the frozen weights this rank holds (its quarter of the base; at
  ``--layout dp4-zero3`` its shard of every bucket, the gathered ones being transient);
- ``adapters``: the adapters' parameters, gradients and Adam state (``memory_report``
  total less the frozen bytes: the optimizer's flat buckets, padding included);
- ``peak``: VmHWM, the kernel's high-water mark of the process's RSS;
- ``rest``: peak - (base + frozen + adapters): activations, the loss's logits, the
  pipeline's buffers, allocator slack. Acceptance 3 reads peak <= base + frozen +
  adapters; ``rest`` says by how much the measured peak is above or below that sum,
  beside the dry run's activations and buffers for the same job planned for a GPU and for
  this CPU run (the planner's estimates);
- ``held``: the resident memory (VmRSS) after the last step above that sum, and ``step``
  the peak above it (``rest`` = ``held`` + ``step`` when the peak is in the last step);
- ``other tensors``: the bytes of every distinct CPU storage a Python-visible tensor holds
  after the last step (gc's objects) less frozen + adapters, the base run's own likewise
  subtracted: 0 when nothing but the frozen share and the adapters' state is held.

``--seq-len``, ``--dtype bf16`` and ``--tight-kib`` (the mmap threshold of ``tight``)
change one setting of both the measured and the base run.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from _trainer_memory import in_fresh_processes, peak_rss, rss  # noqa: E402

# 16 layers of dim 1024 (16 heads on 8 kv-heads, ffn 2816) and a 32000 vocabulary, untied:
# 189M in the layers + 65.5M in the embedding and head = 254M parameters
MODEL = {"preset": "debug", "vocab_size": 32000, "n_layers": 16, "dim": 1024, "n_heads": 16,
         "n_kv_heads": 8, "ffn_dim": 2816, "tie_embeddings": False}
SMOKE = {"preset": "debug", "vocab_size": 512, "n_layers": 4, "dim": 64, "n_heads": 4, "n_kv_heads": 2,
         "ffn_dim": 160, "tie_embeddings": False}
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
DATA = {"vocab_size": 512, "max_bytes": 1_000_000}
CORPUS_DIR = "/tmp/p3d-bench-corpus-lora"
MiB = 2**20


# --layout: the 4 processes' layout
LAYOUTS = {"tp2-pp2": {"tp": 2, "pp": 2, "dp": 1, "schedule": "1f1b"},
           "dp4-zero3": {"tp": 1, "pp": 1, "dp": 4, "zero": 3}}


# what the command line sets: train.recompute, the layout, train.dtype, train.seq_len, and
# the mmap threshold of launch.host_memory = "tight" in KiB (parallel3d's is 128)
DEFAULTS = {"recompute": "none", "layout": "tp2-pp2", "dtype": "fp32", "seq_len": 128, "tight_kib": 128}


def _job(model: dict, rank: int, run_dir: str, opts: dict = DEFAULTS) -> dict:
    recompute, layout, dtype, seq_len = (opts[k] for k in ("recompute", "layout", "dtype", "seq_len"))
    return {"model": model,
            "parallel": LAYOUTS[layout],
            "train": {"steps": 2, "seed": 1, "global_batch": 2 * LAYOUTS[layout]["dp"], "micro_batch": 1,
                      "seq_len": seq_len,
                      "lr": 1e-4, "warmup_steps": 0, "dtype": dtype, "log_interval": 10**9,
                      "recompute": recompute},
            "lora": {"rank": rank, "alpha": 2.0 * max(rank, 1), "targets": TARGETS},
            "data": {**DATA, "cache_dir": CORPUS_DIR},
            "eval": {"interval": 0},
            "launch": {"host_memory": "tight"},
            "run": {"dir": run_dir},
            "observability": {"progress": "off"}}


def _tensor_bytes() -> int:
    """Bytes of every distinct CPU storage a Python-visible tensor holds (gc's objects)."""
    import gc
    import warnings

    import torch

    storages = {}
    with warnings.catch_warnings():  # isinstance() on torch's deprecated module aliases warns
        warnings.simplefilter("ignore", FutureWarning)
        for obj in gc.get_objects():
            if isinstance(obj, torch.Tensor) and obj.device.type == "cpu":
                storage = obj.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def _rank(job: dict) -> dict:
    """One rank: the trainer's 2 steps (as ``parallel3d train``'s worker runs them), its
    bytes, its resident memory after the last step and its peak."""
    from parallel3d import distributed
    from parallel3d.config import config_from_dict
    from parallel3d.topology import Topology
    from parallel3d.train.trainer import Trainer
    from parallel3d.zero.memory import memory_report

    job = dict(job)
    distributed.HOST_MEMORY["tight"] = (job.pop("tight_kib") * 2**10, None)  # this process only
    distributed.set_host_allocator(job["launch"]["host_memory"])
    cfg = config_from_dict(job)
    t0 = time.perf_counter()
    trainer = Trainer(cfg, Topology.of(cfg.parallel), log=False)
    losses = [r["loss"] for r in trainer.run_steps(cfg.train.steps)]
    seconds = time.perf_counter() - t0
    steady, tensors = rss(), _tensor_bytes()
    report = memory_report(trainer.model, trainer.optimizer)
    params = list(trainer.model.parameters())
    frozen = sum(p.numel() * p.element_size() for p in params if not p.requires_grad)
    sharded = getattr(trainer.optimizer, "frozen", None)  # ZeRO 3: this rank's shard of the base
    if sharded is not None:
        frozen = sharded.sharded.shard_flat.untyped_storage().nbytes()
    trainer.close()
    return {"peak": peak_rss(), "steady": steady, "tensors": tensors, "frozen": frozen,
            "trained": report["total"] - frozen, "grads": report["grads"],
            "optimizer_state": report["optimizer_state"],
            "trainable_numel": sum(p.numel() for p in params if p.requires_grad),
            "numel": sum(p.numel() for p in params), "seconds": seconds, "losses": losses,
            "stage": trainer.topo.pp_rank}


def planned_transient(model: dict, rank: int, opts: dict = DEFAULTS) -> dict[int, tuple[int, int]]:
    """Stage -> the dry run's activations + buffers for the same job: (planned for a GPU,
    ``--gpu h100-80g``: the fused loss kernel, NCCL; planned for this CPU run: the torch
    loss reference's fp32 row block and gloo's buffers too). ``train.dtype`` is explicit
    here, so both plans count the same precision."""
    from parallel3d.config import config_from_dict
    from parallel3d.planner.hardware import gpu_named
    from parallel3d.train.dryrun import dry_run

    with tempfile.TemporaryDirectory(prefix="p3d-lora-mem-") as run_dir:
        cfg = config_from_dict(_job(model, rank, run_dir, opts))
    gpu, cpu = (dry_run(cfg, 4, out=lambda line: None, gpu=g)["reports"] for g in (gpu_named("h100-80g"), None))
    return {g.stage: (sum(g.transient), sum(c.transient)) for g, c in zip(gpu, cpu)}


def measure(model: dict, rank: int, opts: dict = DEFAULTS, timeout: float = 3600) -> list[dict]:
    with tempfile.TemporaryDirectory(prefix="p3d-lora-mem-") as run_dir:
        return in_fresh_processes(_rank, {**_job(model, rank, run_dir, opts), "tight_kib": opts["tight_kib"]}, 4,
                                  timeout)


def table(name: str, ranks: list[dict], bases: list[dict], planned: dict[int, tuple[int, int]]) -> str:
    """Per rank: the sum (base + frozen + trained) against the peak; ``rest`` split into
    what the process still holds after its last step beyond the sum (``held``) and the
    peak above that (``step``); ``other tensors``: Python-visible tensor bytes beyond
    frozen + trained after the last step (the base run's own subtracted)."""
    lines = [f"{name}: {sum(r['numel'] for r in ranks) / 1e6:.1f}M parameters held over the 4 ranks "
             f"(replicated norms counted per rank), {sum(r['trainable_numel'] for r in ranks) / 1e6:.2f}M trained",
             "rank | base MiB | frozen MiB | trained (params+grads+Adam) MiB | sum MiB | peak MiB | rest MiB "
             "| held MiB | step MiB | other tensors MiB | planner's activations + buffers MiB: GPU plan / CPU plan | s",
             "---|---|---|---|---|---|---|---|---|---|---|---"]
    for i, (r, b) in enumerate(zip(ranks, bases)):
        bound = b["peak"] + r["frozen"] + r["trained"]
        other = (r["tensors"] - r["frozen"] - r["trained"]) - (b["tensors"] - b["frozen"] - b["trained"])
        lines.append(f"{i} | {b['peak'] / MiB:.0f} | {r['frozen'] / MiB:.1f} | {r['trained'] / MiB:.1f} | "
                     f"{bound / MiB:.0f} | {r['peak'] / MiB:.0f} | {(r['peak'] - bound) / MiB:+.0f} | "
                     f"{(r['steady'] - bound) / MiB:+.0f} | {(r['peak'] - r['steady']) / MiB:.0f} | "
                     f"{other / MiB:+.1f} | {planned[r['stage']][0] / MiB:.0f} / {planned[r['stage']][1] / MiB:.0f} | "
                     f"{r['seconds']:.0f}")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rank", type=int, default=16, help="lora.rank")
    parser.add_argument("--smoke", action="store_true", help="tiny model: the code path")
    parser.add_argument("--no-full", action="store_true", help="skip full training's run")
    parser.add_argument("--recompute", default="none", choices=["none", "selective", "full"],
                        help="train.recompute of the measured runs (full: each layer keeps only its input)")
    parser.add_argument("--layout", default="tp2-pp2", choices=sorted(LAYOUTS),
                        help="the 4 processes' layout (dp4-zero3: the base sharded over dp, FSDP-LoRA)")
    parser.add_argument("--seq-len", type=int, default=128, help="train.seq_len (micro_batch 1)")
    parser.add_argument("--tight-kib", type=int, default=128,
                        help="the mmap threshold of launch.host_memory = 'tight' (KiB; parallel3d's: 128): "
                             "glibc returns every freed buffer from this size to the system")
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"],
                        help="train.dtype (bf16: the frozen base in bf16, the trained weights' masters fp32)")
    args = parser.parse_args()
    import torch

    from parallel3d.config import DataConfig
    from parallel3d.data.stdlib import prepare_stdlib

    torch.set_num_threads(1)
    prepare_stdlib(DataConfig(**DATA, cache_dir=CORPUS_DIR))  # one writer before the ranks read it
    model = SMOKE if args.smoke else MODEL
    t0 = time.time()
    lay = args.layout
    opts = {k: getattr(args, k) for k in DEFAULTS}
    rc, dt = args.recompute, args.dtype
    bases = measure(SMOKE, args.rank, opts)
    out = [table(f"LoRA rank {args.rank}, recompute {rc}, seq_len {args.seq_len}",
                 lora := measure(model, args.rank, opts), bases, planned_transient(model, args.rank, opts))]
    if not args.no_full:
        out.append(table(f"full training, recompute {rc}, seq_len {args.seq_len}", full := measure(model, 0, opts),
                         bases, planned_transient(model, 0, opts)))
        worst = max(range(4), key=lambda i: lora[i]["peak"])
        print(f"worst rank's peak: LoRA {lora[worst]['peak'] / MiB:.0f} MiB, full training "
              f"{full[worst]['peak'] / MiB:.0f} MiB ({lora[worst]['peak'] / full[worst]['peak']:.2f}x)")
    print(f"\n{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, {platform.machine()}, "
          f"{os.cpu_count()} CPUs, torch {torch.__version__}, {lay}, {dt}, seq_len {args.seq_len}, tight from {args.tight_kib} KiB, "
          f"{time.time() - t0:.0f} s")
    print("\n\n".join(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
