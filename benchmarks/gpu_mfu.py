"""Single-GPU throughput of the 1B preset in bf16: parallel3d's Trainer beside a plain
PyTorch loop on the same model, weights and batches.

    python benchmarks/gpu_mfu.py [--steps 10] [--warmup 3] [--micro-batch 4] [--seq-len 2048]
                                 [--peak-tflops 989] [--out benchmarks/gpu_results.md]

parallel3d: ``Trainer(cfg, topo, device).fit()`` as a world of one (tp = pp = dp = 1,
zero 0, ``train.dtype bf16``: parameters stored in bf16 with fp32 master weights in its
AdamW, the forward under bf16 autocast, global-norm clipping at 1.0); step times are the records' ``step_time_s`` (device synchronized at
both ends of the step, as the plain loop is timed here).
Reference: the same ``Llama`` from the same seed with fp32 parameters, ``torch.autocast(bfloat16)``
(so its weights round to bf16 at each GEMM, where the Trainer's are bf16 already), fused
``torch.optim.AdamW`` with the same settings, ``clip_grad_norm_(1.0)``, the same global
batches (``micro-batch`` sequences per micro-batch, ``accum`` micro-batches per step).
Rounds alternate the two sides. Printed per side: median step time after ``--warmup``
steps, tokens/s, MFU (model FLOPs of ``parallel3d.flops`` over ``--peak-tflops``, dense
bf16 peak of the GPU: 989 TFLOP/s for H100/H200 SXM per NVIDIA's datasheets) and peak
memory (``torch.cuda.max_memory_allocated``). Without a GPU it says so and exits 1
(``--cpu-smoke --preset debug`` runs the script's own code path on CPU, figures meaningless).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import CORPUS_DIR, GlobalBatches, PeakMemory, initial_model, job  # noqa: E402


def _flops():
    try:
        from parallel3d import flops
    except ImportError:
        raise SystemExit("gpu_mfu.py needs parallel3d.flops (the FLOP count shared with the "
                         "planner, on the 'planner' branch): merge it first") from None
    return flops


def _job(args, steps: int):
    cfg = job({}, steps, global_batch=args.micro_batch * args.accum, micro_batch=args.micro_batch,
              seq_len=args.seq_len, dtype="bf16", preset=args.preset, run_dir=args.run_dir,
              corpus_dir=args.corpus_dir)
    cfg.data.vocab_size = args.data_vocab
    return cfg


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_ours(args, device) -> tuple[list[float], float, list[float]]:
    from parallel3d.topology import Topology
    from parallel3d.train.trainer import Trainer

    steps = args.warmup + args.steps
    with PeakMemory(device) as mem:
        trainer = Trainer(_job(args, steps), Topology(1, 1, 1, rank=0, world_size=1), device, log=False)
        records = trainer.fit()
    del trainer
    return [r["step_time_s"] for r in records], mem.peak, [r["loss"] for r in records]


def run_plain(args, device) -> tuple[list[float], float, list[float]]:
    from parallel3d.models.llama.parallelize import cross_entropy_loss
    from parallel3d.train.optim import param_groups

    steps = args.warmup + args.steps
    cfg = _job(args, steps)
    data = GlobalBatches(cfg)
    times, losses = [], []
    with PeakMemory(device) as mem:
        model = initial_model(cfg).to(device)
        t = cfg.train
        opt = torch.optim.AdamW(param_groups(list(model.parameters()), t.weight_decay), lr=t.lr,
                                betas=(t.beta1, t.beta2), eps=t.eps, fused=True)
        for s in range(steps):
            x, y = data(s)
            _sync(device)
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            total = torch.zeros((), device=device)
            for i in range(0, x.shape[0], args.micro_batch):
                xb = x[i:i + args.micro_batch].to(device, non_blocking=True)
                yb = y[i:i + args.micro_batch].to(device, non_blocking=True)
                with torch.autocast(device.type, dtype=torch.bfloat16):
                    loss = cross_entropy_loss(model(xb), yb) / args.accum
                loss.backward()
                total += loss.detach()
            torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
            opt.step()
            _sync(device)
            times.append(time.perf_counter() - t0)
            losses.append(float(total))
    del model, opt
    return times, mem.peak, losses


def measure(args, device) -> dict:
    """Both sides, ``args.rounds`` alternating rounds: ``{side: {"times", "peak", "losses"}}``
    plus the FLOP count: ``{"sides": ..., "model_cfg", "per_token", "tokens"}``."""
    flops = _flops()
    from parallel3d.train.setup import resolve_model_config

    model_cfg = resolve_model_config(_job(args, 1).model)
    sides = {"parallel3d Trainer": run_ours, "plain PyTorch loop": run_plain}
    results = {name: {"times": [], "peak": 0, "losses": None} for name in sides}
    for _ in range(args.rounds):
        for name, fn in sides.items():
            times, peak, losses = fn(args, device)
            results[name]["times"] += times[args.warmup:]
            results[name]["peak"] = max(results[name]["peak"], peak)
            results[name]["losses"] = results[name]["losses"] or losses
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return {"sides": results, "model_cfg": model_cfg,
            "per_token": flops.model_flops_per_token(model_cfg, args.seq_len),
            "tokens": args.micro_batch * args.accum * args.seq_len}


def summary_rows(measured: dict, peak_tflops: float) -> list[dict]:
    """One dict per side: step ms, tokens/s, MFU, peak GiB, first/last loss, and the
    largest relative loss difference against the plain loop over the steps both ran."""
    flops = _flops()
    sides = measured["sides"]
    plain = sides["plain PyTorch loop"]["losses"]
    rows = []
    for name, r in sides.items():
        step = statistics.median(r["times"])
        tps = measured["tokens"] / step
        diff = max(abs(a - b) / abs(b) for a, b in zip(r["losses"], plain))
        rows.append({"side": name, "step_ms": step * 1e3, "tokens_per_s": tps,
                     "mfu": flops.mfu(tps, measured["per_token"], 1, peak_tflops * 1e12),
                     "peak_gib": r["peak"] / 2**30, "first_loss": r["losses"][0],
                     "last_loss": r["losses"][-1], "loss_rel_diff": diff})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--accum", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--peak-tflops", type=float, default=989.0,
                        help="dense bf16 peak of the GPU (H100/H200 SXM: 989)")
    parser.add_argument("--preset", default="1b")
    parser.add_argument("--corpus-dir", default=CORPUS_DIR, help="where the stdlib corpus is prepared")
    parser.add_argument("--data-vocab", type=int, default=2048, help="BPE vocabulary of that corpus")
    parser.add_argument("--run-dir", default="/tmp/p3d-gpu-mfu")
    parser.add_argument("--cpu-smoke", action="store_true",
                        help="run on CPU to check the script itself (figures meaningless)")
    parser.add_argument("--out", help="append the markdown table to this file")
    args = parser.parse_args()
    if not torch.cuda.is_available() and not args.cpu_smoke:
        raise SystemExit("gpu_mfu.py needs a GPU (CUDA): none found here, nothing measured")
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    measured = measure(args, device)
    model_cfg = measured["model_cfg"]
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (smoke run, not a measurement)"
    lines = [f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {gpu}; torch {torch.__version__}; "
             f"{args.preset} preset ({model_cfg.num_params() / 1e9:.2f} B params), bf16 autocast, "
             f"{args.accum} x {args.micro_batch} x {args.seq_len} tokens per step, "
             f"{args.rounds} alternating rounds of {args.steps} steps after {args.warmup} warm-up",
             "", "| side | step ms | tokens/s | MFU | peak GiB | first / last loss | max loss rel. diff vs plain |",
             "|---|---|---|---|---|---|---|"]
    for r in summary_rows(measured, args.peak_tflops):
        lines.append(f"| {r['side']} | {r['step_ms']:.0f} | {r['tokens_per_s']:.0f} | {r['mfu']:.1%} "
                     f"| {r['peak_gib']:.1f} | {r['first_loss']:.4f} / {r['last_loss']:.4f} "
                     f"| {r['loss_rel_diff']:.1e} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "a") as f:
            f.write("\n" + text)


if __name__ == "__main__":
    main()
