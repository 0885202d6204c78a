"""Synthetic multi-GB checkpoints in every format ``parallel3d convert`` reads, for
``bench_convert.py``. Each writer runs in a child process and writes the format's own
layout with its own tools where they run here (torch's ``dcp.save``, ``torch.save``):

- ``parallel3d``: tp=2 x dp=2 rank files (column / row blocks), as the trainer saves;
- ``hf``: a Hugging Face folder (1 GiB shards);
- ``dcp``: ``dcp.save`` of a Hugging Face ``model.state_dict()`` (one chunk per tensor);
- ``megatron_dist``: Megatron's torch_dist layout (``dcp.save`` of stacked layers, fused
  qkv and gate/up, ``metadata.json``, ``common.pt`` with Megatron-LM's args);
- ``megatron_legacy``: ``iter_N/mp_rank_0T/model_optim_rng.pt`` at tp=2;
- ``zero2`` / ``zero3``: DeepSpeed ZeRO-2 / ZeRO-3 at dp=2, fp32 masters and Adam moments
  (as DeepSpeed's ``zero_to_fp32`` reads them; a smaller model: the moments triple it).

Values are seeded random; only sizes and layouts matter to the benchmark.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

MODEL = dict(vocab_size=49152, dim=2048, n_layers=8, n_heads=16, n_kv_heads=8, ffn_dim=5632)
ZERO_MODEL = dict(MODEL, n_layers=3, vocab_size=16384)  # x3 with the moments
FORMATS = ("parallel3d", "hf", "dcp", "megatron_dist", "megatron_legacy", "zero2", "zero3")


def _cfg(zero: bool):
    from parallel3d.models.llama import LlamaConfig

    return LlamaConfig(**(ZERO_MODEL if zero else MODEL))


def _tensors(cfg):
    """(parallel3d name, tensor) of the model, seeded per name, one at a time."""
    import zlib

    import torch

    from parallel3d.checkpoint.state import logical_shapes

    for name, shape in logical_shapes(cfg).items():
        g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
        yield name, torch.randn(shape, generator=g)


def _hf_config(cfg) -> dict:
    from parallel3d.models.llama.hf import config_to_hf

    return config_to_hf(cfg)


def write_hf(folder: Path) -> None:
    from safetensors.torch import save_file

    from parallel3d.models.llama.hf import name_to_hf

    cfg = _cfg(False)
    folder.mkdir(parents=True, exist_ok=True)
    shard, size, n, weight_map = {}, 0, 0, {}

    def flush():
        nonlocal shard, size, n
        if shard:
            n += 1
            save_file(shard, str(folder / f"model-{n:05d}.safetensors"), metadata={"format": "pt"})
            weight_map.update({k: f"model-{n:05d}.safetensors" for k in shard})
            shard, size = {}, 0

    for name, t in _tensors(cfg):
        if size + t.numel() * 4 > 2**30:
            flush()
        shard[name_to_hf(name)] = t
        size += t.numel() * 4
    flush()
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (folder / "config.json").write_text(json.dumps(_hf_config(cfg)))


def write_dcp(folder: Path) -> None:
    import torch.distributed.checkpoint as dcp

    from parallel3d.models.llama.hf import name_to_hf

    cfg = _cfg(False)
    state = {name_to_hf(n): t for n, t in _tensors(cfg)}
    dcp.save(state, checkpoint_id=str(folder), no_dist=True)
    (folder / "config.json").write_text(json.dumps(_hf_config(cfg)))


def _megatron_args(cfg, tp: int):
    import argparse as ap

    return ap.Namespace(num_layers=cfg.n_layers, hidden_size=cfg.dim, ffn_hidden_size=cfg.ffn_dim,
                        num_attention_heads=cfg.n_heads, group_query_attention=True,
                        num_query_groups=cfg.n_kv_heads, padded_vocab_size=cfg.vocab_size,
                        swiglu=True, normalization="RMSNorm", position_embedding_type="rope",
                        add_bias_linear=False, rotary_base=cfg.rope_theta, norm_epsilon=cfg.norm_eps,
                        untie_embeddings_and_output_weights=True, max_position_embeddings=4096,
                        tensor_model_parallel_size=tp)


def _megatron_layer(t: dict, i: int, cfg, tp: int, r: int) -> dict:
    """Rank r's (of tp) Megatron tensors of layer i from the parallel3d ones."""
    import torch

    hd, qpg = cfg.head_dim, cfg.n_heads // cfg.n_kv_heads
    p = f"layers.{i}."
    q = t[p + "self_attn.q_proj.weight"].reshape(cfg.n_kv_heads, qpg * hd, -1)
    k = t[p + "self_attn.k_proj.weight"].reshape(cfg.n_kv_heads, hd, -1)
    v = t[p + "self_attn.v_proj.weight"].reshape(cfg.n_kv_heads, hd, -1)
    qkv = torch.cat([q, k, v], 1).chunk(tp)[r].reshape(-1, cfg.dim)
    gate = t[p + "mlp.gate_proj.weight"].chunk(tp)[r]
    up = t[p + "mlp.up_proj.weight"].chunk(tp)[r]
    return {"self_attention.linear_qkv.weight": qkv.clone(),
            "self_attention.linear_proj.weight": t[p + "self_attn.o_proj.weight"].chunk(tp, 1)[r].clone(),
            "mlp.linear_fc1.weight": torch.cat([gate, up]),
            "mlp.linear_fc2.weight": t[p + "mlp.down_proj.weight"].chunk(tp, 1)[r].clone(),
            "input_layernorm.weight": t[p + "input_layernorm.weight"],
            "pre_mlp_layernorm.weight": t[p + "post_attention_layernorm.weight"]}


def write_megatron_dist(folder: Path) -> None:
    import torch
    import torch.distributed.checkpoint as dcp

    cfg = _cfg(False)
    t = dict(_tensors(cfg))
    layers = [_megatron_layer(t, i, cfg, 1, 0) for i in range(cfg.n_layers)]
    state = {"embedding.word_embeddings.weight": t["embed_tokens.weight"],
             "decoder.final_layernorm.weight": t["norm.weight"], "output_layer.weight": t["lm_head.weight"]}
    for key in layers[0]:
        state[f"decoder.layers.{key}"] = torch.stack([layer[key] for layer in layers])
    del layers, t
    folder.mkdir(parents=True, exist_ok=True)
    dcp.save(state, checkpoint_id=str(folder), no_dist=True)
    (folder / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                                                      "common_backend": "torch", "common_backend_version": 1}))
    torch.save({"args": _megatron_args(cfg, 1), "iteration": 10}, folder / "common.pt")


def write_megatron_legacy(folder: Path, tp: int = 2) -> None:
    import torch

    cfg = _cfg(False)
    t = dict(_tensors(cfg))
    for r in range(tp):
        model = {"embedding.word_embeddings.weight": t["embed_tokens.weight"].chunk(tp)[r].clone(),
                 "decoder.final_layernorm.weight": t["norm.weight"],
                 "output_layer.weight": t["lm_head.weight"].chunk(tp)[r].clone()}
        for i in range(cfg.n_layers):
            model.update({f"decoder.layers.{i}.{k}": v for k, v in _megatron_layer(t, i, cfg, tp, r).items()})
        rank_dir = folder / "iter_0000010" / f"mp_rank_{r:02d}"
        rank_dir.mkdir(parents=True, exist_ok=True)
        torch.save({"args": _megatron_args(cfg, tp), "iteration": 10, "checkpoint_version": 3.0, "model": model},
                   rank_dir / "model_optim_rng.pt")
    (folder / "latest_checkpointed_iteration.txt").write_text("10")


def write_zero(folder: Path, stage: int, ranks: int = 2) -> None:
    """DeepSpeed's layout (see parallel3d/checkpoint/foreign/deepspeed.py): one param group; stage
    2 partitions the group's flat vector (padded to 2 x ranks), stage 3 each parameter."""
    import torch

    from parallel3d.models.llama.hf import name_to_hf

    cfg = _cfg(True)
    tag = folder / "global_step10"
    tag.mkdir(parents=True, exist_ok=True)
    (folder / "latest").write_text("global_step10")
    (folder / "config.json").write_text(json.dumps(_hf_config(cfg)))
    named = [(name_to_hf(n), t) for n, t in _tensors(cfg)]
    shapes = [{n: torch.Size(t.shape) for n, t in named}]
    if stage == 2:
        flat = torch.cat([t.reshape(-1) for _, t in named])
        flat = torch.cat([flat, flat.new_zeros(-flat.numel() % (2 * ranks))])
        parts = list(flat.chunk(ranks))
    else:
        parts = []
        for r in range(ranks):
            pieces = []
            for _, t in named:
                c = math.ceil(t.numel() / ranks)
                piece = t.reshape(-1)[r * c:(r + 1) * c]
                pieces.append(torch.cat([piece, piece.new_zeros(c - piece.numel())]))
            parts.append(torch.cat(pieces))
    base = {"buffer_names": [], "param_shapes": shapes, "shared_params": {}, "frozen_param_shapes": None,
            "frozen_param_fragments": None, "ds_version": "0.19.8", "global_steps": 10, "ds_config": {}}
    if stage == 2:
        torch.save({**base, "module": dict(named)}, tag / "mp_rank_00_model_states.pt")
    del named
    for r, part in enumerate(parts):
        if stage == 3:
            torch.save({**base, "module": {}}, tag / f"zero_pp_rank_{r}_mp_rank_00_model_states.pt")
        moments = {"step": torch.tensor(10.0), "exp_avg": part * 0.01, "exp_avg_sq": part * part}
        osd = {"zero_stage": stage, "partition_count": ranks, "loss_scaler": None}
        if stage == 2:
            osd.update(single_partition_of_fp32_groups=[part],
                       base_optimizer_state={"state": {0: moments}, "param_groups": [{"lr": 1e-4}]})
        else:
            osd.update(fp32_flat_groups=[part],
                       optimizer_state_dict={"state": {0: moments}, "param_groups": [{"lr": 1e-4}]})
        torch.save({"optimizer_state_dict": osd, "ds_config": {}, "ds_version": "0.19.8"},
                   tag / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt")


def write(fmt: str, folder: Path) -> None:
    if fmt == "parallel3d":
        import importlib.util

        spec = importlib.util.spec_from_file_location("bench_convert_memory",
                                                      Path(__file__).with_name("bench_convert_memory.py"))
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        folder.mkdir(parents=True, exist_ok=True)
        mod.write_synthetic(folder)
    elif fmt in ("zero2", "zero3"):
        write_zero(folder, int(fmt[-1]))
    else:
        globals()[f"write_{fmt}"](folder)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("format", choices=FORMATS)
    ap.add_argument("folder")
    a = ap.parse_args()
    write(a.format, Path(a.folder))
