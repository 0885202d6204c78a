"""The MoE families from Hugging Face: tiny random Qwen3-MoE (a dense first layer), Mixtral,
OLMoE (q/k norms over all heads) and Qwen2-MoE (shared expert with its gate, sparse every
second layer) saved with ``save_pretrained``, read into parallel3d from the folder:
logits, masked loss, aux loss and gradients equal transformers'; our export is the
folder's tensors bit for bit, and transformers loads it."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from parallel3d.models.llama import Llama
from parallel3d.models.llama.hf import config_from_hf, config_to_hf, name_from_hf, name_to_hf

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

VOCAB = 97
SMALL = dict(vocab_size=VOCAB, hidden_size=48, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6)
FAMILIES = ["qwen3_moe", "mixtral", "olmoe", "qwen2_moe"]


def _family(name: str):
    t = transformers
    return {
        "qwen3_moe": (t.Qwen3MoeForCausalLM, t.Qwen3MoeConfig(
            **SMALL, intermediate_size=80, moe_intermediate_size=24, num_experts=8, num_experts_per_tok=2,
            mlp_only_layers=[0], norm_topk_prob=True, router_aux_loss_coef=0.02)),
        "mixtral": (t.MixtralForCausalLM, t.MixtralConfig(
            **SMALL, intermediate_size=40, num_local_experts=4, num_experts_per_tok=2)),
        "olmoe": (t.OlmoeForCausalLM, t.OlmoeConfig(
            **SMALL, intermediate_size=32, num_experts=8, num_experts_per_tok=3, pad_token_id=None,
            eos_token_id=None)),
        "qwen2_moe": (t.Qwen2MoeForCausalLM, t.Qwen2MoeConfig(
            **SMALL, intermediate_size=80, moe_intermediate_size=24, shared_expert_intermediate_size=56,
            num_experts=6, num_experts_per_tok=2, decoder_sparse_step=2)),
    }[name]


def _hf_folder(name: str, folder):
    """A random ``name`` model saved to ``folder``; returns the in-memory model."""
    cls, cfg = _family(name)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(len(name))
    model = cls(cfg).eval()
    with torch.no_grad():  # norms and biases away from 1 and 0, so they are exercised
        for n, p in model.named_parameters():
            if n.endswith(".bias"):
                p.normal_(0.0, 0.5)
            elif "norm" in n:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif n.endswith("gate.weight"):  # routers decisive: no near-ties in the top-k
                p.normal_(0.0, 0.3)
    model.save_pretrained(folder)
    return model


def _ours_from_folder(folder) -> Llama:
    cfg = config_from_hf(json.loads((folder / "config.json").read_text()))
    state = safetensors_torch.load_file(folder / "model.safetensors")
    model = Llama(cfg).eval()
    model.load_state_dict({name_from_hf(k): v for k, v in state.items()}, strict=True)
    return model


def _batch():
    gen = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, VOCAB, (2, 29), generator=gen)
    labels = torch.where(torch.rand(2, 29, generator=gen) < 0.6, tokens, -100)
    return tokens, labels


def _masked_loss(logits, labels):
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_loss_aux_loss_equal_transformers(family, tmp_path):
    hf = _hf_folder(family, tmp_path)
    ours = _ours_from_folder(tmp_path)
    moe = ours.cfg.moe
    assert moe.aux_loss_coef == hf.config.router_aux_loss_coef
    assert moe.dense_layers == {"qwen3_moe": (0,), "qwen2_moe": (0, 2)}.get(family, ())
    assert bool(moe.shared_ffn_dim) == (family == "qwen2_moe")
    tokens, labels = _batch()
    want = hf(tokens, labels=labels, output_router_logits=True)
    logits = ours(tokens)
    loss = _masked_loss(logits, labels)
    aux = ours.aux_loss()
    # fp32, the same operations (the experts' products and sums in another order):
    # equal to reassociation, far below the 1e-5 bar.
    assert (logits - want.logits).abs().max() < 1e-5
    assert abs(aux.item() - want.aux_loss.item()) < 1e-5
    total = loss + moe.aux_loss_coef * aux
    assert abs(total.item() - want.loss.item()) < 1e-5  # transformers' loss includes coef * aux
    # the gradients of that loss, router and experts included, equal transformers'
    total.backward()
    want.loss.backward()
    ours_grads = {name_to_hf(n, family): p.grad for n, p in ours.named_parameters()}
    for name, p in hf.named_parameters():
        if name.endswith("experts.gate_up_proj"):
            prefix = name[: -len("gate_up_proj")].replace(".mlp.", ".block_sparse_moe." if family == "mixtral" else ".mlp.")
            for e, fused in enumerate(p.grad):
                gate, up = fused.chunk(2)
                g, u = ("w1", "w3") if family == "mixtral" else ("gate_proj", "up_proj")
                assert (ours_grads[f"{prefix}{e}.{g}.weight"] - gate).abs().max() < 1e-5
                assert (ours_grads[f"{prefix}{e}.{u}.weight"] - up).abs().max() < 1e-5
        elif name.endswith("experts.down_proj"):
            prefix = name[: -len("down_proj")].replace(".mlp.", ".block_sparse_moe." if family == "mixtral" else ".mlp.")
            d = "w2" if family == "mixtral" else "down_proj"
            for e, grad in enumerate(p.grad):
                assert (ours_grads[f"{prefix}{e}.{d}.weight"] - grad).abs().max() < 1e-5
        else:
            key = name.replace(".mlp.gate.", ".block_sparse_moe.gate.") if family == "mixtral" else name
            assert (ours_grads[key] - p.grad).abs().max() < 1e-5, name


@pytest.mark.parametrize("family", FAMILIES)
def test_hf_to_ours_to_hf_is_bit_identical(family, tmp_path):
    source, export = tmp_path / "hf", tmp_path / "ours"
    hf = _hf_folder(family, source)
    ours = _ours_from_folder(source)
    cfg = ours.cfg
    hf_config = config_to_hf(cfg)
    assert hf_config["model_type"] == family and config_from_hf(hf_config) == cfg
    export.mkdir()
    (export / "config.json").write_text(json.dumps(hf_config))
    state = {name_to_hf(n, family): t.contiguous() for n, t in ours.state_dict().items()}
    safetensors_torch.save_file(state, export / "model.safetensors", metadata={"format": "pt"})
    want = safetensors_torch.load_file(source / "model.safetensors")
    got = safetensors_torch.load_file(export / "model.safetensors")
    assert sorted(got) == sorted(want)
    assert any(".experts.1." in n for n in got)  # per expert on disk, as transformers writes
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name
    # transformers reads our folder (its config.json included) into the model it reads
    # from the source folder (from_pretrained's experts path differs from a freshly built
    # model's in the last bits, so both sides load)
    back, source_model = (type(hf).from_pretrained(f, attn_implementation="sdpa").eval() for f in (export, source))
    tokens, _ = _batch()
    with torch.no_grad():
        assert torch.equal(back(tokens).logits, source_model(tokens).logits)


def test_moe_configs_refused_by_name():
    _, qwen3 = _family("qwen3_moe")
    _, mixtral = _family("mixtral")
    _, olmoe = _family("olmoe")
    with pytest.raises(ValueError, match="router_jitter_noise"):
        config_from_hf({**mixtral.to_dict(), "router_jitter_noise": 0.1})
    with pytest.raises(ValueError, match="clip_qkv"):
        config_from_hf({**olmoe.to_dict(), "clip_qkv": 8.0})
    cfg = config_from_hf(qwen3.to_dict())
    from dataclasses import replace
    with pytest.raises(ValueError, match=r"moe \['score_func', 'expert_bias'\] have no Hugging Face"):
        config_to_hf(replace(cfg, moe=replace(cfg.moe, score_func="sigmoid", expert_bias=True)))
    with pytest.raises(ValueError, match="dense layers \\[0\\] have no olmoe spelling"):
        config_to_hf(replace(cfg, qk_norm_all_heads=True))
    from parallel3d.models.llama.parallelize import tensor_parallel_problems

    assert tensor_parallel_problems(config_from_hf(olmoe.to_dict()), 2) == []  # norms split with the heads
    problems = tensor_parallel_problems(config_from_hf(olmoe.to_dict()), 4)  # 2 kv-heads
    assert "q/k norms over all heads (OLMoE) split with the heads: parallel.tp 4 must divide model.n_kv_heads 2" in problems
    assert tensor_parallel_problems(cfg, 2) == []  # Qwen3-MoE: attention split, experts whole


@pytest.mark.parametrize("family", FAMILIES)
def test_convert_hf_to_parallel3d_checkpoint_to_hf_is_bit_identical(family, tmp_path):
    """The same round trip through ``parallel3d convert``: the HF folder into a parallel3d
    checkpoint (the nested MoE config in its index) and back to a Hugging Face folder."""
    from parallel3d.checkpoint.convert import convert

    _hf_folder(family, tmp_path / "hf")
    convert(tmp_path / "hf", tmp_path / "ckpt", "parallel3d", progress=False)
    convert(tmp_path / "ckpt", tmp_path / "back", "hf", progress=False)
    want = safetensors_torch.load_file(tmp_path / "hf" / "model.safetensors")
    got = safetensors_torch.load_file(tmp_path / "back" / "model.safetensors")
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name
    back = json.loads((tmp_path / "back" / "config.json").read_text())
    assert back["model_type"] == family
    assert config_from_hf(back) == config_from_hf(json.loads((tmp_path / "hf" / "config.json").read_text()))
