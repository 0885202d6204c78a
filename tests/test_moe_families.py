"""MoE families from Hugging Face at tp 2 x pp 2 x dp 2 with ep 2 (8 gloo ranks, sequence
parallelism, 1F1B; Qwen2-MoE under zb-h1 too): tiny random Qwen3-MoE (dense first layer), Mixtral, OLMoE and Qwen2-MoE
(shared expert, sparse every second layer) saved with ``save_pretrained`` and read from
the folder; the masked loss of a packed batch equals transformers' loss computed document
by document (the dense families' test, tests/test_families.py, with experts split over
the two data-parallel ranks of each (tp, pp) position). OLMoE's all-heads q/k norms split
with the heads, their sums of squares added over tp (parallel3d/tensor_parallel/norm.py)."""

from __future__ import annotations

import json

import pytest
import torch

from parallel3d.config import ParallelConfig
from parallel3d.data.batch import MicroBatch
from parallel3d.models.llama.hf import config_from_hf, name_from_hf

from test_families import SEQ, VOCAB, _packed_global_batch, _reference_loss

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")
pytestmark = pytest.mark.usefixtures("one_thread")

SMALL = dict(vocab_size=VOCAB, hidden_size=48, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256)


def _family(name: str):
    t = transformers
    return {
        "qwen3_moe": (t.Qwen3MoeForCausalLM, t.Qwen3MoeConfig(
            **SMALL, intermediate_size=64, moe_intermediate_size=24, num_experts=4, num_experts_per_tok=2,
            mlp_only_layers=[0], norm_topk_prob=True)),
        "mixtral": (t.MixtralForCausalLM, t.MixtralConfig(
            **SMALL, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2)),
        "olmoe": (t.OlmoeForCausalLM, t.OlmoeConfig(
            **SMALL, intermediate_size=24, num_experts=4, num_experts_per_tok=2, pad_token_id=None,
            eos_token_id=None)),
        "qwen2_moe": (t.Qwen2MoeForCausalLM, t.Qwen2MoeConfig(
            **SMALL, intermediate_size=64, moe_intermediate_size=24, shared_expert_intermediate_size=40,
            num_experts=4, num_experts_per_tok=2, decoder_sparse_step=2)),
    }[name]


def _hf_folder(name: str, folder):
    cls, cfg = _family(name)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(len(name) + 1)
    model = cls(cfg).eval()
    with torch.no_grad():  # biases, norms away from 0 and 1; decisive routers (no near-ties)
        for n, p in model.named_parameters():
            if n.endswith(".bias"):
                p.normal_(0.0, 0.5)
            elif "norm" in n:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif n.endswith("gate.weight"):
                p.normal_(0.0, 0.3)
    model.save_pretrained(folder)
    return model


def _packed_loss_3d_ep(hf_config: dict, state: dict, windows: list, schedule: str) -> float:
    """test_families._packed_loss_3d with the experts of every sparse layer split over ep 2."""
    from parallel3d.distributed import all_reduce
    from parallel3d.models.llama import Llama
    from parallel3d.models.llama.parallelize import activation_shape, parallelize_llama
    from parallel3d.models.moe.parallelize import apply_expert_parallel
    from parallel3d.pipeline import build_schedule
    from parallel3d.topology import Topology

    topo = Topology(2, 2, 2, ep=2)
    par = ParallelConfig(tp=2, pp=2, dp=2, sequence_parallel=True, schedule=schedule)
    cfg = config_from_hf(hf_config)
    model = Llama(cfg)
    model.load_state_dict(state, strict=True)
    model, loss_fn = parallelize_llama(model, topo, par)
    apply_expert_parallel(model, topo.ep_group)
    held = {int(n.split(".experts.")[1].split(".")[0]) for n, _ in model.named_parameters() if ".experts." in n}
    runner = build_schedule(model, loss_fn, topo, par, device=torch.device("cpu"),
                            activation_shape=activation_shape(cfg, 1, SEQ, 2, True))
    supervised = sum(int((t != -100).sum()) for _, t, _ in windows)
    mine = windows[2 * topo.dp_rank: 2 * topo.dp_rank + 2]
    batches = [MicroBatch(x[None], t[None], p[None], supervised / topo.dp) for x, t, p in mine]
    loss = runner.run(batches)
    return float(all_reduce(loss.clone(), topo.dp_group) / topo.dp), sorted(held)


@pytest.mark.parametrize("family,schedule", [("qwen3_moe", "1f1b"), ("mixtral", "1f1b"), ("olmoe", "1f1b"),
                                             ("qwen2_moe", "1f1b"), ("qwen2_moe", "zb-h1")])
def test_packed_masked_loss_at_2x2x2_ep2_equals_transformers_per_document(pools, family, schedule, tmp_path):
    hf = _hf_folder(family, tmp_path)
    hf_config = json.loads((tmp_path / "config.json").read_text())
    state = {name_from_hf(k): v for k, v in safetensors_torch.load_file(tmp_path / "model.safetensors").items()}
    docs, windows = _packed_global_batch(seed=len(family))
    want = _reference_loss(hf, docs)
    results = pools(8).run(_packed_loss_3d_ep, hf_config, state, windows, schedule)
    for rank, (rank_loss, held) in enumerate(results):
        # as tests/test_families.py: fp32 against a float64 sum of transformers' fp32
        # logits, the same ops in another order; 1e-5 relative is the bar
        assert abs(rank_loss - want) / want < 1e-5, (family, rank, rank_loss, want)
        dp_rank = (rank // 2) % 2  # rank = (pp_rank * dp + dp_rank) * tp + tp_rank
        assert held == [2 * dp_rank, 2 * dp_rank + 1]  # ep rank = dp rank: experts split in two
