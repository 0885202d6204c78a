"""benchmarks/bench_scale.py: its Hugging Face folder holds the trainer's own initial
weights (the benchmark's check that a run from the folder repeats the random-init run's
losses rests on it). The 2 GB runs themselves are the benchmark's, not CI's."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from safetensors import safe_open

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCH))

import bench_scale  # noqa: E402


def test_the_hf_folder_holds_the_seeded_init_in_shards(tmp_path, monkeypatch):
    from parallel3d.config import ParallelConfig, config_from_dict
    from parallel3d.models.llama.hf import name_to_hf
    from parallel3d.models.llama.sharded_init import build_sharded_llama
    from parallel3d.topology import Topology
    from parallel3d.train.setup import resolve_model_config

    monkeypatch.setattr(bench_scale, "MODEL", bench_scale.TINY)
    folder = tmp_path / "hf"
    bench_scale.write_hf_model(folder, shard_bytes=200_000)
    index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(index.values())) > 1 and not (tmp_path / "hf.tmp").exists()
    cfg = resolve_model_config(config_from_dict({"model": bench_scale.TINY}).model)
    model, _ = build_sharded_llama(cfg, Topology.single(), ParallelConfig(), seed=bench_scale.TRAIN["seed"])
    names = dict(model.named_parameters())
    assert set(index) == {name_to_hf(n) for n in names}
    for name, p in names.items():
        key = name_to_hf(name)
        with safe_open(str(folder / index[key]), "pt") as f:
            assert torch.equal(f.get_tensor(key), p.detach()), name
    assert json.loads((folder / "config.json").read_text())["hidden_size"] == cfg.dim
