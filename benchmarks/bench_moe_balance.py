"""Expert load balance over a training run (issue 31, point 5): the debug-moe model (4
layers, layer 0 dense, 8 experts, top 2) on the stdlib corpus, 200 steps, one process,
three ways:

    none        no auxiliary loss, no bias
    aux-free    DeepSeek-V3's selection bias (moe.expert_bias, rate moe.bias_update_rate)
    aux loss    the Switch auxiliary loss at coefficient 0.01

Imbalance is max / mean assignments per expert (1: balanced; 8 / 2 = 4: all tokens on two
experts), the largest over the three sparse layers, measured two ways from each layer's
counts of every step:

    per step    over the step's global batch (the trainer's ``expert_imbalance`` record):
                with 16 windows of 128 tokens a step (the default job's batch) this
                carries the batch's own composition: a step of code from a few files
                sends many alike tokens to the same experts whatever the bias is
    10 steps    over the counts summed across 10 consecutive steps (20,480 tokens at
                the default batch): the balance the bias controls, as DeepSeek's MaxVio
                over a validation set does

Printed per run: per-step imbalance at steps 1, 10, 50, 100, 150, 200, its mean over the
last 50 steps, the first step from which it stays below 1.3, the last 10-step window's
figure and the first window end from which every window is below 1.3. ``--global-batch``
(sequences of 128 tokens a step) shows how the per-step figure narrows with the batch.

    python benchmarks/bench_moe_balance.py [--steps 200] [--rates 3e-3] [--modes none,aux-free,aux loss]
                                           [--global-batch 16]

The layout does not change these numbers: the counts are summed over every rank that
routed tokens (tests/test_train_moe.py checks the per-step imbalance equal to one
process's at ep 2 and 4 and at 2 x 2 x 2).
"""

from __future__ import annotations

import argparse
import tempfile

import torch

import parallel3d.train.moe as moe_steps
from parallel3d.config import config_from_dict
from parallel3d.models.moe.parallelize import moe_blocks
from parallel3d.topology import Topology
from parallel3d.train.trainer import Trainer

EXPERTS = {"n_experts": 8, "top_k": 2, "ffn_dim": 96, "norm_topk_prob": True, "dense_layers": [0]}
MODES = {
    "none": {},
    "aux-free": {"expert_bias": True},
    "aux loss": {"aux_loss_coef": 0.01},
}
WINDOW = 10  # steps whose counts are summed for the windowed figure
BOUND = 1.3


def _job(run_dir: str, steps: int, moe: dict, global_batch: int) -> dict:
    return {"model": {"preset": "debug-moe", "moe": moe},
            "parallel": {"tp": 1, "pp": 1, "dp": 1},
            "train": {"steps": steps, "seed": 1234, "global_batch": global_batch, "micro_batch": 4, "seq_len": 128,
                      "lr": 3e-3, "warmup_steps": 20, "grad_clip": 1.0, "log_interval": 10_000},
            "data": {"source": "stdlib", "max_bytes": 8_000_000, "vocab_size": 2048},
            "eval": {"interval": 0}, "run": {"dir": run_dir}}


def run(mode: str, steps: int, rate: float, global_batch: int = 16) -> tuple[list[float], torch.Tensor]:
    """(the records' per-step imbalance, every step's counts (steps, layers, experts)). The
    counts are read from the sparse layers just before the step's figures reset them
    (one process: this rank's counts are the global batch's)."""
    moe = {**EXPERTS, **MODES[mode]}
    if moe.get("expert_bias"):
        moe["bias_update_rate"] = rate
    counts, finish = [], moe_steps.finish_moe_step

    def counting(model, topo, sp):
        counts.append(torch.stack([b.step_counts.double() for _, b in moe_blocks(model)]))
        return finish(model, topo, sp)

    moe_steps.finish_moe_step = counting
    try:
        with tempfile.TemporaryDirectory() as tmp:
            cfg = config_from_dict(_job(tmp, steps, moe, global_batch))
            history = Trainer(cfg, Topology.single(), log=False).fit()
    finally:
        moe_steps.finish_moe_step = finish
    return [h["expert_imbalance"] for h in history], torch.stack(counts)


def imbalance(counts: torch.Tensor) -> float:
    """Largest over layers of max / mean per expert; counts (layers, experts)."""
    return float((counts.max(-1).values / counts.mean(-1)).max())


def windowed(counts: torch.Tensor, window: int = WINDOW) -> list[float]:
    """The imbalance of the counts summed over each run of ``window`` steps."""
    return [imbalance(counts[end - window:end].sum(0)) for end in range(window, len(counts) + 1, window)]


def stays_below(series: list[float], bound: float) -> int | None:
    """The first index (1-based) from which every value is below ``bound``."""
    first = None
    for i, v in enumerate(series, 1):
        if v < bound:
            first = first or i
        else:
            first = None
    return first


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--rates", default="3e-3", help="aux-free bias update rates, comma-separated: a row each")
    ap.add_argument("--modes", default=",".join(MODES), help="which of none, aux-free, aux loss")
    ap.add_argument("--global-batch", type=int, default=16, help="sequences of 128 tokens a step")
    args = ap.parse_args()
    torch.set_num_threads(1)  # 2 threads on a shared 2-core machine oversubscribe it (measured 10x slower at load 10)
    marks = [s for s in (1, 10, 50, 100, 150, 200) if s <= args.steps]
    print(f"global batch {args.global_batch} x 128 tokens; windows of {WINDOW} steps")
    print("| mode | " + " | ".join(f"step {s}" for s in marks)
          + f" | mean of the last 50 | per step below {BOUND} from | last window | windows below {BOUND} from step |")
    print("|---|" + "---|" * (len(marks) + 4))
    runs = [(mode, rate) for mode in args.modes.split(",")
            for rate in ([float(r) for r in args.rates.split(",")] if mode == "aux-free" else [None])]
    for mode, rate in runs:
        series, counts = run(mode, args.steps, rate or 0.0, args.global_batch)
        assert all(abs(imbalance(c) - v) < 1e-9 for c, v in zip(counts, series)), "counts read are not the records'"
        tail, windows = series[-50:], windowed(counts)
        below, wbelow = stays_below(series, BOUND), stays_below(windows, BOUND)
        label = f"{mode} (rate {rate:g})" if rate else mode
        print(f"| {label} | " + " | ".join(f"{series[s - 1]:.2f}" for s in marks)
              + f" | {sum(tail) / len(tail):.2f} | {below if below else 'never'} | {windows[-1]:.2f} | "
              + (f"{wbelow * WINDOW}" if wbelow else "never") + " |", flush=True)


if __name__ == "__main__":
    main()
