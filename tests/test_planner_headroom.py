"""The planner keeps a stated memory headroom (issue 37, first point of "What to do"): by
default 5% of the device beyond the runtime reserve and the fragmentation margin,
configurable with --headroom, and said in `plan`'s and the dry run's output."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from parallel3d.cli import main
from parallel3d.planner.hardware import GiB, RUNTIME_RESERVE_BYTES, gpu_named, usable_bytes, with_headroom

ROOT = Path(__file__).resolve().parents[1]


def test_the_default_headroom_is_5_percent_of_the_device():
    for name in ("a100-40g", "h100-80g", "h200", "b200"):
        gpu = gpu_named(name)
        assert gpu.memory_bytes - RUNTIME_RESERVE_BYTES - usable_bytes(gpu) >= int(0.05 * gpu.memory_bytes)
    h100 = gpu_named("h100-80g")
    assert usable_bytes(with_headroom(h100, 0.2)) == h100.memory_bytes - RUNTIME_RESERVE_BYTES - int(
        0.2 * h100.memory_bytes)


def test_plan_states_the_headroom_and_recommends_within_it(capsys):
    assert main(["plan", "--model", "1b", "--gpus", "8", "--gpu", "h100-80g", "--headroom", "0.3"]) == 0
    out = capsys.readouterr().out
    assert "memory: 53.8 GiB usable = 79.6 GiB - 2 GiB runtime reserve - 30% headroom (23.9 GiB" in out, out
    need, budget = map(float, re.search(r"recommended: .* ([\d.]+) GiB of ([\d.]+) GiB on its fullest stage",
                                        out).groups())
    assert budget == 53.8 and need <= budget


def test_the_dry_run_states_the_headroom_and_refuses_a_bad_one(capsys):
    recipe = str(ROOT / "recipes" / "llama3_1b.toml")
    assert main(["train", recipe, "--dry-run", "--gpu", "h100-80g"]) == 0
    assert "73.7 GiB usable = 79.6 GiB - 2 GiB runtime reserve - 5% headroom (4.0 GiB" in capsys.readouterr().out
    assert main(["train", recipe, "--dry-run", "--gpu", "h100-80g", "--headroom", "0.7"]) == 2
    assert "--headroom is a share of the GPU's memory in [0, 0.5), got 0.7" in capsys.readouterr().err


@pytest.mark.parametrize("share", [0.0, 0.1])
def test_a_headroom_changes_the_budget_by_its_share(share):
    h100 = gpu_named("h100-80g")
    assert usable_bytes(with_headroom(h100, share)) - usable_bytes(h100) == pytest.approx(
        (0.05 - share) * h100.memory_bytes, abs=2)
    assert GiB == 2**30
