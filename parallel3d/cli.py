"""``parallel3d`` command line.

    parallel3d train [RECIPE] [--section.key=value ...]

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
    from parallel3d.distributed import env_world_size, pick_backend, under_torchrun
    from parallel3d.train.setup import check_job, check_paths, check_vocab, resolve_model_config

    cfg = load_config(args.recipe or default_recipe(), overrides)
    world = env_world_size() if under_torchrun() else cfg.launch.nproc
    if cfg.launch.nproc < 1:
        raise UserError(f"launch.nproc must be at least 1, got {cfg.launch.nproc}")
    check_job(cfg, resolve_model_config(cfg.model), world)  # fail before any worker starts
    pick_backend(cfg.launch.backend)
    check_paths(cfg)

    from parallel3d.train.worker import run_worker, worker_main

    if under_torchrun() or cfg.launch.nproc == 1:
        return run_worker(cfg.to_dict())
    from parallel3d.launch import launch_local
    from parallel3d.train.data import prepare_corpus

    corpus = prepare_corpus(cfg.data)  # once, here, rather than racing in the workers
    check_vocab(corpus.meta["vocab_size"], resolve_model_config(cfg.model))
    return launch_local(worker_main, (cfg.to_dict(),), cfg.launch.nproc)


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
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    try:
        if args.command == "train":
            return _train(args, rest)
    except UserError as e:
        print(f"parallel3d: error: {e}", file=sys.stderr, flush=True)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
