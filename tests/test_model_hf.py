"""The reference Llama equals Hugging Face's LlamaForCausalLM on the same weights."""

from __future__ import annotations

import pytest
import torch

from parallel3d.models.llama import Llama, config_from_preset
from parallel3d.models.llama.hf import config_from_hf, config_to_hf, name_to_hf

transformers = pytest.importorskip("transformers")


def _hf_twin(cfg, ours: Llama):
    hf_cfg = transformers.LlamaConfig(**config_to_hf(cfg))
    hf_cfg._attn_implementation = "sdpa"
    hf = transformers.LlamaForCausalLM(hf_cfg).eval()
    state = {name_to_hf(k): v for k, v in ours.state_dict().items()}
    hf.load_state_dict(state, strict=True)
    return hf


@pytest.mark.parametrize("tie", [False, True])
def test_logits_equal_transformers_gqa_odd_vocab(tie):
    # GQA (6 heads sharing 2 kv-heads), an odd vocabulary, a non-default rope theta.
    cfg = config_from_preset("debug", vocab_size=1031, dim=96, n_heads=6, n_kv_heads=2,
                             ffn_dim=200, n_layers=3, rope_theta=50000.0, tie_embeddings=tie)
    torch.manual_seed(0)
    ours = Llama(cfg).eval()
    hf = _hf_twin(cfg, ours)
    tokens = torch.randint(0, cfg.vocab_size, (2, 53))
    with torch.no_grad():
        diff = (ours(tokens) - hf(tokens).logits).abs().max().item()
    # fp32, same operations in the same order: equal up to reassociation inside SDPA.
    assert diff < 1e-5, diff


def test_hf_config_round_trip_and_refusals():
    cfg = config_from_preset("8b")
    assert config_from_hf(config_to_hf(cfg)) == cfg
    with pytest.raises(ValueError, match="unsupported Hugging Face architecture"):
        config_from_hf({**config_to_hf(cfg), "architectures": ["GPT2LMHeadModel"]})
    with pytest.raises(ValueError, match="rope scaling 'yarn' is not supported"):
        config_from_hf({**config_to_hf(cfg), "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    # attention_bias is read (tests/test_families.py); MLP biases and sliding-window layers
    # are still refused by name
    with pytest.raises(ValueError, match="mlp_bias"):
        config_from_hf({**config_to_hf(cfg), "mlp_bias": True})
    with pytest.raises(ValueError, match="layer_types"):
        config_from_hf({**config_to_hf(cfg), "layer_types": ["full_attention", "sliding_attention"]})


def _logits_diff(ours: Llama, hf, vocab: int) -> float:
    tokens = torch.randint(0, vocab, (2, 41))
    with torch.no_grad():
        return (ours(tokens) - hf(tokens).logits).abs().max().item()


def test_llama3_rope_scaling_and_qwen2_biases_equal_transformers():
    """Configs as transformers 5 writes them (rope_parameters) read into models whose
    logits equal transformers' on the same weights."""
    torch.manual_seed(0)
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
    small = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2)
    for hf_cls, cfg_cls, extra in [
            (transformers.LlamaForCausalLM, transformers.LlamaConfig,
             {"rope_parameters": {"rope_theta": 5000.0, **scaling}}),
            (transformers.Qwen2ForCausalLM, transformers.Qwen2Config, {})]:
        hf_cfg = cfg_cls(**small, **extra)
        hf_cfg._attn_implementation = "sdpa"
        hf = hf_cls(hf_cfg).eval()
        for name, p in hf.named_parameters():  # non-zero biases, so they are exercised
            if name.endswith(".bias"):
                torch.nn.init.normal_(p)
        cfg = config_from_hf(hf_cfg.to_dict())
        assert cfg.qkv_bias == (hf_cls is transformers.Qwen2ForCausalLM)
        assert dict(cfg.rope_scaling).get("rope_type") == ("llama3" if cfg_cls is transformers.LlamaConfig else None)
        ours = Llama(cfg).eval()
        ours.load_state_dict({k[len("model."):] if k.startswith("model.") else k: v
                              for k, v in hf.state_dict().items()}, strict=True)
        assert _logits_diff(ours, hf, cfg.vocab_size) < 1e-5  # fp32, same ops (see above)


@pytest.mark.parametrize("preset,billions", [("1b", 1.24), ("8b", 8.03), ("70b", 70.6)])
def test_presets_have_the_published_sizes(preset, billions):
    n = config_from_preset(preset).num_params()
    assert abs(n / 1e9 - billions) / billions < 0.01, n
    with torch.device("meta"):
        model = Llama(config_from_preset(preset))
    assert sum(p.numel() for p in model.parameters()) == n


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_swiglu_backward_equals_autograd_of_the_plain_expression(dtype):
    """The MLP's own backward (silu recomputed, aten's fused silu_backward) against
    autograd through ``silu(gate) * up``. fp64: equal to rounding (1e-12); bf16: both
    round each element-wise result to bf16 at different points, so they may differ by a
    few bf16 ulps of the gradient's scale (2**-8 relative per rounding, 3 roundings)."""
    from parallel3d.models.llama.model import _SwiGLUFn

    torch.manual_seed(0)
    gate = (torch.randn(4, 33, 40, dtype=torch.float64) * 3).to(dtype)
    up, dy = torch.randn_like(gate), torch.randn_like(gate)
    grads = []
    for fn in (_SwiGLUFn.apply, lambda g, u: torch.nn.functional.silu(g) * u):
        g, u = gate.clone().requires_grad_(), up.clone().requires_grad_()
        fn(g, u).backward(dy)
        grads.append((g.grad.double(), u.grad.double()))
    tol = 1e-12 if dtype == torch.float64 else 3 * 2.0 ** -8
    for ours, ref in zip(*grads):
        scale = ref.abs().max().item()
        assert (ours - ref).abs().max().item() <= tol * scale, (ours - ref).abs().max().item() / scale
