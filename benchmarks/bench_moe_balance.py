"""Expert load balance over a training run (issue 31, point 5): the debug-moe model (4
layers, layer 0 dense, 8 experts, top 2) on the stdlib corpus (the default job's data and
batch: 16 x 128 tokens a step), 200 steps, one process, three ways:

    none        no auxiliary loss, no bias
    aux-free    DeepSeek-V3's selection bias (moe.expert_bias, rate moe.bias_update_rate)
    aux loss    the Switch auxiliary loss at coefficient 0.01

Each step's ``expert_imbalance`` is the trainer's record: the largest, over the sparse
layers, of max / mean assignments per expert over the step's global batch (1: balanced;
8 / 2 = 4: all tokens on two experts). Printed: the imbalance at steps 1, 10, 50, 100,
150, 200, the first step from which it stays below 1.3, and the mean of the last 50.

    python benchmarks/bench_moe_balance.py [--steps 200] [--rates 1e-3,3e-3,1e-2] [--modes none,aux-free,aux loss]

The layout does not change these numbers: the counts are summed over every rank that
routed tokens (tests/test_train_moe.py checks the per-step imbalance equal to one
process's at ep 2 and 4 and at 2 x 2 x 2).
"""

from __future__ import annotations

import argparse
import tempfile

import torch

from parallel3d.config import config_from_dict
from parallel3d.topology import Topology
from parallel3d.train.trainer import Trainer

EXPERTS = {"n_experts": 8, "top_k": 2, "ffn_dim": 96, "norm_topk_prob": True, "dense_layers": [0]}
MODES = {
    "none": {},
    "aux-free": {"expert_bias": True},
    "aux loss": {"aux_loss_coef": 0.01},
}


def _job(run_dir: str, steps: int, moe: dict) -> dict:
    return {"model": {"preset": "debug-moe", "moe": moe},
            "parallel": {"tp": 1, "pp": 1, "dp": 1},
            "train": {"steps": steps, "seed": 1234, "global_batch": 16, "micro_batch": 4, "seq_len": 128,
                      "lr": 3e-3, "warmup_steps": 20, "grad_clip": 1.0, "log_interval": 10_000},
            "data": {"source": "stdlib", "max_bytes": 8_000_000, "vocab_size": 2048},
            "eval": {"interval": 0}, "run": {"dir": run_dir}}


def run(mode: str, steps: int, rate: float) -> list[float]:
    moe = {**EXPERTS, **MODES[mode]}
    if moe.get("expert_bias"):
        moe["bias_update_rate"] = rate
    with tempfile.TemporaryDirectory() as tmp:
        cfg = config_from_dict(_job(tmp, steps, moe))
        history = Trainer(cfg, Topology.single(), log=False).fit()
    return [h["expert_imbalance"] for h in history]


def stays_below(series: list[float], bound: float) -> int | None:
    """The first step (1-based) from which every step's value is below ``bound``."""
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
    ap.add_argument("--rates", default="1e-3", help="aux-free bias update rates, comma-separated: a row each")
    ap.add_argument("--modes", default=",".join(MODES), help="which of none, aux-free, aux loss")
    args = ap.parse_args()
    torch.set_num_threads(1)  # 2 threads on a shared 2-core machine oversubscribe it (measured 10x slower at load 10)
    marks = [s for s in (1, 10, 50, 100, 150, 200) if s <= args.steps]
    print("| mode | " + " | ".join(f"step {s}" for s in marks)
          + " | below 1.3 from step | lowest (step) | mean of the last 50 |")
    print("|---|" + "---|" * (len(marks) + 3))
    runs = [(mode, rate) for mode in args.modes.split(",")
            for rate in ([float(r) for r in args.rates.split(",")] if mode == "aux-free" else [None])]
    for mode, rate in runs:
        series = run(mode, args.steps, rate or 0.0)
        tail = series[-50:]
        below = stays_below(series, 1.3)
        low = min(range(len(series)), key=series.__getitem__)
        label = f"{mode} (rate {rate:g})" if rate else mode
        print(f"| {label} | " + " | ".join(f"{series[s - 1]:.2f}" for s in marks)
              + f" | {below if below else 'never'} | {series[low]:.2f} ({low + 1}) | {sum(tail) / len(tail):.2f} |",
              flush=True)


if __name__ == "__main__":
    main()
