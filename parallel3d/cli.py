"""``parallel3d`` command line.

    parallel3d train [RECIPE] [--dry-run] [--section.key=value ...]
    parallel3d plan --model PRESET_OR_HF_CONFIG --gpus N --gpus-per-node G --gpu GPU ...
    parallel3d convert SRC DST --to {hf,parallel3d} [--config CONFIG.json] [--dtype D]

With no recipe, ``train`` runs the embedded ``recipes/debug_cpu.toml``. Errors the user
can fix print one line and exit with status 2.
"""

from __future__ import annotations

import argparse
import sys
from importlib import resources

from parallel3d.errors import EXIT_USAGE, UserError


def default_recipe() -> str:
    return str(resources.files("parallel3d.recipes") / "debug_cpu.toml")


def _train(args: argparse.Namespace, overrides: list[str]) -> int:
    from parallel3d.config import load_config
    from parallel3d.distributed import env_world_size, under_torchrun
    from parallel3d.train.setup import check_job, job_world_size, resolve_model_config

    cfg = load_config(args.recipe or default_recipe(), overrides)
    world = job_world_size(cfg)  # checks launch.nnodes and launch.nproc
    if under_torchrun():
        world = env_world_size()
    if args.dry_run:
        from parallel3d.train.dryrun import dry_run

        dry_run(cfg, world)
        return 0
    if cfg.launch.nnodes > 1 and not under_torchrun():
        raise UserError(f"launch.nnodes {cfg.launch.nnodes} > 1: start the job with torchrun on every node "
                        "(or check it here with --dry-run)")
    check_job(cfg, resolve_model_config(cfg.model), world)  # fail before any worker starts

    from parallel3d.train.worker import run_training, worker_main

    if under_torchrun() or cfg.launch.nproc == 1:
        run_training(cfg)
        return 0
    from parallel3d.launch import launch_local
    from parallel3d.train.data import prepare_corpus

    prepare_corpus(cfg.data)  # once, here, rather than racing in the workers
    return launch_local(worker_main, (cfg.to_dict(),), cfg.launch.nproc)


def _convert(args: argparse.Namespace) -> int:
    from parallel3d.checkpoint.convert import convert

    max_bytes = int(float(args.max_shard_gb) * 2**30)
    if max_bytes <= 0:
        raise UserError(f"--max-shard-gb must be positive, got {args.max_shard_gb}")
    convert(args.src, args.dst, args.to, config=args.config, dtype=args.dtype,
            verify=not args.no_verify, max_shard_bytes=max_bytes)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="parallel3d", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="train a model from a TOML recipe",
                           epilog="overrides: --section.key=value, e.g. --parallel.dp=2 --launch.nproc=2")
    train.add_argument("recipe", nargs="?", help="TOML recipe (default: recipes/debug_cpu.toml)")
    train.add_argument("--dry-run", action="store_true",
                       help="check the whole job at its world size and print layout, stages and memory; "
                            "start nothing")
    from parallel3d.planner.cli import add_plan_parser

    add_plan_parser(sub)
    conv = sub.add_parser(
        "convert", help="convert a checkpoint (Hugging Face, parallel3d, DeepSpeed) to hf or parallel3d",
        description="Streams tensor by tensor (memory: about the largest tensor), then reads "
                    "everything back and compares it with the source.")
    conv.add_argument("src", help="Hugging Face folder, parallel3d checkpoint or DeepSpeed checkpoint")
    conv.add_argument("dst", help="output folder")
    conv.add_argument("--to", required=True, choices=["hf", "parallel3d"])
    conv.add_argument("--config", help="Hugging Face config.json for a DeepSpeed source "
                                       "(default: config.json beside or above it)")
    conv.add_argument("--dtype", choices=["float32", "bfloat16", "float16"],
                      help="cast the weights (default: keep the source's dtype)")
    conv.add_argument("--max-shard-gb", default="5", help="largest output file, GiB (default 5)")
    conv.add_argument("--no-verify", action="store_true", help="skip reading the output back")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    try:
        if args.command == "train":
            return _train(args, rest)
        if args.command == "plan":
            if rest:
                raise UserError(f"unexpected argument(s) for plan: {' '.join(rest)}")
            from parallel3d.planner.cli import run_plan

            return run_plan(args)
        if args.command == "convert":
            if rest:
                raise UserError(f"unexpected argument(s) for convert: {' '.join(rest)}")
            return _convert(args)
    except UserError as e:
        print(f"parallel3d: error: {e}", file=sys.stderr, flush=True)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
