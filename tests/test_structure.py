"""The shape of the code base: imports flow one way (no cycle between modules or between
subpackages) and docs/architecture.md's module map names each file once, and only files
that exist."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# installed names -> source folders (pyproject's package-dir)
PACKAGES = {"parallel3d": "parallel3d", "parallel3d.kernels": "kernels", "parallel3d.models": "models"}


def _modules() -> dict[str, Path]:
    out = {}
    for base, folder in PACKAGES.items():
        for path in (ROOT / folder).rglob("*.py"):
            rel = path.relative_to(ROOT / folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            out[".".join([base, *parts])] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Every project module ``name`` imports, at the top or inside a function."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        targets = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package
                for _ in range(node.level - 1):
                    anchor = anchor.rsplit(".", 1)[0]
                base = f"{anchor}.{base}" if base else anchor
            # a name that is a submodule imports that module (the package's __init__ runs
            # first, as for any submodule: not an edge of the design); any other name is an
            # attribute of the module ``base``
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        for t in targets:
            while t and t not in modules and "." in t:
                t = t.rsplit(".", 1)[0]
            if t in modules and t != name:
                found.add(t)
    return found


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph``, or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(v: str) -> list[str] | None:
        state[v] = 1
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if state.get(w) == 1:
                return stack[stack.index(w):] + [w]
            if w not in state and (found := visit(w)):
                return found
        stack.pop()
        state[v] = 2
        return None

    for v in sorted(graph):
        if v not in state and (found := visit(v)):
            return found
    return None


def test_imports_have_no_cycle_between_modules_or_subpackages():
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    assert _cycle(graph) is None, _cycle(graph)

    def sub(name: str) -> str:  # parallel3d.zero.grads -> parallel3d.zero
        return ".".join(name.split(".")[:2])

    packages: dict[str, set[str]] = {}
    for name, deps in graph.items():
        packages.setdefault(sub(name), set()).update(sub(d) for d in deps if sub(d) != sub(name))
    # the parallel3d package itself sits above its subpackages (parallel3d/__init__, cli)
    packages.pop("parallel3d", None)
    for deps in packages.values():
        deps.discard("parallel3d")
    assert _cycle(packages) is None, _cycle(packages)


def test_the_module_map_names_every_module_once_and_only_files_that_exist():
    """One row per module (two rows drift apart: launch.py once had two that disagreed),
    each naming a file that exists, and every module of the three packages has its row."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    rows = re.findall(r"^\| `([^`]+)` \|", text, flags=re.M)
    assert len(rows) > 40
    twice = sorted({name for name in rows if rows.count(name) > 1})
    assert not twice, f"named twice: {twice}"
    absent = [name for name in rows if not (ROOT / name.rstrip("/")).exists()]
    assert not absent, f"no such file: {absent}"
    modules = {path.relative_to(ROOT).as_posix() for folder in PACKAGES.values()
               for path in (ROOT / folder).rglob("*.py") if path.name != "__init__.py"}
    unlisted = sorted(modules - set(rows))
    assert not unlisted, f"modules without a row: {unlisted}"


def test_no_test_skips_when_the_project_itself_fails_to_import():
    """A broken import of parallel3d must fail its tests, not skip them: importorskip is
    for optional third-party packages only."""
    found = []
    for path in sorted((ROOT / "tests").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "importorskip"
                    and node.args and isinstance(node.args[0], ast.Constant)
                    and str(node.args[0].value).split(".")[0] == "parallel3d"):
                found.append(f"{path.name}:{node.lineno}")
    assert not found, found


def test_convert_and_the_model_do_not_import_the_compiler():
    """``parallel3d convert`` and a CPU run never need torch._dynamo: importing it costs
    1.7 s and 140 MiB of resident memory in every process (the varlen attention kernel's
    module pulls it in, so it is imported on first use on a GPU)."""
    import subprocess
    import sys

    code = ("import sys, parallel3d.checkpoint.convert, parallel3d.models.llama.model; "
            "print(sorted(m for m in ('torch._dynamo', 'torch.nn.attention.varlen') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_every_source_folder_is_a_listed_package():
    """pyproject lists the subpackages by hand (package-dir maps kernels/, models/,
    recipes/): a folder of modules left out is missing from a non-editable install (the
    editable one finds it anyway, so nothing else would notice)."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = set()
    for base, folder in {**PACKAGES, "parallel3d.recipes": "recipes"}.items():
        for path in (ROOT / folder).rglob("*"):
            if path.is_dir() and "__pycache__" not in path.parts and any(path.glob("*.py")):
                found.add(".".join([base, *path.relative_to(ROOT / folder).parts]))
        found.add(base)
    assert found <= listed, sorted(found - listed)
