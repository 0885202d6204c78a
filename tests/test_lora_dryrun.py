"""The dry run knows LoRA: the frozen weights in the storage dtype with no gradients and
no optimizer state, gradients and Adam's state for the adapters only (bytes against the
formula, from the adapters' elements counted by the split rule in test_lora)."""

from __future__ import annotations

import pytest

from parallel3d.config import config_from_dict
from parallel3d.train.dryrun import dry_run

from helpers import tiny_job
from test_lora import LAYERS, RANK, TARGETS, _adapter_numel


@pytest.mark.parametrize("tp, zero, dp", [(1, 0, 1), (2, 2, 2)])
def test_dry_run_counts_state_for_the_adapters_only(tmp_path, tp, zero, dp):
    job = tiny_job("", str(tmp_path), parallel={"tp": tp, "dp": dp, "zero": zero},
                   lora={"rank": RANK, "alpha": 8.0, "targets": TARGETS})
    lines = []
    found = dry_run(config_from_dict(job), tp * dp, out=lines.append)
    states = found["reports"][0].states
    adapters = _adapter_numel(tp, LAYERS)
    shard = -(-adapters // dp) if zero else adapters
    held = sum(p.numel() for p in found["reports"][0].module.parameters())
    assert states.grads == 4 * (shard if zero >= 2 else adapters)  # fp32 gradients, the adapters' only
    assert states.optimizer == 8 * shard  # Adam's two fp32 moments
    assert states.weights == 4 * held  # every weight held, frozen ones included (fp32 here)
    assert any(line.startswith(f"lora rank {RANK}:") for line in lines)
    job["lora"]["rank"] = 0  # full training: state for every weight
    full = dry_run(config_from_dict(job), tp * dp, out=lambda line: None)["reports"][0].states
    assert full.optimizer == 8 * -(-(held - adapters) // (dp if zero else 1))
