"""Activation memory and step time of train.recompute = none, selective, full.

One process, fp32 on CPU. For each mode the same model (same weights) runs forward and
backward on the same batch. Printed per mode:

* held after forward: bytes allocated by the forward pass and still alive when it ends,
  i.e. what autograd keeps for the backward pass (plus the logits and the loss);
* peak: the high-water mark of bytes allocated during forward + backward (gradients and
  the recomputed activations of the layer being differentiated included);
* step time: median of forward + backward over repeats taken round-robin across the modes,
  measured without the meter (its dispatch hook slows every operator), and its ratio to
  none (the cost of recomputing; the first, measured pass doubles as warm-up);
* the loss, identical in every mode.

Memory is measured with :class:`parallel3d.zero.AllocationMeter`, which follows every
storage an operator creates until it is freed, so it works on CPU where torch keeps no
allocator statistics.

    python benchmarks/bench_recompute.py [--layers 4] [--dim 256] [--seq 512] [--batch 4]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from parallel3d.models.llama import Llama, LlamaConfig
from parallel3d.models.llama.parallelize import apply_recompute, cross_entropy_loss
from parallel3d.zero import AllocationMeter

MODES = ("none", "selective", "full")


def build(cfg: LlamaConfig, mode: str) -> Llama:
    torch.manual_seed(0)
    return apply_recompute(Llama(cfg), mode)


def measure_memory(model: Llama, x: torch.Tensor) -> tuple[int, int, float]:
    with AllocationMeter() as meter:
        loss = cross_entropy_loss(model(x), x)
        held = meter.live
        loss.backward()
    model.zero_grad(set_to_none=True)
    return held, meter.peak, loss.item()


def step_time(model: Llama, x: torch.Tensor) -> float:
    t0 = time.perf_counter()
    cross_entropy_loss(model(x), x).backward()
    dt = time.perf_counter() - t0
    model.zero_grad(set_to_none=True)
    return dt


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    # one thread: on a shared machine, OpenMP threads waiting on each other make timings
    # swing by 10x; a single thread measures the work itself.
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    cfg = LlamaConfig(vocab_size=1024, dim=args.dim, n_layers=args.layers, n_heads=8, n_kv_heads=4,
                      ffn_dim=int(args.dim * 8 / 3) // 16 * 16)
    x = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    print(f"Llama dim {cfg.dim}, {cfg.n_layers} layers, ffn {cfg.ffn_dim}; batch {args.batch} x "
          f"{args.seq} tokens; fp32 on CPU, {torch.get_num_threads()} threads")
    print(f"{'mode':>10}  {'held after fwd':>15}  {'peak fwd+bwd':>13}  {'step':>9}  {'vs none':>7}  loss")
    models = {mode: build(cfg, mode) for mode in MODES}
    memory = {mode: measure_memory(model, x) for mode, model in models.items()}
    times = {mode: [] for mode in MODES}
    for _ in range(args.repeats):  # round-robin, so that machine noise hits every mode alike
        for mode, model in models.items():
            times[mode].append(step_time(model, x))
    step = {mode: statistics.median(t) for mode, t in times.items()}
    for mode in MODES:
        held, peak, loss = memory[mode]
        print(f"{mode:>10}  {held / 2**20:>11.1f} MiB  {peak / 2**20:>9.1f} MiB  "
              f"{step[mode] * 1e3:>6.0f} ms  {step[mode] / step['none']:>6.2f}x  {loss:.6f}")


if __name__ == "__main__":
    main()
