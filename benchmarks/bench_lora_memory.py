"""LoRA's memory per process at tp 2 x pp 2 on a ~250M-parameter base (issue 35,
acceptance 3): the measured peak against the frozen share + the adapters' state + the
process's base, and against full training at the same layout.

    python benchmarks/bench_lora_memory.py             # 254M base, LoRA rank 16, and full training
    python benchmarks/bench_lora_memory.py --smoke     # tiny model: the code path, seconds
    python benchmarks/bench_lora_memory.py --no-full   # LoRA only
    python benchmarks/bench_lora_memory.py --layout dp4-zero3   # the base sharded over dp 4 (FSDP-LoRA)

Each run is the trainer (``Trainer(cfg, Topology.of(cfg.parallel)).fit()``, 2 steps,
fp32, micro_batch 1, seq_len 128, 2 micro-batches: pp 2's 1F1B, ``launch.host_memory =
"tight"`` so resident memory follows the tensors) in 4 fresh processes (gloo, spawned,
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
  beside the dry run's activations and buffers for the same job (the planner's estimate).
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
from _trainer_memory import in_fresh_processes, peak_rss, train  # noqa: E402

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


def _job(model: dict, rank: int, run_dir: str, recompute: str = "none", layout: str = "tp2-pp2") -> dict:
    return {"model": model,
            "parallel": LAYOUTS[layout],
            "train": {"steps": 2, "seed": 1, "global_batch": 2 * LAYOUTS[layout]["dp"], "micro_batch": 1,
                      "seq_len": 128,
                      "lr": 1e-4, "warmup_steps": 0, "dtype": "fp32", "log_interval": 10**9,
                      "recompute": recompute},
            "lora": {"rank": rank, "alpha": 2.0 * max(rank, 1), "targets": TARGETS},
            "data": {**DATA, "cache_dir": CORPUS_DIR},
            "eval": {"interval": 0},
            "launch": {"host_memory": "tight"},
            "run": {"dir": run_dir},
            "observability": {"progress": "off"}}


def _rank(job: dict) -> dict:
    """One rank: its base RSS, the trainer's 2 steps, its bytes and its peak RSS."""
    from parallel3d.zero.memory import memory_report

    trainer, losses, seconds = train(job)
    report = memory_report(trainer.model, trainer.optimizer)
    params = list(trainer.model.parameters())
    frozen = sum(p.numel() * p.element_size() for p in params if not p.requires_grad)
    sharded = getattr(trainer.optimizer, "frozen", None)  # ZeRO 3: this rank's shard of the base
    if sharded is not None:
        frozen = sharded.sharded.shard_flat.untyped_storage().nbytes()
    return {"peak": peak_rss(), "frozen": frozen, "trained": report["total"] - frozen,
            "grads": report["grads"], "optimizer_state": report["optimizer_state"],
            "trainable_numel": sum(p.numel() for p in params if p.requires_grad),
            "numel": sum(p.numel() for p in params), "seconds": seconds, "losses": losses,
            "stage": trainer.topo.pp_rank}


def planned_transient(model: dict, rank: int, recompute: str = "none", layout: str = "tp2-pp2") -> dict[int, int]:
    """Stage -> the dry run's activations + buffers (the planner's) for the same job."""
    from parallel3d.config import config_from_dict
    from parallel3d.train.dryrun import dry_run

    with tempfile.TemporaryDirectory(prefix="p3d-lora-mem-") as run_dir:
        job = _job(model, rank, run_dir, recompute, layout)
        reports = dry_run(config_from_dict(job), 4, out=lambda line: None)["reports"]
    return {r.stage: sum(r.transient) for r in reports}


def measure(model: dict, rank: int, recompute: str = "none", layout: str = "tp2-pp2",
            timeout: float = 3600) -> list[dict]:
    with tempfile.TemporaryDirectory(prefix="p3d-lora-mem-") as run_dir:
        return in_fresh_processes(_rank, _job(model, rank, run_dir, recompute, layout), 4, timeout)


def table(name: str, ranks: list[dict], bases: list[dict], planned: dict[int, int]) -> str:
    lines = [f"{name}: {sum(r['numel'] for r in ranks) / 1e6:.1f}M parameters held over the 4 ranks "
             f"(replicated norms counted per rank), {sum(r['trainable_numel'] for r in ranks) / 1e6:.2f}M trained",
             "rank | base MiB | frozen MiB | trained (params+grads+Adam) MiB | sum MiB | peak MiB | rest MiB "
             "| planner's activations + buffers MiB | s",
             "---|---|---|---|---|---|---|---|---"]
    for i, (r, b) in enumerate(zip(ranks, bases)):
        bound = b["peak"] + r["frozen"] + r["trained"]
        lines.append(f"{i} | {b['peak'] / MiB:.0f} | {r['frozen'] / MiB:.1f} | {r['trained'] / MiB:.1f} | "
                     f"{bound / MiB:.0f} | {r['peak'] / MiB:.0f} | {(r['peak'] - bound) / MiB:+.0f} | "
                     f"{planned[r['stage']] / MiB:.0f} | {r['seconds']:.0f}")
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
    args = parser.parse_args()
    import torch

    from parallel3d.config import DataConfig
    from parallel3d.data.stdlib import prepare_stdlib

    torch.set_num_threads(1)
    prepare_stdlib(DataConfig(**DATA, cache_dir=CORPUS_DIR))  # one writer before the ranks read it
    model = SMOKE if args.smoke else MODEL
    t0 = time.time()
    lay = args.layout
    bases = measure(SMOKE, args.rank, layout=lay)
    rc = args.recompute
    out = [table(f"LoRA rank {args.rank}, recompute {rc}", lora := measure(model, args.rank, rc, lay), bases,
                 planned_transient(model, args.rank, rc, lay))]
    if not args.no_full:
        out.append(table(f"full training, recompute {rc}", full := measure(model, 0, rc, lay), bases,
                         planned_transient(model, 0, rc, lay)))
        worst = max(range(4), key=lambda i: lora[i]["peak"])
        print(f"worst rank's peak: LoRA {lora[worst]['peak'] / MiB:.0f} MiB, full training "
              f"{full[worst]['peak'] / MiB:.0f} MiB ({lora[worst]['peak'] / full[worst]['peak']:.2f}x)")
    print(f"\n{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, {platform.machine()}, "
          f"{os.cpu_count()} CPUs, torch {torch.__version__}, {lay}, fp32, {time.time() - t0:.0f} s")
    print("\n\n".join(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
