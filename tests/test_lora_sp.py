"""LoRA under sequence parallelism (``parallel3d/lora/adapters.py``): a column-parallel
layer's A reads this rank's token shard and its (B, S, r) product is gathered; a
row-parallel layer's (B, S, r) partial product is reduce-scattered with the output. The
per-step losses at tp 2, at tp 4 (kv-heads on 2 ranks) with full recomputation and at
tp 2 x pp 2 x dp 2 (ZeRO 2, zb-h1) equal one process's (fp32, 1e-5), the base untouched."""

from __future__ import annotations

import pytest

from helpers import relative_diff
from test_lora import _job, _train


@pytest.fixture(scope="module")
def reference(one_thread, corpus_dir, tmp_path_factory):
    return _train(_job(corpus_dir, str(tmp_path_factory.mktemp("ref"))))


@pytest.mark.parametrize("parallel", [
    {"tp": 2},
    {"tp": 4, "recompute": "full"},
    {"tp": 2, "pp": 2, "dp": 2, "zero": 2, "schedule": "zb-h1"},
], ids=lambda p: "-".join(f"{k}{v}" for k, v in p.items()))
def test_lora_with_sequence_parallelism_trains_as_one_process(pools, corpus_dir, tmp_path, reference, parallel):
    parallel = {"pp": 1, "dp": 1, **parallel, "sequence_parallel": True}
    job = _job(corpus_dir, str(tmp_path), **{k: v for k, v in parallel.items() if k != "recompute"})
    if "recompute" in parallel:
        job["train"]["recompute"] = parallel["recompute"]
    ranks = pools(parallel["tp"] * parallel["pp"] * parallel["dp"]).run(_train, job)
    for got in ranks:
        assert relative_diff(got["losses"], reference["losses"]) < 1e-5, (got["losses"], reference["losses"])
        assert got["frozen_unchanged"] and got["frozen_with_grad"] == 0
