"""``parallel3d scaling RECIPE --ranks 1,2,4,8 [--weak]``: measure, extend, say where it flattens.

Writes ``OUT/scaling.txt`` (the table), ``OUT/scaling.json`` (every figure) and
``OUT/scaling.png``; each size's run is kept in ``OUT/ranksN`` with its log beside it.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from parallel3d.errors import UserError


def add_scaling_parser(sub) -> None:
    p = sub.add_parser(
        "scaling", help="measure a recipe's tokens/s at several world sizes and extend the curve",
        description="Run the recipe's model for a few steps at each size (the planner's best layout for "
                    "it by the terms fitted at the size before), print and plot tokens/s, efficiency "
                    "against linear and where the time goes, extend the curve past this machine with "
                    "the fitted model and name the size where it flattens.",
        epilog="overrides: --section.key=value apply to every size, e.g. --train.seq_len=64")
    p.add_argument("recipe", nargs="?", help="TOML recipe (default: recipes/debug_cpu.toml)")
    p.add_argument("--ranks", default="1,2,4,8", help="world sizes to measure, comma-separated (default 1,2,4,8)")
    p.add_argument("--weak", action="store_true", help="keep the per-rank batch instead of the global batch")
    p.add_argument("--out", default=None, help="output folder (default: runs/scaling/RECIPE_NAME)")
    p.add_argument("--inter-gbit", type=float, default=10.0,
                   help="link between hosts assumed for the extension, Gbit/s per host (default 10)")


def parse_ranks(text: str) -> list[int]:
    try:
        ranks = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise UserError(f"--ranks expects world sizes like 1,2,4,8, got '{text}'") from None
    if not ranks or ranks[0] < 1:
        raise UserError(f"--ranks expects positive world sizes like 1,2,4,8, got '{text}'")
    return ranks


def run_scaling(args: argparse.Namespace, overrides: list[str], default_recipe: str) -> int:
    from parallel3d.config import load_config
    from parallel3d.model_config import resolve_model_config
    from parallel3d.scaling.curve import extend, flattens_at, table
    from parallel3d.scaling.plot import plot
    from parallel3d.scaling.sweep import batch_at, layout_check, sweep

    recipe = args.recipe or default_recipe
    ranks = parse_ranks(args.ranks)
    if not args.inter_gbit > 0:
        raise UserError(f"--inter-gbit must be positive, got {args.inter_gbit}")
    cfg = load_config(recipe, overrides)
    model = resolve_model_config(cfg.model)
    out = Path(args.out or Path("runs") / "scaling" / Path(recipe).stem)
    out.mkdir(parents=True, exist_ok=True)
    print(f"scaling {recipe} at {', '.join(map(str, ranks))} ranks ({'weak' if args.weak else 'strong'}); "
          f"runs in {out}", flush=True)
    points = sweep(recipe, overrides, ranks, args.weak, out, log=lambda line: print(line, flush=True))
    world = cfg.launch.nnodes * cfg.launch.nproc
    sizes = [n for n in (world, 2 * world, 4 * world) if n not in ranks]

    def valid_for(n, work):
        return layout_check(cfg, model, n, work.global_batch)

    dtype = "bf16" if cfg.train.dtype == "bf16" else "fp32"
    extended = extend(points, model, cfg.train.seq_len, dtype, lambda n: batch_at(cfg, n, args.weak),
                      cfg.train.micro_batch, sizes, cfg.launch.nproc, args.inter_gbit, valid_for)
    flat = flattens_at(points, extended)
    lines = table(points, extended, args.weak, flat, args.inter_gbit)
    print("\n".join(lines), flush=True)
    (out / "scaling.txt").write_text("\n".join(lines) + "\n")
    (out / "scaling.json").write_text(json.dumps({
        "recipe": recipe, "weak": args.weak, "points": [p.to_dict() for p in points],
        "extended": [{"ranks": e.ranks, "hosts": e.hosts, "layout": e.layout.describe() if e.layout else None,
                      "step_s": e.step_s, "tokens_per_s": e.tokens_per_s, "error": e.error, "note": e.note}
                     for e in extended],
        "flattens_at": flat, "inter_gbit": args.inter_gbit}, indent=1))
    plot(points, extended, flat, f"{Path(recipe).name}: {'weak' if args.weak else 'strong'} scaling",
         out / "scaling.png")
    print(f"wrote {out / 'scaling.txt'}, {out / 'scaling.json'}, {out / 'scaling.png'}", flush=True)
    return 0
