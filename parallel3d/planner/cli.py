"""``parallel3d plan``: rank every valid layout for a job and recommend one."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path

from parallel3d.errors import UserError


def add_plan_parser(sub) -> None:
    from parallel3d.planner.hardware import GPUS

    p = sub.add_parser("plan", help="predict memory and step time of every layout and recommend one")
    p.add_argument("--model", required=True, help="a preset (debug, 1b, 8b, 70b) or a Hugging Face config.json")
    p.add_argument("--gpus", type=int, required=True, help="GPUs in the job")
    p.add_argument("--gpus-per-node", type=int, required=True)
    p.add_argument("--gpu", required=True, choices=sorted(GPUS))
    p.add_argument("--seq-len", type=int, required=True)
    p.add_argument("--global-batch", type=int, required=True, help="sequences per optimizer step")
    p.add_argument("--nodes-interconnect", type=float, default=None, metavar="GBIT",
                   help="inter-node bandwidth per GPU in Gbit/s (default: the GPU's usual NIC)")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--top", type=int, default=10, help="rows of the table")
    p.add_argument("--write-recipe", metavar="FILE", help="write the recommended layout as a TOML recipe")
    p.add_argument("--calibrate", metavar="RUN", help="refresh the compute efficiency from a run's "
                   "metrics.jsonl (a run directory, or the file; config.json must sit beside it)")
    for key in ("tp", "pp", "dp"):
        p.add_argument(f"--{key}", type=int, default=None, help=f"consider only this {key}")


def resolve_model(spec: str):
    """(LlamaConfig, the [model] keys of a recipe) for a preset name or an HF config.json."""
    from parallel3d.models.llama import PRESETS
    from parallel3d.models.llama.hf import config_from_hf

    if spec in PRESETS:
        return PRESETS[spec], {"preset": spec}
    path = Path(spec)
    if not path.is_file():
        raise UserError(f"--model '{spec}' is neither a preset ({', '.join(PRESETS)}) nor a config.json file")
    try:
        cfg = config_from_hf(json.loads(path.read_text()))
    except (ValueError, KeyError) as e:
        raise UserError(f"--model {spec}: {e}") from None
    keys = {k: v for k, v in asdict(cfg).items() if k not in ("max_seq_len", "init_std")}
    return cfg, {"preset": "debug", **keys}


def run_plan(args: argparse.Namespace) -> int:
    from parallel3d.planner.calibrate import calibrate_from_run, default_efficiency
    from parallel3d.planner.hardware import gpu_named
    from parallel3d.planner.report import assumptions, reasons, recipe_text, table
    from parallel3d.planner.search import recommend, search
    from parallel3d.planner.spec import Workload

    for name in ("gpus", "gpus_per_node", "seq_len", "global_batch", "top"):
        if getattr(args, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.gpus % args.gpus_per_node and args.gpus > args.gpus_per_node:
        raise UserError(f"--gpus {args.gpus} is not a whole number of nodes of {args.gpus_per_node}")
    recipe = Path(args.write_recipe) if args.write_recipe else None
    if recipe is not None and (recipe.is_dir() or not recipe.parent.is_dir()):
        why = "is a directory" if recipe.is_dir() else f"is in '{recipe.parent}', which is not a directory"
        raise UserError(f"--write-recipe '{recipe}' {why}: give a file path for the TOML recipe")
    model, model_keys = resolve_model(args.model)
    if args.seq_len > model.max_seq_len:
        raise UserError(f"--seq-len {args.seq_len} exceeds the model's max_seq_len {model.max_seq_len}")
    gpu = gpu_named(args.gpu, args.nodes_interconnect)
    eff = default_efficiency()
    if args.calibrate:
        eff, how = calibrate_from_run(args.calibrate, gpu, args.gpus_per_node)
        print(f"calibrated: {how}")
    work = Workload(model, args.seq_len, args.global_batch, args.dtype)
    fixed = {k: getattr(args, k) for k in ("tp", "pp", "dp") if getattr(args, k) is not None}
    candidates = search(work, args.gpus, args.gpus_per_node, gpu, eff, fixed)
    if not candidates:
        raise UserError(f"no valid layout: {args.gpus} GPUs cannot split {model.n_layers} layers, "
                        f"{model.n_heads} heads and a batch of {args.global_batch} (check --global-batch)")
    print(assumptions(gpu, eff, args.gpus, args.gpus_per_node))
    print(f"{len(candidates)} valid layouts, {sum(c.fits for c in candidates)} fit:")
    print(table(candidates, args.top))
    best = recommend(candidates)
    if best is None:
        closest = candidates[0]
        print(f"no layout fits; the closest, {closest.layout.describe()}, {closest.verdict()}")
        return 1
    print()
    for line in reasons(candidates, best, args.gpus_per_node):
        print(line)
    if args.write_recipe:
        try:
            Path(args.write_recipe).write_text(recipe_text(best, work, model_keys, args.gpus,
                                                           args.gpus_per_node, gpu))
        except OSError as e:
            raise UserError(f"--write-recipe '{args.write_recipe}' cannot be written: {e.strerror}") from None
        print(f"wrote {args.write_recipe}")
    return 0
