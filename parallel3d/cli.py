"""parallel3d: train LLMs with tensor, pipeline and data parallelism.

    parallel3d train [RECIPE] [--dry-run [--gpu NAME | --gpu-spec K=V,...]] [--section.key=value ...]
    parallel3d report RUN_DIR
    parallel3d plan --model PRESET_OR_HF_CONFIG --gpus N (--gpu NAME | --gpu-spec K=V,...) [...]
    parallel3d scaling [RECIPE] --ranks 1,2,4,8 [--weak] [--section.key=value ...]
    parallel3d convert SRC DST --to {hf,parallel3d,dcp} [--config CONFIG.json] [--dtype D]
    parallel3d prepare-data INPUTS... --tokenizer DIR --out DIR [options]

With no recipe, ``train`` runs the embedded ``recipes/debug_cpu.toml``. Errors the user
can fix print one line and exit with status 2. A ``--local_rank=N`` / ``--local-rank N``
argument added by a launcher (DeepSpeed's) is dropped: the rank comes from LOCAL_RANK.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from importlib import resources

from parallel3d.errors import EXIT_USAGE, UserError


def default_recipe() -> str:
    return str(resources.files("parallel3d.recipes") / "debug_cpu.toml")


def _train(args: argparse.Namespace, overrides: list[str]) -> int:
    from parallel3d.config import load_config
    from parallel3d.distributed import env_world_size, pick_backend, under_torchrun
    from parallel3d.reliability.elastic import resolve_dp
    from parallel3d.train.dryrun import check_start
    from parallel3d.train.setup import check_job, job_world_size, resolve_model_config

    started = time.monotonic()
    cfg = load_config(args.recipe or default_recipe(), overrides)
    world = job_world_size(cfg)  # checks launch.nnodes and launch.nproc
    if under_torchrun():
        world = env_world_size()
    cfg = resolve_dp(cfg, world)  # parallel.dp = "auto": from this world
    if args.dry_run:
        from parallel3d.planner.cli import gpu_from_args
        from parallel3d.train.dryrun import dry_run

        found = dry_run(cfg, world, gpu=gpu_from_args(args))
        check_start(cfg, found["model_cfg"])  # what the run checks before its first step
        return 0
    if args.gpu or args.gpu_spec:
        raise UserError("--gpu / --gpu-spec say whether a job fits a GPU: use them with --dry-run")
    if cfg.launch.nnodes > 1 and not under_torchrun():
        raise UserError(f"launch.nnodes {cfg.launch.nnodes} > 1: start the job with torchrun on every node "
                        "(or check it here with --dry-run)")
    model = resolve_model_config(cfg.model)
    check_job(cfg, model, world)  # fail before any worker starts
    backend = pick_backend(cfg.launch.backend)
    # the checks of the workers before their first step, here: the dry run's, in its order
    facts = check_start(cfg, model, out=lambda line: None)
    speaks = int(os.environ.get("RANK", "0")) == 0  # the launching process, or rank 0 of torchrun's
    if speaks:
        _print_lines(_banner(cfg, model, world, backend, facts))

    from parallel3d.train.worker import run_worker, worker_main

    if under_torchrun() or cfg.launch.nproc == 1:
        code = run_worker(cfg.to_dict())
    else:
        from parallel3d.launch import launch_local
        from parallel3d.train.data import check_data, prepare_corpus

        if facts is None:  # the stdlib corpus: built once, here, rather than racing in the workers
            check_data(cfg, model.vocab_size, prepare_corpus(cfg.data))
        code = launch_local(worker_main, (cfg.to_dict(),), cfg.launch.nproc)
    if code == 0 and speaks:
        _print_lines(_summary(cfg, model, time.monotonic() - started))
    return code


def _print_lines(lines: list[str]) -> None:
    print("\n".join(lines), flush=True)


def _banner(cfg, model, world: int, backend: str, facts=None) -> list[str]:
    from parallel3d.data.stdlib import describe
    from parallel3d.launch import job_nodes
    from parallel3d.observe.console import banner
    from parallel3d.planner.spec import layer_split
    from parallel3d.train.metrics import resolved_config

    par = cfg.parallel
    split = layer_split(model, par.pp, par.virtual_stages, par.pp_layers, par.schedule)
    data = (f"prepared dataset {cfg.data.path}" if cfg.data.path and not cfg.data.blend
            else describe(cfg.data))
    if facts is not None:
        data += f"; {data_use(facts, cfg)}"
    return banner(cfg, model, world, split, backend, resolved_config(cfg).train.dtype, data,
                  nodes=job_nodes(world, cfg.launch.nnodes))


def data_use(facts, cfg) -> str:
    """The training split's size and how many times the run reads it."""
    from parallel3d.train.dryrun import epochs_phrase

    return (f"{facts.train_tokens:,} training tokens ({facts.train_samples:,} sequences): "
            f"{epochs_phrase(facts.epochs(cfg))}")


def _summary(cfg, model, wall_s: float) -> list[str]:
    from pathlib import Path

    from parallel3d.observe.console import outputs, summary
    from parallel3d.observe.report import load_metrics
    from parallel3d.train.dryrun import check_start

    run_dir = Path(cfg.run.dir)
    try:
        records = load_metrics(run_dir)
    except UserError as e:  # the run is over: say why there is no summary, do not fail it
        return [f"parallel3d: no summary: {e}"]
    ckpt = cfg.checkpoint
    found = outputs(run_dir, Path(ckpt.dir) if ckpt.dir else run_dir / "checkpoints",
                    run_dir / ckpt.export_hf if ckpt.export_hf else None)
    lines = summary(records, cfg.train.global_batch * cfg.train.seq_len, wall_s, found, run_dir)
    try:
        facts = check_start(cfg, model, out=lambda line: None)
    except UserError:
        facts = None
    if facts is not None:  # on the "done: ..." line: how often the data was read
        epochs = facts.epochs(cfg)
        lines[0] += (f"; {epochs:.1f} passes over the training split (data repeated)" if epochs > 1
                     else f"; {epochs:.0%} of the training split read")
    return lines


def _convert(args: argparse.Namespace) -> int:
    from parallel3d.checkpoint.convert import convert

    try:
        max_bytes = int(float(args.max_shard_gb) * 2**30)
    except (ValueError, OverflowError):
        raise UserError(f"--max-shard-gb expects a number of GiB, got '{args.max_shard_gb}'") from None
    if max_bytes <= 0:
        raise UserError(f"--max-shard-gb must be positive, got {args.max_shard_gb}")
    try:
        budget = int(float(args.memory_gb) * 2**30)
    except (ValueError, OverflowError):
        raise UserError(f"--memory-gb expects a number of GiB, got '{args.memory_gb}'") from None
    if budget <= 0 or args.threads < 1:
        raise UserError(f"--memory-gb ({args.memory_gb}) and --threads ({args.threads}) must be positive")
    convert(args.src, args.dst, args.to, config=args.config, dtype=args.dtype,
            verify="none" if args.no_verify else args.verify, max_shard_bytes=max_bytes,
            overwrite=args.overwrite, budget_bytes=budget, threads=args.threads)
    return 0


def _prepare_data(args: argparse.Namespace) -> int:
    from parallel3d.data.prepare import prepare_data

    report = prepare_data(args.inputs, args.tokenizer, args.out, text_key=args.text_key,
                          eos_token=args.eos_token, workers=args.workers,
                          shard_tokens=args.shard_tokens, val_fraction=args.val_fraction,
                          overwrite=args.overwrite, progress=not args.quiet, format=args.format)
    print(report.summary(), flush=True)
    return 0


def _add_prepare_data(sub) -> None:
    from parallel3d.data.prepare import DEFAULT_SHARD_TOKENS

    p = sub.add_parser(
        "prepare-data", help="tokenize text / JSON lines / Parquet into token shards for training",
        description="Tokenize INPUTS (files, directories, globs: .txt = one document per file, "
                    ".jsonl/.json = one per line, .parquet = one per row; .gz allowed except Parquet) "
                    "with a Hugging Face tokenizer into memory-mapped token shards; train on them "
                    "with --data.path=OUT.")
    p.add_argument("inputs", nargs="+", metavar="INPUTS")
    p.add_argument("--tokenizer", required=True, metavar="DIR", help="folder with tokenizer.json")
    p.add_argument("--out", required=True, metavar="DIR", help="output dataset directory")
    p.add_argument("--format", default="text", choices=["text", "chat"],
                   help="text: documents (default); chat: JSON lines of conversations ('messages' or "
                        "'prompt'/'response'), rendered with the tokenizer's chat template, only the "
                        "assistant turns trained on")
    p.add_argument("--text-key", default="text", help="JSON key / Parquet column of the text (default: text)")
    p.add_argument("--eos-token", default=None, help="EOS token (default: from tokenizer_config.json)")
    p.add_argument("--workers", type=int, default=None, help="tokenizer processes (default: all cores)")
    p.add_argument("--shard-tokens", type=int, default=DEFAULT_SHARD_TOKENS,
                   help=f"tokens per shard file (default: {DEFAULT_SHARD_TOKENS})")
    p.add_argument("--val-fraction", type=float, default=0.0,
                   help="share of the documents held out as the validation split (default: 0)")
    p.add_argument("--overwrite", action="store_true", help="replace a dataset already in --out")
    p.add_argument("--quiet", action="store_true", help="no progress output")


def drop_launcher_args(argv: list[str]) -> list[str]:
    """Remove ``--local_rank=N`` / ``--local-rank N`` that launchers append."""
    out, skip = [], False
    for i, arg in enumerate(argv):
        if skip:
            skip = False
        elif arg.split("=", 1)[0] in ("--local_rank", "--local-rank"):
            skip = "=" not in arg and i + 1 < len(argv) and argv[i + 1].isdigit()
        else:
            out.append(arg)
    return out


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (status 2) like every other input error."""

    def error(self, message: str):
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="parallel3d", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="train a model from a TOML recipe",
                           epilog="overrides: --section.key=value, e.g. --parallel.dp=2 --launch.nproc=2")
    train.add_argument("recipe", nargs="?", help="TOML recipe (default: recipes/debug_cpu.toml)")
    train.add_argument("--dry-run", action="store_true",
                       help="check the whole job at its world size and print layout, stages and memory; "
                            "start nothing")
    from parallel3d.planner.cli import add_gpu_args, add_plan_parser

    add_gpu_args(train, dry_run=True)
    report = sub.add_parser("report", help="plot a run's metrics.jsonl to RUN_DIR/report.png and summarise it")
    report.add_argument("run_dir", help="the run directory (run.dir of the recipe)")
    add_plan_parser(sub)
    from parallel3d.scaling.command import add_scaling_parser

    add_scaling_parser(sub)
    conv = sub.add_parser(
        "convert", help="convert a checkpoint (Hugging Face, parallel3d, DeepSpeed ZeRO 0-3, torch DCP, "
                        "Megatron-Core) to hf, parallel3d or dcp",
        description="Streams: reader threads fetch the next tensors while one is written and hashed "
                    "(memory: about --memory-gb or the largest tensor, whichever is larger); the "
                    "output is renamed into place once verified.")
    conv.add_argument("src", help="Hugging Face folder, parallel3d, DeepSpeed, DCP or Megatron checkpoint")
    conv.add_argument("dst", help="output folder")
    conv.add_argument("--to", required=True, choices=["hf", "parallel3d", "dcp"])
    conv.add_argument("--config", help="Hugging Face config.json for a DeepSpeed, DCP or Megatron source "
                                       "(default: config.json beside or above it; Megatron: its args)")
    conv.add_argument("--dtype", choices=["float32", "bfloat16", "float16"],
                      help="cast the weights (default: keep the source's dtype)")
    conv.add_argument("--max-shard-gb", default="5", help="largest output file, GiB (default 5)")
    conv.add_argument("--verify", default="hash", choices=["hash", "full", "none"],
                      help="hash: sha256 while writing, headers re-read (default); full: also read "
                           "every tensor back and compare")
    conv.add_argument("--no-verify", action="store_true", help="same as --verify none")
    conv.add_argument("--memory-gb", default="1", help="most GiB of tensors read ahead (default 1)")
    conv.add_argument("--threads", type=int, default=4, help="reader threads (default 4)")
    conv.add_argument("--overwrite", action="store_true", help="replace a DST that is not empty")
    _add_prepare_data(sub)
    return parser


def join_override_values(argv: list[str]) -> list[str]:
    """``--section.key value`` as ``--section.key=value`` (argparse would otherwise take the
    value for the recipe); a dotted option is always an override, so its next word, unless
    it is an option itself, is its value."""
    out, i = [], 0
    while i < len(argv):
        arg = argv[i]
        name = arg[2:]
        if (arg.startswith("--") and "=" not in arg and "." in name and i + 1 < len(argv)
                and not argv[i + 1].startswith("--")):
            out.append(f"{arg}={argv[i + 1]}")
            i += 2
        else:
            out.append(arg)
            i += 1
    return out


def main(argv: list[str] | None = None) -> int:
    argv = join_override_values(drop_launcher_args(list(sys.argv[1:] if argv is None else argv)))
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    try:
        if args.command == "train":
            return _train(args, rest)
        if args.command == "report":
            if rest:
                raise UserError(f"unexpected argument(s) for report: {' '.join(rest)}")
            from parallel3d.observe.report import write_report

            write_report(args.run_dir)
            return 0
        if args.command == "plan":
            if rest:
                raise UserError(f"unexpected argument(s) for plan: {' '.join(rest)}")
            from parallel3d.planner.cli import run_plan

            return run_plan(args)
        if args.command == "scaling":
            from parallel3d.scaling.command import run_scaling

            return run_scaling(args, rest, default_recipe())
        if args.command == "prepare-data":
            if rest:
                raise UserError(f"unexpected argument(s) for prepare-data: {' '.join(rest)}")
            return _prepare_data(args)
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
