"""The planner's words where the docs quote it, regenerated from the planner.

A recipe quotes ``parallel3d plan`` in a block of comment lines: the command, then the
plan's own lines (its recommendation and why the alternatives lose), wrapped at
:data:`WIDTH` columns with continuation lines indented two more::

    # plan: parallel3d plan --model 1b --gpus 8 --gpu h100-80g --seq-len 4096 --global-batch 256
    #   recommended: tp1 pp1 dp8 mb1 zero2 rc-none -- 1.934 s/step, MFU 61.8%, 11.3 GiB of
    #     73.7 GiB on its fullest stage (compute 99%, data-parallel comm 1%)
    #   tensor parallel across the node (tp8 pp1): best is ...

The README quotes it in a fenced block whose first line is ``$ parallel3d plan ...`` and
whose other lines are the plan's first lines, unwrapped. ``tests/test_planner_quotes.py``
runs every quoted command and fails where a quote differs; ``python -m
parallel3d.planner.quotes --write FILE...`` rewrites the quotes from the planner (without
``--write``: prints the differences and exits 1 if there are any).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import shlex
import sys
import textwrap
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

WIDTH = 100
RECIPE_MARK = "# plan: parallel3d plan "
README_MARK = "$ parallel3d plan "


@dataclass
class Quote:
    """One quoted plan: its command's arguments and the lines quoted (unwrapped), at
    ``lines[start:end]`` of the file."""

    args: list[str]
    quoted: list[str]
    start: int
    end: int
    readme: bool


@lru_cache(maxsize=None)
def plan_lines(args: tuple[str, ...]) -> tuple[list[str], list[str], str]:
    """(everything ``parallel3d plan ARGS`` prints, its recommendation and reasons, the
    recipe it writes with ``--write-recipe``)."""
    import tempfile

    from parallel3d.planner.cli import add_plan_parser, run_plan

    parser = argparse.ArgumentParser(prog="parallel3d")
    add_plan_parser(parser.add_subparsers(dest="command"))
    buffer = io.StringIO()
    with tempfile.TemporaryDirectory() as tmp, contextlib.redirect_stdout(buffer):
        recipe = Path(tmp) / "planned.toml"
        code = run_plan(parser.parse_args(["plan", *args, "--write-recipe", str(recipe)]))
        written = recipe.read_text() if recipe.is_file() else ""
    printed = buffer.getvalue().splitlines()
    if code != 0 or not any(line.startswith("recommended: ") for line in printed):
        raise ValueError(f"parallel3d plan {' '.join(args)} recommended nothing (exit {code})")
    first = next(i for i, line in enumerate(printed) if line.startswith("recommended: "))
    return printed, [line for line in printed[first:] if line and not line.startswith("wrote ")], written


def find_quotes(text: str) -> list[Quote]:
    """Every quoted plan of a recipe (comment blocks) or of the README (fenced blocks)."""
    lines = text.splitlines()
    out, i = [], 0
    while i < len(lines):
        line = lines[i]
        if line.startswith(RECIPE_MARK):
            quoted, j = [], i + 1
            while j < len(lines) and lines[j].startswith("#   "):
                if lines[j].startswith("#     ") and quoted:  # a wrapped line's continuation
                    quoted[-1] += " " + lines[j][6:]
                else:
                    quoted.append(lines[j][4:])
                j += 1
            out.append(Quote(shlex.split(line[len(RECIPE_MARK):]), quoted, i, j, readme=False))
            i = j
        elif line.startswith(README_MARK) and i > 0 and lines[i - 1].startswith("```"):
            j = i + 1
            while j < len(lines) and not lines[j].startswith("```"):
                j += 1
            out.append(Quote(shlex.split(line[len(README_MARK):]), lines[i + 1:j], i, j, readme=True))
            i = j
        else:
            i += 1
    return out


def expected(quote: Quote) -> list[str]:
    """What ``quote`` should say: the plan's lines (a README block: as many as it quotes,
    at least the recommendation)."""
    _, said, _ = plan_lines(tuple(quote.args))
    return said[:max(1, len(quote.quoted))] if quote.readme else said


def render(quote: Quote, lines: list[str]) -> list[str]:
    """The file lines of ``quote`` saying ``lines``."""
    if quote.readme:
        return [README_MARK + shlex.join(quote.args), *lines]
    out = [RECIPE_MARK + shlex.join(quote.args)]
    for line in lines:
        out += textwrap.wrap(line, WIDTH, initial_indent="#   ", subsequent_indent="#     ",
                             break_long_words=False, break_on_hyphens=False)
    return out


def regenerate(text: str) -> str:
    """``text`` with every quote replaced by the planner's current lines."""
    lines = text.splitlines()
    for quote in reversed(find_quotes(text)):
        lines[quote.start:quote.end] = render(quote, expected(quote))
    return "\n".join(lines) + ("\n" if text.endswith("\n") else "")


def quoted_layout(quote: Quote) -> str:
    """The layout a quote's plan recommends (``Layout.describe()``'s words)."""
    _, said, _ = plan_lines(tuple(quote.args))
    return re.match(r"recommended: (.*?) -- ", said[0]).group(1)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m parallel3d.planner.quotes", description=__doc__.split("\n\n")[0])
    p.add_argument("files", nargs="+", type=Path)
    p.add_argument("--write", action="store_true", help="rewrite the quotes from the planner")
    args = p.parse_args(argv)
    stale = 0
    for path in args.files:
        text = path.read_text()
        fresh = regenerate(text)
        if fresh == text:
            continue
        stale += 1
        if args.write:
            path.write_text(fresh)
            print(f"rewrote {path}")
        else:
            import difflib

            sys.stdout.writelines(difflib.unified_diff(text.splitlines(True), fresh.splitlines(True),
                                                       str(path), f"{path} (the planner now)"))
    return 1 if stale and not args.write else 0


if __name__ == "__main__":
    sys.exit(main())
