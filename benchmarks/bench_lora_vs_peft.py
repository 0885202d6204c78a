"""A LoRA training step: parallel3d (one process, the trainer's step) against ``peft`` on
transformers, side by side in one run (issue 35, acceptance 5: at most 1.0x).

Both sides train the same base weights (the trainer's seeded init, copied into a
``transformers.LlamaForCausalLM``), the same adapters (parallel3d's initial A and zero B
copied into peft's ``lora_A`` / ``lora_B``), on the same global batch of each step, fp32,
AdamW over the adapters with the same lr, betas, eps, weight decay and global-norm clip
at 1.0. A parallel3d step is ``Trainer.train_step()`` (forward, backward, gradient
reduction, clip, update; its data prefetched in the background); a peft step is forward,
``F.cross_entropy``, backward, ``clip_grad_norm_``, ``AdamW.step``, ``zero_grad``. The
sides alternate step by step (a loaded machine slows both alike); the first ``--warmup``
steps of each are left out; printed: each side's median step time and quartiles, their
ratio, the ratio in each of ``--rounds`` consecutive rounds of the measured steps (their
median and range: the spread a loaded machine gives), the load average before and after,
and the largest difference of the per-step losses (the two compute the same function: a
check that both do the same work).

    python benchmarks/bench_lora_vs_peft.py [--steps 30] [--rounds 5] [--rank 16] [--targets all] [--dropout 0.1]

With ``--dropout`` both sides drop the adapters' inputs (parallel3d's hashed masks,
``lora/dropout.py``; peft's ``nn.Dropout``): their losses then differ by their masks.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.nn.functional as F

from _common import GlobalBatches, job

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def build(args):
    import dataclasses

    import peft
    import transformers

    from parallel3d.config import LoraConfig
    from parallel3d.models.llama.hf import config_to_hf, name_to_hf
    from parallel3d.topology import Topology
    from parallel3d.train.setup import resolve_model_config
    from parallel3d.train.trainer import Trainer

    targets = ALL if args.targets == "all" else args.targets.split(",")
    model = {"n_layers": args.layers, "dim": args.dim, "n_heads": args.dim // 64, "n_kv_heads": args.dim // 128,
             "ffn_dim": int(args.dim * 8 / 3) // 16 * 16, "vocab_size": 2048}
    cfg = job({}, args.steps, global_batch=args.batch, micro_batch=args.batch, seq_len=args.seq, model=model)
    cfg = dataclasses.replace(cfg, lora=LoraConfig(rank=args.rank, alpha=2.0 * args.rank, targets=targets,
                                                   dropout=args.dropout))
    trainer = Trainer(cfg, Topology.single(), log=False)

    hf_cfg = transformers.LlamaConfig(**config_to_hf(resolve_model_config(cfg.model)))
    hf_cfg._attn_implementation = "sdpa"
    hf = transformers.LlamaForCausalLM(hf_cfg)
    state = trainer.model.state_dict()
    base = {name_to_hf(n): t for n, t in state.items() if ".lora_" not in n}
    hf.load_state_dict(base, strict=True)
    tuned = peft.get_peft_model(hf, peft.LoraConfig(r=args.rank, lora_alpha=2.0 * args.rank,
                                                    target_modules=targets, lora_dropout=args.dropout))
    with torch.no_grad():  # parallel3d's initial adapters into peft's
        for name, p in tuned.named_parameters():
            if ".lora_" in name:
                ours = name.replace("base_model.model.model.", "").replace(".default", "")
                p.copy_(state[ours])
    t = cfg.train
    params = [p for p in tuned.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps, weight_decay=t.weight_decay)
    return cfg, trainer, tuned, params, opt


def peft_step(tuned, params, opt, x, y, clip: float) -> float:
    logits = tuned(input_ids=x).logits
    loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, clip)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return float(loss.detach())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=5, help="rounds the measured steps are cut into")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--targets", default="all", help="'all' or a comma-separated list")
    parser.add_argument("--dropout", type=float, default=0.0,
                        help="lora.dropout on both sides (their masks differ: the losses then differ by it)")
    args = parser.parse_args()
    load_before = os.getloadavg()
    cfg, trainer, tuned, params, opt = build(args)
    batches = GlobalBatches(cfg)
    times = {"parallel3d": [], "peft": []}
    losses = {"parallel3d": [], "peft": []}
    for step in range(args.steps):
        t0 = time.perf_counter()
        losses["parallel3d"].append(trainer.train_step()["loss"])
        times["parallel3d"].append(time.perf_counter() - t0)
        x, y = batches(step)
        t0 = time.perf_counter()
        losses["peft"].append(peft_step(tuned, params, opt, x, y, cfg.train.grad_clip))
        times["peft"].append(time.perf_counter() - t0)
    trainer.release()
    med = {k: statistics.median(v[args.warmup:]) for k, v in times.items()}
    trainable = sum(p.numel() for p in params)
    print(f"LoRA rank {args.rank} on {args.targets}: {trainable:,} adapter parameters; "
          f"{args.layers} layers x dim {args.dim}, batch {args.batch} x {args.seq} tokens, fp32, "
          f"{torch.get_num_threads()} threads")
    for k, v in times.items():
        q1, _, q3 = statistics.quantiles(v[args.warmup:], n=4)
        print(f"  {k:<11} median step {med[k] * 1e3:8.1f} ms, quartiles {q1 * 1e3:.1f}-{q3 * 1e3:.1f} ms "
              f"(steps {args.warmup + 1}-{args.steps})")
    print(f"  parallel3d / peft: {med['parallel3d'] / med['peft']:.3f}x")
    measured = args.steps - args.warmup
    size = max(1, measured // args.rounds)
    ratios = []
    for start in range(args.warmup, args.steps - size + 1, size):
        ours, theirs = (statistics.median(times[k][start:start + size]) for k in ("parallel3d", "peft"))
        ratios.append(ours / theirs)
    print(f"  per round of {size} steps: {' '.join(f'{r:.3f}' for r in ratios)}; median "
          f"{statistics.median(ratios):.3f}x, range {min(ratios):.3f}-{max(ratios):.3f}x")
    print(f"  load average (1, 5, 15 min): before {' '.join(f'{x:.2f}' for x in load_before)}, "
          f"after {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    diff = max(abs(a - b) / abs(b) for a, b in zip(losses["parallel3d"], losses["peft"]))
    print(f"  per-step losses: largest relative difference {diff:.2e}"
          + (f" (dropout {args.dropout}: each side's own masks)" if args.dropout else ""))


if __name__ == "__main__":
    main()
