"""The README's commands are true: CI runs its test line, the install lines take the right
torch build, and every install hint the code or the docs print works from a clone."""

from __future__ import annotations

import re
import sys
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def _bash_blocks() -> list[list[str]]:
    text = (ROOT / "README.md").read_text()
    return [block.strip().splitlines() for block in re.findall(r"```bash\n(.*?)```", text, re.S)]


def _ci_torch_pin() -> str:
    ci = (ROOT / ".ci" / "run").read_text()
    pins = re.findall(r"pip install (torch==[\d.]+)", ci)
    assert len(pins) == 1, pins
    return pins[0]


def test_ci_runs_the_readme_test_command():
    tests = [line for block in _bash_blocks() for line in block if line.endswith("python -m pytest -q")]
    assert len(tests) == 1, tests
    ci_lines = (ROOT / ".ci" / "run").read_text().splitlines()
    assert tests[0] in ci_lines and tests[0].startswith("python -m venv .venv")


def test_install_lines_take_the_cpu_build_on_a_cpu_machine_and_pypi_on_a_gpu_node():
    pin = _ci_torch_pin()  # the one torch version, the same as CI's
    installs = [block for block in _bash_blocks() if any(line.startswith("pip install torch") for line in block)]
    assert len(installs) == 2, installs
    cpu, gpu = installs
    assert f"pip install {pin} --index-url {CPU_INDEX}" in cpu  # PyPI's Linux wheel is the CUDA build
    assert f"pip install {pin}" in gpu and not any("download.pytorch.org" in line for line in gpu)
    for block in installs:  # torch first, then the package from the checkout (torch stays as installed)
        torch_at = next(i for i, line in enumerate(block) if line.startswith("pip install torch"))
        assert block[torch_at + 1] == 'pip install -e ".[test]"' and block[0].startswith("python -m venv")
    readme = (ROOT / "README.md").read_text()
    assert "`parallel3d train`" in readme or "\nparallel3d train\n" in readme


# Where a user can meet an install hint: the code's messages, the docs, the recipes.
HINT_FILES = ["README.md", "pyproject.toml", *[f"{d}/**/*.{ext}" for d in ("parallel3d", "models", "kernels",
                                                                           "benchmarks", "docs", "recipes")
                                             for ext in ("py", "md", "toml", "sbatch")]]
# Packages a hint may name by themselves: torch, every dependency pyproject.toml declares,
# and the two optional sinks (observability.tensorboard / wandb) that are no extra.
SINKS = {"tensorboard", "wandb"}


def _hints() -> list[tuple[str, str]]:
    """Every ``pip install ...`` in those files, each cut at the next ``pip install``."""
    found = []
    for pattern in HINT_FILES:
        for path in sorted(ROOT.glob(pattern)):
            for line in path.read_text(encoding="utf-8").splitlines():
                for args in re.findall(r"pip install ((?:(?!pip install)[^`\n])*)", line):
                    found.append((str(path.relative_to(ROOT)), args))
    return found


def _declared() -> tuple[set[str], set[str]]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = set()
    for spec in project["dependencies"] + [d for ds in project["optional-dependencies"].values() for d in ds]:
        names.add(re.split(r"[<>=;\[ ]", spec, maxsplit=1)[0].lower())
    return names, set(project["optional-dependencies"])


WORDS = {"in", "or", "and", "from", "then", "to", "for", "the", "first", "&&", "|", ";"}  # what follows a hint


def _targets(args: str) -> list[str]:
    """What one hint asks pip to install: its arguments up to the prose that follows."""
    out, skip = [], False
    for token in args.split():
        if skip:  # the value of --index-url / --extra-index-url
            skip = False
            continue
        if token.startswith("-"):
            skip = token in ("--index-url", "--extra-index-url")
            continue
        if token.startswith('".'):  # the checkout, quoted: '".[extra]"' (a bracket or comma may follow)
            out.append(token[:token.index('"', 1) + 1])
            continue
        bare = token.rstrip(",;:)").strip("'\"").rstrip(",;:)")
        if not bare or bare.lower() in WORDS or bare.startswith("("):  # prose, an aside
            break
        out.append(bare)
        if bare != token:  # punctuation or the end of a string literal closes the list
            break
    return out


def test_every_install_hint_works_from_a_clone():
    hints = _hints()
    assert len(hints) >= 8, hints  # the README's lines and the code's messages are found
    packages, extras = _declared()
    for where, args in hints:
        for target in _targets(args):
            if target.startswith(('".', "'.", ".")):
                # the package itself from the checkout, quoted against zsh's globbing
                spec = re.fullmatch(r'"\.(?:\[([\w,]+)\])?"|\.', target)
                assert spec, (where, args, target)
                assert not spec.group(1) or set(spec.group(1).split(",")) <= extras, (where, args)
                continue
            # parallel3d is on no index: `pip install parallel3d[...]` fails from a clone
            name = re.split(r"[<>=\[]", target, maxsplit=1)[0].lower()
            assert name != "parallel3d", (where, args)
            assert name == "torch" or name in packages or name in SINKS, (where, args, name)
