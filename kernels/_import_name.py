"""The checkout's top-level folders (``kernels/``, ``models/``, ``recipes/``) are installed
as ``parallel3d.kernels`` and so on (pyproject's ``package-dir``). Any Python started in a
checkout's root (``python -m pytest``, ``python -m parallel3d.cli``, ``torchrun -m ...``)
has that root first on ``sys.path``, where each folder would shadow an installed package
of the same top-level name: transformers 5 imports Hugging Face's ``kernels`` whenever a
model or config module loads, and would get ours.

``yield_name`` makes such an import find what it would have found without the checkout:
the package of that name later on ``sys.path`` (loaded and put in ``sys.modules`` in the
folder's place, the way an ``import`` statement reads its result back), or
``ModuleNotFoundError`` when there is none. Imported under its installed name, a folder's
``__init__`` never calls it. Imports nothing from parallel3d: it runs before any of it.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from importlib.machinery import PathFinder


def yield_name(name: str, package_path: str) -> None:
    """Replace the checkout folder imported as the top-level module ``name`` (the folder at
    ``package_path``) with the installed module of that name, or raise ModuleNotFoundError."""
    root = os.path.realpath(os.path.dirname(package_path))
    for loaded in [m for m in sys.modules if m.startswith(name + ".")]:  # our own helper, imported as name._import_name
        del sys.modules[loaded]
    others = [p for p in sys.path if isinstance(p, str) and os.path.realpath(p or os.curdir) != root]
    spec = PathFinder.find_spec(name, others)
    if spec is None or spec.loader is None:
        raise ModuleNotFoundError(f"No module named {name!r} (the folder {package_path} of a "
                                  f"parallel3d checkout is parallel3d.{name})", name=name)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
