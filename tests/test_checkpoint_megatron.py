"""Megatron-Core checkpoints written here by megatron-core itself (0.16.1, the newest release
that installs on Python 3.11; 0.17+ needs 3.12) from a ``GPTModel`` with SwiGLU, RMSNorm,
rope and GQA at tensor parallelism 2 on 2 gloo ranks:

- ``torch_dist``: ``megatron.core.dist_checkpointing.save`` of the model's sharded state dict
  (layers stacked, fc1 gate/up fragments, qkv grouped by kv-head), with Megatron-LM's
  ``args`` and ``iteration`` in ``common.pt``;
- legacy: each rank's ``model.state_dict()`` in ``iter_N/mp_rank_0T/model_optim_rng.pt`` with
  ``args`` and ``iteration``, the layout Megatron-LM's training loop writes (megatron-core
  has no writer for it; the tensors are megatron-core's own tp shards).

megatron-core's forward runs on CPU with three CUDA-only calls replaced (the rotary cache's
device, a ``torch.cuda.synchronize`` in its checkpoint writer, the dropout RNG tracker,
unused at dropout 0). Both layouts convert to Hugging Face with every tensor bit-identical
to the model's (un-fused here by an independent reshape of the documented layout) and
transformers' logits equal to Megatron's own forward. Megatron pads the vocabulary to a
multiple of tp: the checkpoint has 528 rows for a 521-token vocabulary.
"""

from __future__ import annotations

import argparse
import contextlib

import pytest
import torch

from parallel3d.checkpoint.convert import convert
from parallel3d.checkpoint.errors import CheckpointError

pytest.importorskip("megatron.core")
transformers = pytest.importorskip("transformers")

VOCAB, PADDED, DIM, FFN, HEADS, KV, LAYERS = 521, 528, 64, 160, 4, 2, 2
TOKENS = (torch.arange(32).reshape(2, 16) * 11) % VOCAB


def megatron_args() -> argparse.Namespace:
    """What Megatron-LM saves as ``args`` for this model (the fields a reader needs, and a
    few it does not)."""
    return argparse.Namespace(
        num_layers=LAYERS, hidden_size=DIM, ffn_hidden_size=FFN, num_attention_heads=HEADS,
        group_query_attention=True, num_query_groups=KV, padded_vocab_size=PADDED, swiglu=True,
        normalization="RMSNorm", position_embedding_type="rope", add_bias_linear=False,
        add_qkv_bias=False, rotary_base=10000, rotary_percent=1.0, norm_epsilon=1e-5,
        untie_embeddings_and_output_weights=True, max_position_embeddings=64, seq_length=16,
        tensor_model_parallel_size=2, pipeline_model_parallel_size=1, params_dtype=torch.float32,
        lr=3e-4, iteration=3)


def _megatron_run(root: str) -> dict:
    import os

    import torch.nn.functional as F

    torch.cuda.current_device = lambda: "cpu"  # rotary cache and masks are built on CUDA
    torch.cuda.synchronize = lambda *a, **k: None  # in the checkpoint writer's preload
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel import random as tp_random
    from megatron.core.transformer.transformer_config import TransformerConfig

    tp_random.CudaRNGStatesTracker.fork = lambda self, name="": contextlib.nullcontext()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    rank = torch.distributed.get_rank()
    torch.manual_seed(0)
    cfg = TransformerConfig(
        num_layers=LAYERS, hidden_size=DIM, num_attention_heads=HEADS, num_query_groups=KV,
        ffn_hidden_size=FFN, gated_linear_unit=True, activation_func=F.silu, normalization="RMSNorm",
        add_bias_linear=False, use_cpu_initialization=True, bias_activation_fusion=False,
        masked_softmax_fusion=False, persist_layer_norm=False, bias_dropout_fusion=False,
        apply_rope_fusion=False, hidden_dropout=0.0, attention_dropout=0.0, layernorm_epsilon=1e-5,
        tensor_model_parallel_size=2)
    model = GPTModel(cfg, get_gpt_layer_local_spec(normalization="RMSNorm"), vocab_size=PADDED,
                     max_sequence_length=64, position_embedding_type="rope",
                     share_embeddings_and_output_weights=False, parallel_output=False)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "layernorm" in name:  # not the trivial ones
                p.normal_(1.0, 0.1, generator=torch.Generator().manual_seed(len(name)))
        mask = torch.triu(torch.ones(16, 16), 1).bool()[None, None]
        logits = model(TOKENS, torch.arange(16).expand(2, 16), attention_mask=mask)
    args = megatron_args()
    dist_dir = os.path.join(root, "dist", "iter_0000003")
    os.makedirs(dist_dir, exist_ok=True)
    dist_checkpointing.save({"model": model.sharded_state_dict(), "args": args, "iteration": 3}, dist_dir)
    legacy_dir = os.path.join(root, "legacy", "iter_0000003", f"mp_rank_{rank:02d}")
    os.makedirs(legacy_dir, exist_ok=True)
    local = {k: v for k, v in model.state_dict().items() if torch.is_tensor(v)}
    torch.save({"args": args, "iteration": 3, "checkpoint_version": 3.0, "model": local},
               os.path.join(legacy_dir, "model_optim_rng.pt"))
    shards = [None, None]
    torch.distributed.all_gather_object(shards, local)
    if rank == 0:
        for sub in ("dist", "legacy"):
            with open(os.path.join(root, sub, "latest_checkpointed_iteration.txt"), "w") as f:
                f.write("3")
    parallel_state.destroy_model_parallel()
    if rank == 0:
        torch.save({"logits": logits, "shards": shards}, os.path.join(root, "reference.pt"))


def reference_hf(shards: list[dict], vocab: int) -> dict[str, torch.Tensor]:
    """Hugging Face tensors from the two tp ranks' state dicts, by the documented layout:
    a rank's qkv is (kv-groups, q-heads-per-group + 2, head_dim, dim) with q, k, v along
    the second axis; its fc1 is [gate; up]; row-parallel weights split columns."""
    hd, qpg = DIM // HEADS, HEADS // KV
    out = {"model.embed_tokens.weight": torch.cat([s["embedding.word_embeddings.weight"] for s in shards])[:vocab],
           "lm_head.weight": torch.cat([s["output_layer.weight"] for s in shards])[:vocab],
           "model.norm.weight": shards[0]["decoder.final_layernorm.weight"]}
    for i in range(LAYERS):
        pre, hf = f"decoder.layers.{i}.", f"model.layers.{i}."
        q, k, v = [], [], []
        for s in shards:
            groups = s[pre + "self_attention.linear_qkv.weight"].reshape(-1, qpg + 2, hd, DIM)
            q.append(groups[:, :qpg].reshape(-1, DIM))
            k.append(groups[:, qpg].reshape(-1, DIM))
            v.append(groups[:, qpg + 1].reshape(-1, DIM))
        gate_up = [s[pre + "mlp.linear_fc1.weight"].chunk(2) for s in shards]
        out.update({
            hf + "self_attn.q_proj.weight": torch.cat(q), hf + "self_attn.k_proj.weight": torch.cat(k),
            hf + "self_attn.v_proj.weight": torch.cat(v),
            hf + "self_attn.o_proj.weight": torch.cat([s[pre + "self_attention.linear_proj.weight"] for s in shards], 1),
            hf + "mlp.gate_proj.weight": torch.cat([g for g, _ in gate_up]),
            hf + "mlp.up_proj.weight": torch.cat([u for _, u in gate_up]),
            hf + "mlp.down_proj.weight": torch.cat([s[pre + "mlp.linear_fc2.weight"] for s in shards], 1),
            hf + "input_layernorm.weight": shards[0][pre + "input_layernorm.weight"],
            hf + "post_attention_layernorm.weight": shards[0][pre + "pre_mlp_layernorm.weight"]})
    return out


@pytest.fixture(scope="module")
def megatron(tmp_path_factory):
    """The two checkpoints, written by 2 processes under torchrun (megatron-core's
    checkpoint writer starts a multiprocessing manager, which the test pool's daemonic
    ranks may not)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = tmp_path_factory.mktemp("megatron")
    here = Path(__file__).parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(here), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                          "--nproc_per_node", "2", "--log-dir", str(root / "agent"),
                          "-m", "test_checkpoint_megatron", str(root)],
                         env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    result = torch.load(root / "reference.pt", weights_only=True)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=DIM, intermediate_size=FFN,
                                   num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                                   num_key_value_heads=KV, tie_word_embeddings=False, rms_norm_eps=1e-5,
                                   rope_theta=10000.0, max_position_embeddings=64)
    cfg.save_pretrained(root / "hf_config")
    return root, result


def _check_export(folder, reference: dict, logits: torch.Tensor) -> None:
    from safetensors.torch import load_file

    got = {}
    for f in folder.glob("*.safetensors"):
        got.update(load_file(f))
    assert sorted(got) == sorted(reference)
    for name, want in reference.items():
        assert torch.equal(got[name], want), name
    model = transformers.AutoModelForCausalLM.from_pretrained(folder)
    with torch.no_grad():
        ours = model(input_ids=TOKENS).logits
    # fp32: Megatron's attention (explicit softmax over a masked score matrix) and
    # transformers' SDPA sum in different orders: equal to a few ulps of the logits.
    assert (ours - logits[..., :ours.shape[-1]]).abs().max() < 1e-5


@pytest.mark.parametrize("layout", ["dist", "legacy"])
def test_megatron_converts_with_its_args(megatron, tmp_path, layout):
    """Config from Megatron-LM's args: the padded vocabulary (528 rows) is the model's."""
    root, result = megatron
    convert(root / layout, tmp_path / "hf", "hf", progress=False)
    _check_export(tmp_path / "hf", reference_hf(result["shards"], PADDED), result["logits"])


@pytest.mark.parametrize("layout", ["dist", "legacy"])
def test_megatron_converts_with_a_hf_config(megatron, tmp_path, layout):
    """With --config, the true 521-token vocabulary: the padding rows are dropped."""
    root, result = megatron
    convert(root / layout, tmp_path / "hf", "hf", config=root / "hf_config" / "config.json", progress=False)
    _check_export(tmp_path / "hf", reference_hf(result["shards"], VOCAB), result["logits"])


def test_megatron_refusals_are_one_line(megatron, tmp_path):
    import shutil

    root, _ = megatron
    legacy = tmp_path / "legacy"
    shutil.copytree(root / "legacy", legacy)
    (legacy / "iter_0000003" / "mp_rank_01" / "model_optim_rng.pt").unlink()
    with pytest.raises(CheckpointError, match=r"rank files of \['mp_rank_01'\] are missing"):
        convert(legacy, tmp_path / "a", "hf", progress=False)
    from parallel3d.checkpoint.foreign.megatron import config_from_args

    for field, value, needle in [("swiglu", False, "non-SwiGLU"), ("normalization", "LayerNorm", "RMSNorm needed"),
                                 ("add_bias_linear", True, "linear biases"),
                                 ("rotary_interleaved", True, "interleaved rotary")]:
        args = megatron_args()
        setattr(args, field, value)
        with pytest.raises(CheckpointError, match=needle) as e:
            config_from_args(args, root)
        assert "\n" not in str(e.value)


if __name__ == "__main__":  # one rank of the writer (see the ``megatron`` fixture)
    import sys

    torch.distributed.init_process_group("gloo")
    _megatron_run(sys.argv[1])
    torch.distributed.destroy_process_group()
