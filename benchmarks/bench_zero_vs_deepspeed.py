"""Our ZeRO-2 against DeepSpeed's ZeRO-2, side by side in one run (CPU, gloo, 2 ranks).

Both train the same Llama (our model class; DeepSpeed wraps it in its engine) from the
same initial weights on the same token batches, with the same AdamW (lr constant, betas,
eps, weight decay on >= 2-D parameters only), the same gradient clipping at 1.0 and the
same gradient accumulation (2 micro-batches of 2 sequences per rank). Runs alternate
ours, DeepSpeed, ours, DeepSpeed ... (machine noise hits both alike); each run starts
from the initial weights. Printed: both loss curves, their largest relative difference,
each side's median step time (first steps excluded as warm-up) and the ratio ours/DS.

    python benchmarks/bench_zero_vs_deepspeed.py [--steps 10] [--rounds 2] [--bucket-mb 25]

Each rank runs one thread, as under torchrun. Model as in /work/shared/peers-on-cpu.md:
vocab 1024, dim 256, 4 layers, 8 heads, ffn 688 (3.7 M parameters), sequences of 128.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from parallel3d.config import TrainConfig
from parallel3d.models.llama import Llama, LlamaConfig
from parallel3d.models.llama.parallelize import cross_entropy_loss
from parallel3d.topology import Topology
from parallel3d.train.optim import param_groups
from parallel3d.zero import ZeroOptimizer

MODEL = LlamaConfig(vocab_size=1024, dim=256, n_layers=4, n_heads=8, n_kv_heads=8, ffn_dim=688)
SEQ, MICRO, ACCUM, CLIP = 128, 2, 2, 1.0
TRAIN = TrainConfig(lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, grad_clip=CLIP)


def batches(step: int, rank: int, world: int) -> list[torch.Tensor]:
    """This rank's micro-batches, (MICRO, SEQ+1) tokens each: the same 8 fixed random
    sequences every step (as in peers-on-cpu.md), so the loss falls as they are learnt."""
    g = torch.Generator().manual_seed(1000)
    tokens = torch.randint(0, MODEL.vocab_size, (world * ACCUM * MICRO, SEQ + 1), generator=g)
    mine = tokens.view(world, ACCUM, MICRO, SEQ + 1)[rank]
    return list(mine)


def fresh_model() -> Llama:
    torch.manual_seed(0)
    return Llama(MODEL)


def run_ours(steps: int, rank: int, world: int, bucket_mb: float) -> tuple[list[float], list[float]]:
    model = fresh_model()
    opt = ZeroOptimizer(model.parameters(), TRAIN, Topology(1, 1, world), stage=2,
                        bucket_mb=bucket_mb, model=model)
    losses, times = [], []
    for step in range(steps):
        dist.barrier()
        t0 = time.perf_counter()
        opt.zero_grad()
        total = torch.zeros(())
        for mb in batches(step, rank, world):
            loss = cross_entropy_loss(model(mb[:, :-1]), mb[:, 1:]) / ACCUM
            loss.backward()
            total += loss.detach()
        opt.step(TRAIN.lr)
        opt.wait_for_params()  # count the all-gather in this step, as DeepSpeed's step does
        times.append(time.perf_counter() - t0)
        dist.all_reduce(total)
        losses.append(total.item() / world)
    return losses, times


def run_deepspeed(steps: int, rank: int, world: int) -> tuple[list[float], list[float]]:
    import deepspeed

    model = fresh_model()
    optimizer = torch.optim.AdamW(param_groups(list(model.parameters()), TRAIN.weight_decay),
                                  lr=TRAIN.lr, betas=(TRAIN.beta1, TRAIN.beta2), eps=TRAIN.eps,
                                  foreach=True)
    config = {
        "train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": ACCUM,
        "gradient_clipping": CLIP, "zero_optimization": {"stage": 2},
        "zero_allow_untested_optimizer": True, "steps_per_print": 10**9,
    }
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    losses, times = [], []
    for step in range(steps):
        dist.barrier()
        t0 = time.perf_counter()
        total = torch.zeros(())
        for mb in batches(step, rank, world):
            loss = cross_entropy_loss(engine(mb[:, :-1]), mb[:, 1:])
            engine.backward(loss)  # DeepSpeed divides by gradient_accumulation_steps itself
            engine.step()
            total += loss.detach() / ACCUM
        times.append(time.perf_counter() - t0)
        dist.all_reduce(total)
        losses.append(total.item() / world)
    engine.destroy()
    return losses, times


def worker(rank: int, world: int, store: str, args, results) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    import deepspeed

    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    deepspeed.utils.logger.setLevel(logging.ERROR)
    deepspeed.init_distributed(dist_backend="gloo")
    out = {"ours": [], "deepspeed": []}
    for _ in range(args.rounds):
        out["ours"].append(run_ours(args.steps, rank, world, args.bucket_mb))
        out["deepspeed"].append(run_deepspeed(args.steps, rank, world))
    if rank == 0:
        results.put(out)
    dist.barrier()
    dist.destroy_process_group()


def report(out: dict, warmup: int) -> None:
    ours_loss, ds_loss = out["ours"][0][0], out["deepspeed"][0][0]
    print(f"{'step':>4}  {'ours':>10}  {'deepspeed':>10}  rel. diff")
    for i, (a, b) in enumerate(zip(ours_loss, ds_loss)):
        print(f"{i + 1:>4}  {a:>10.6f}  {b:>10.6f}  {abs(a - b) / abs(b):.1e}")
    worst = max(abs(a - b) / abs(b) for r_o, r_d in zip(out["ours"], out["deepspeed"])
                for a, b in zip(r_o[0], r_d[0]))
    step_ms = {k: statistics.median(t for _, ts in runs for t in ts[warmup:]) * 1e3
               for k, runs in out.items()}
    print(f"max relative loss difference, all runs: {worst:.1e}")
    print(f"median step: ours {step_ms['ours']:.1f} ms, deepspeed {step_ms['deepspeed']:.1f} ms, "
          f"ratio ours/deepspeed {step_ms['ours'] / step_ms['deepspeed']:.3f}")
    for k, runs in out.items():
        per_run = [statistics.median(ts[warmup:]) * 1e3 for _, ts in runs]
        print(f"  {k} per-run medians (ms): " + ", ".join(f"{t:.0f}" for t in per_run))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--bucket-mb", type=float, default=25.0)
    parser.add_argument("--port", type=int, default=29581)
    args = parser.parse_args()
    world = 2
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=worker, args=(r, world, os.path.join(tmp, "store"), args, results))
                 for r in range(world)]
        for p in procs:
            p.start()
        out = results.get()
        for p in procs:
            p.join()
    print(f"ZeRO-2, dp=2 on gloo, {args.rounds} alternating rounds of {args.steps} steps, "
          f"bucket {args.bucket_mb} MiB (ours), DeepSpeed defaults otherwise")
    report(out, args.warmup)


if __name__ == "__main__":
    main()
