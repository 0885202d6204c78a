"""``parallel3d plan``: rank every valid layout for a job and recommend one."""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

from parallel3d.errors import UserError


# What a job plan assumes when the command line does not say (``parallel3d plan --help``).
DEFAULT_MAX_SEQ_LEN = 8192  # the models' pre-training context (Llama 3), when theirs is longer
DEFAULT_TOKENS_PER_STEP = 4 * 2**20  # Llama 2's pre-training batch, Llama 3 405B's first stage
DEFAULT_LORA_RANK = 16  # --lora without --lora-rank


def add_gpu_args(p, dry_run: bool = False) -> None:
    """``--gpu NAME`` and ``--gpu-spec KEY=VALUE,...`` (``plan``, ``train --dry-run``)."""
    from parallel3d.planner.hardware import SPEC_HELP, gpu_names

    p.add_argument("--gpu", choices=gpu_names(), metavar="NAME",
                   help=f"a GPU of the table: {', '.join(gpu_names())}"
                        + (" (the dry run then says, per stage, whether the job fits)" if dry_run else ""))
    p.add_argument("--gpu-spec", metavar="KEY=VALUE,...", help=SPEC_HELP)
    p.add_argument("--headroom", type=float, default=None, metavar="SHARE",
                   help="share of the GPU's memory kept free beyond the estimates and the 2 GiB "
                        "runtime reserve (default 0.05)")


def gpu_from_args(args, internode_gbit_per_s: float | None = None):
    """The GPU ``--gpu`` / ``--gpu-spec`` name or describe (the spec's keys over the named
    GPU when both are given), or None when neither is."""
    from parallel3d.planner.hardware import gpu_from_spec, gpu_named, with_headroom, with_internode

    gpu = gpu_named(args.gpu) if args.gpu else None
    if args.gpu_spec:
        gpu = gpu_from_spec(args.gpu_spec, gpu)
    if gpu is None:
        if getattr(args, "headroom", None) is not None:
            raise UserError("--headroom is a share of a GPU's memory: name the GPU (--gpu or --gpu-spec)")
        return None
    return with_headroom(with_internode(gpu, internode_gbit_per_s), getattr(args, "headroom", None))


def add_plan_parser(sub) -> None:
    p = sub.add_parser(
        "plan", help="predict memory and step time of every layout and recommend one",
        description="Rank every valid layout (tp, cp, pp, dp, micro-batch, schedule, ZeRO, "
                    "recomputation, sequence parallelism) of a job by predicted step time and "
                    "recommend the fastest that fits. Only --model, --gpus and the GPU are needed: "
                    "the rest defaults to the common case, printed with the plan.")
    p.add_argument("--model", required=True, help="a preset (debug, 1b, 8b, 70b) or a Hugging Face config.json")
    p.add_argument("--gpus", type=int, required=True, help="GPUs in the job")
    add_gpu_args(p)
    p.add_argument("--gpus-per-node", type=int, default=None,
                   help="GPUs in one node, i.e. one NVLink domain (default: the GPU's usual node, "
                        "8; gb200: 72)")
    p.add_argument("--seq-len", type=int, default=None,
                   help=f"tokens per sequence (default: the model's context, at most {DEFAULT_MAX_SEQ_LEN}; "
                        "longer than a preset's context raises its max_seq_len, as a long-context stage does)")
    p.add_argument("--global-batch", type=int, default=None,
                   help=f"sequences per optimizer step (default: {DEFAULT_TOKENS_PER_STEP // 2**20}M tokens "
                        "a step, rounded up to a multiple of --gpus)")
    p.add_argument("--nodes-interconnect", type=float, default=None, metavar="GBIT",
                   help="inter-node bandwidth per GPU in Gbit/s (default: the GPU's usual NIC)")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--reduce-dtype", default="fp32", choices=["fp32", "bf16"],
                   help="what data-parallel gradient reductions send (parallel.reduce_dtype; bf16: half "
                        "the bytes, each contribution rounded to bf16)")
    p.add_argument("--lora", action="store_true",
                   help=f"a LoRA fine-tune: the base frozen in --dtype, adapters of rank {DEFAULT_LORA_RANK} "
                        "on the attention and MLP projections (set --lora-rank, --lora-targets)")
    p.add_argument("--lora-rank", type=int, default=None, metavar="R",
                   help="LoRA's rank (lora.rank; implies --lora)")
    p.add_argument("--lora-targets", default=None, metavar="NAMES",
                   help="the projections that get adapters, comma-separated (lora.targets; implies --lora; "
                        "default all seven: q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj)")
    p.add_argument("--lora-dropout", type=float, default=None, metavar="P",
                   help="lora.dropout: one adapter's dropped input rebuilt at a time in the backward (implies --lora)")
    p.add_argument("--top", type=int, default=10, help="rows of the table")
    p.add_argument("--write-recipe", metavar="FILE", help="write the recommended layout as a TOML recipe")
    p.add_argument("--calibrate", metavar="RUN", help="refresh the compute efficiency from a run's "
                   "metrics.jsonl (a run directory, or the file; config.json must sit beside it)")
    for key in ("tp", "cp", "pp", "dp", "ep"):
        p.add_argument(f"--{key}", type=int, default=None, help=f"consider only this {key}")


def job_defaults(args, model, gpu) -> list[str]:
    """Fill ``--gpus-per-node``, ``--seq-len`` and ``--global-batch`` left unset; returns
    what was assumed, one phrase each."""
    assumed = []
    if args.gpus_per_node is None:
        args.gpus_per_node = gpu.gpus_per_node
        assumed.append(f"{args.gpus_per_node} GPUs a node ({gpu.name}'s usual node)")
    if args.seq_len is None:
        args.seq_len = min(model.max_seq_len, DEFAULT_MAX_SEQ_LEN)
        assumed.append(f"sequences of {args.seq_len} tokens (the model's context"
                       + (f", capped at {DEFAULT_MAX_SEQ_LEN})" if model.max_seq_len > DEFAULT_MAX_SEQ_LEN else ")"))
    if args.global_batch is None and args.seq_len >= 1 and args.gpus >= 1:
        per_gpu = -(-DEFAULT_TOKENS_PER_STEP // (args.seq_len * args.gpus))  # ceil
        args.global_batch = per_gpu * args.gpus
        assumed.append(f"a global batch of {args.global_batch} sequences "
                       f"({args.global_batch * args.seq_len / 2**20:.1f}M tokens a step: about "
                       f"{DEFAULT_TOKENS_PER_STEP // 2**20}M, a multiple of --gpus)")
    return assumed


def lora_from_args(args, model):
    """The :class:`~parallel3d.planner.spec.LoraSpec` of ``--lora``, ``--lora-rank``,
    ``--lora-targets`` and ``--lora-dropout``, or None when none is given."""
    from parallel3d.planner.spec import LORA_TARGETS, LoraSpec

    dropout = getattr(args, "lora_dropout", None)
    if not (args.lora or args.lora_rank is not None or args.lora_targets is not None or dropout is not None):
        return None
    if dropout is not None and not 0 <= dropout < 1:
        raise UserError(f"--lora-dropout {dropout} is outside [0, 1)")
    rank = DEFAULT_LORA_RANK if args.lora_rank is None else args.lora_rank
    if rank < 1:
        raise UserError(f"--lora-rank must be at least 1, got {rank}")
    targets = LORA_TARGETS
    if args.lora_targets is not None:
        targets = tuple(t.strip() for t in args.lora_targets.split(",") if t.strip())
        unknown = [t for t in targets if t not in LORA_TARGETS]
        if unknown or not targets:
            raise UserError(f"--lora-targets {args.lora_targets!r}: name projections among "
                            f"{','.join(LORA_TARGETS)}")
    return LoraSpec(rank, targets, dropout=dropout or 0.0)


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
    # a written recipe takes the shape (and, to train, the weights) from the folder
    return cfg, {"preset": "hf", "hf_checkpoint": str(path.resolve().parent)}


def _plan_job(args: argparse.Namespace):
    """The job ``args`` describe, checked, with :func:`job_defaults` filled into ``args``:
    (GPU, model, the recipe's [model] keys, the defaults assumed, one phrase each). A
    ``--seq-len`` past a preset's context raises its max_seq_len; past a config.json's, an error."""
    from parallel3d.models.llama import PRESETS

    if not (args.gpu or args.gpu_spec):
        raise UserError("name the GPU: --gpu NAME (see --help for the table) or describe it with "
                        "--gpu-spec tflops=N,memory_gib=N,intra_gbyte_s=N,inter_gbit_s=N")
    gpu = gpu_from_args(args, args.nodes_interconnect)
    model, model_keys = resolve_model(args.model)
    for name in ("gpus", "gpus_per_node", "seq_len", "global_batch", "top"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise UserError(f"--{name.replace('_', '-')} must be at least 1, got {value}")
    assumed = job_defaults(args, model, gpu)
    if args.gpus % args.gpus_per_node and args.gpus > args.gpus_per_node:
        raise UserError(f"--gpus {args.gpus} is not a whole number of nodes of {args.gpus_per_node} "
                        "(set --gpus-per-node)")
    recipe = Path(args.write_recipe) if args.write_recipe else None
    if recipe is not None and (recipe.is_dir() or not recipe.parent.is_dir()):
        why = "is a directory" if recipe.is_dir() else f"is in '{recipe.parent}', which is not a directory"
        raise UserError(f"--write-recipe '{recipe}' {why}: give a file path for the TOML recipe")
    if args.seq_len > model.max_seq_len:
        if args.model not in PRESETS:
            # a config.json's max_position_embeddings is what its rotary scaling covers
            raise UserError(f"--seq-len {args.seq_len} exceeds the model's max_seq_len {model.max_seq_len} "
                            f"(max_position_embeddings of {args.model})")
        # A preset is a shape trained from scratch: its context is its pre-training stage's,
        # and a long-context stage raises it (Llama 3: 8K, then up to 128K with RoPE theta
        # 500000); the written recipe sets model.max_seq_len.
        assumed.append(f"model.max_seq_len raised from {model.max_seq_len} to {args.seq_len}")
        model = replace(model, max_seq_len=args.seq_len)
        model_keys = {**model_keys, "max_seq_len": args.seq_len}
    return gpu, model, model_keys, assumed


def _fixed_degrees(args: argparse.Namespace, model) -> dict:
    """The degrees (and reduce dtype) the command line fixes, for the search; ``--ep``
    checked against the model's experts."""
    fixed = {k: getattr(args, k) for k in ("tp", "cp", "pp", "dp", "ep") if getattr(args, k) is not None}
    if args.reduce_dtype != "fp32":
        fixed["reduce_dtype"] = args.reduce_dtype
    if fixed.get("ep", 1) > 1 and model.moe is None:
        raise UserError(f"--ep {args.ep}: expert parallelism needs a Mixture-of-Experts model "
                        "(a Hugging Face config.json of Qwen3-MoE, Mixtral, OLMoE or Qwen2-MoE): drop --ep")
    if fixed.get("ep", 1) > 1 and model.moe.n_experts % args.ep:
        raise UserError(f"--ep {args.ep} does not divide the model's {model.moe.n_experts} experts: "
                        f"choose a divisor of {model.moe.n_experts}")
    return fixed


def _write_recipe(args: argparse.Namespace, best, work, model_keys: dict, gpu) -> None:
    """Write the layout ``best`` as a TOML recipe to ``--write-recipe``."""
    from parallel3d.planner.report import recipe_text

    try:
        Path(args.write_recipe).write_text(recipe_text(best, work, model_keys, args.gpus,
                                                       args.gpus_per_node, gpu))
    except OSError as e:
        raise UserError(f"--write-recipe '{args.write_recipe}' cannot be written: {e.strerror}") from None
    print(f"wrote {args.write_recipe}")


def run_plan(args: argparse.Namespace) -> int:
    """``parallel3d plan``: print the assumptions, the ranked layouts and why the best one
    wins (under LoRA also the job trained in full and the fewest GPUs that fit), and write
    it as a recipe when asked; returns 1 when no layout fits, else 0."""
    from parallel3d.planner.calibrate import calibrate_from_run, default_efficiency
    from parallel3d.planner.report import assumptions, lora_lines, reasons, table
    from parallel3d.planner.search import recommend, search
    from parallel3d.planner.spec import Workload

    gpu, model, model_keys, assumed = _plan_job(args)
    eff = default_efficiency()
    if args.calibrate:
        eff, how = calibrate_from_run(args.calibrate, gpu, args.gpus_per_node)
        print(f"calibrated: {how}")
    work = Workload(model, args.seq_len, args.global_batch, args.dtype, lora_from_args(args, model))
    fixed = _fixed_degrees(args, model)
    candidates = search(work, args.gpus, args.gpus_per_node, gpu, eff, fixed)
    if not candidates:
        raise UserError(f"no valid layout: {args.gpus} GPUs cannot split {model.n_layers} layers, "
                        f"{model.n_heads} heads and a batch of {args.global_batch} (check --global-batch)")
    if assumed:
        print("assumed (set the option to change): " + "; ".join(assumed))
    print(assumptions(gpu, eff, args.gpus, args.gpus_per_node))
    print(f"{len(candidates)} valid layouts, {sum(c.fits for c in candidates)} fit:")
    print(table(candidates, args.top))
    best = recommend(candidates)
    if best is None:
        closest = candidates[0]
        print(f"no layout fits; the closest, {closest.layout.describe()}, {closest.verdict()}")
        return 1
    print()
    for line in reasons(candidates, best, args.gpus_per_node, fixed):
        print(line)
    if work.lora is not None:
        for line in lora_lines(work, best, args.gpus, args.gpus_per_node, gpu, eff, fixed):
            print(line)
    if args.write_recipe:
        _write_recipe(args, best, work, model_keys, gpu)
    return 0
