"""The checkout's top-level folders never shadow an installed package of the same name
(kernels/_import_name.py): a Python started with ``-m`` in the repository root, as the
README's test command, ``python -m parallel3d.cli`` and ``torchrun -m`` are, finds the
installed ``kernels`` that transformers 5 imports with every model module."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# A stand-in for Hugging Face's `kernels` (its distribution metadata at a version that
# transformers' range accepts; its decorator factories give identity decorators, any other
# name a placeholder), so the test does not depend on which kernels release, if
# any, this environment has.
_STAND_IN = '''
STAND_IN = True


def _decorator_factory(*args, **kwargs):
    return lambda decorated: decorated


use_kernelized_func = use_kernel_forward_from_hub = replace_kernel_forward_from_hub = _decorator_factory


class _Anything:
    def __call__(self, *args, **kwargs):
        return self

    def __getattr__(self, name):
        return self


def __getattr__(name):
    return _Anything()
'''

_PROBE = '''
import sys
from transformers import LlamaForCausalLM, Qwen3ForCausalLM
import kernels
import parallel3d.kernels.linear, parallel3d.models.llama.model
assert getattr(kernels, "STAND_IN", False), kernels.__file__
print("ok", LlamaForCausalLM.__name__, Qwen3ForCausalLM.__name__, kernels.__file__)
'''


def test_an_installed_kernels_package_is_found_from_the_repository_root(tmp_path):
    site = tmp_path / "site"
    (site / "kernels").mkdir(parents=True)
    (site / "kernels" / "__init__.py").write_text(_STAND_IN)
    meta = site / "kernels-0.19.1.dist-info"
    meta.mkdir()
    (meta / "METADATA").write_text("Metadata-Version: 2.1\nName: kernels\nVersion: 0.19.1\n")
    (site / "probe_imports.py").write_text(_PROBE)
    env = {**os.environ, "PYTHONPATH": str(site)}
    out = subprocess.run([sys.executable, "-m", "probe_imports"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.startswith("ok LlamaForCausalLM Qwen3ForCausalLM"), out.stdout


def test_a_top_level_folder_without_an_installed_twin_is_not_a_module():
    """From the root, ``import models`` (nothing of that name installed) fails as it would
    without the checkout, instead of importing parallel3d's model families under a second
    name."""
    out = subprocess.run([sys.executable, "-c", "import models"], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 1 and "ModuleNotFoundError: No module named 'models'" in out.stderr, out.stderr
