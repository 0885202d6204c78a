"""Hugging Face ``LlamaForCausalLM`` (and Mistral, Qwen2, Qwen3; the MoE families Qwen3-MoE,
Qwen2-MoE, Mixtral, OLMoE) <-> parallel3d names and configs.

Our parameter names are Hugging Face's without the ``model.`` prefix, so the state-dict
adapter is a rename; the config adapter maps field names and refuses what we do not model
(with the field and what to do).

What the families add to the Llama block: Qwen2 q/k/v biases; Qwen3 an RMSNorm over each
head's q and k (``q_norm``, ``k_norm``); ``attention_bias`` (Llama, Qwen3) biases on q, k, v
and o; ``head_dim`` other than hidden / heads (Mistral-Nemo, Qwen3). Mistral's sliding
window caps the sequence length (below it, attention is the full causal one). The MoE
families: the same attention (OLMoE's q/k norms span all heads), the MoE fields and
Mixtral's names in ``models/moe/hf.py``.

Config versions: transformers 4 writes ``rope_theta`` and ``rope_scaling``; transformers 5
writes ``rope_parameters = {"rope_type", "rope_theta", ...scaling fields}``. Both are read.
"""

from __future__ import annotations

from ..moe.hf import MOE_ARCHS, moe_config_from_hf, moe_config_to_hf, moe_family, name_from_mixtral, name_to_mixtral
from .config import ROPE_SCALINGS, LlamaConfig

_ARCHS = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2",
          "Qwen3ForCausalLM": "qwen3", **MOE_ARCHS}
_MOE_ARCH_OF = {family: arch for arch, family in MOE_ARCHS.items()}
# Scaling fields that only change the rotary frequencies (other keys of rope_parameters,
# such as the theta, are read separately).
_SCALING_KEYS = {"rope_type", "factor", "low_freq_factor", "high_freq_factor",
                 "original_max_position_embeddings"}


def _rope(hf: dict) -> tuple[float, tuple]:
    """(theta, scaling pairs) from either config version."""
    params = dict(hf.get("rope_parameters") or {})
    legacy = dict(hf.get("rope_scaling") or {})
    theta = params.pop("rope_theta", hf.get("rope_theta", 10000.0))
    scaling = {**legacy, **params}
    if "type" in scaling and "rope_type" not in scaling:  # transformers < 4.45 spelling
        scaling["rope_type"] = scaling.pop("type")
    kind = scaling.get("rope_type", "default")
    if kind not in ROPE_SCALINGS:
        raise ValueError(f"rope scaling '{kind}' is not supported: parallel3d implements "
                         f"{list(ROPE_SCALINGS)} (config.json rope_scaling / rope_parameters)")
    if kind == "default":
        return float(theta), ()
    extra = sorted(set(scaling) - _SCALING_KEYS - {"type"})
    if extra:
        raise ValueError(f"rope scaling '{kind}' with fields {extra} is not supported")
    need = {"linear": {"factor"}, "llama3": _SCALING_KEYS - {"rope_type"}}[kind]
    missing = sorted(need - set(scaling))
    if missing:
        raise ValueError(f"rope scaling '{kind}' lacks {missing} in config.json")
    pairs = tuple(sorted((k, v) for k, v in scaling.items() if k in need | {"rope_type"}))
    return float(theta), pairs


def _family(hf: dict) -> str:
    archs = hf.get("architectures")
    if archs:
        known = [a for a in archs if a in _ARCHS]
        if not known:
            raise ValueError(f"unsupported Hugging Face architecture {archs}: parallel3d reads {sorted(_ARCHS)}")
        return _ARCHS[known[0]]
    family = hf.get("model_type", "llama")
    if family not in _ARCHS.values():
        raise ValueError(f"unsupported Hugging Face model_type '{family}': parallel3d reads "
                         f"{sorted(_ARCHS.values())}")
    return family


def _check_attention(hf: dict, family: str) -> None:
    """Refuse, by name, what the block does not model."""
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act '{hf['hidden_act']}' is not supported: the MLP is SwiGLU (silu)")
    if hf.get("mlp_bias"):
        raise ValueError("mlp_bias (biases on the MLP projections) is not supported")
    if hf.get("attention_bias") and family in ("mistral", "qwen2", "mixtral", "qwen2_moe"):
        raise ValueError(f"attention_bias on a {family} config is not supported (transformers' "
                         f"{family} has no such field)")
    if hf.get("use_sliding_window"):
        raise ValueError("use_sliding_window = true is not supported: attention is full causal")
    kinds = sorted(set(hf.get("layer_types") or ["full_attention"]) - {"full_attention"})
    if kinds:
        raise ValueError(f"layer_types {kinds} are not supported: every layer is full causal attention")
    if hf.get("clip_qkv") is not None:
        raise ValueError(f"clip_qkv {hf['clip_qkv']} is not supported: q, k, v are not clipped")


def config_from_hf(hf: dict) -> LlamaConfig:
    """A :class:`LlamaConfig` from a Hugging Face ``config.json`` dict."""
    family = _family(hf)
    _check_attention(hf, family)
    n_heads, dim = hf["num_attention_heads"], hf["hidden_size"]
    head_dim = hf.get("head_dim") or dim // n_heads
    theta, scaling = _rope(hf)
    max_len = hf.get("max_position_embeddings", 8192)
    window = hf.get("sliding_window") if family in ("mistral", "mixtral") else None
    if window:
        # Sliding-window attention equals full causal attention on sequences that fit in
        # the window: cap the sequence length there and the model is exact.
        max_len = min(max_len, window)
    bias = bool(hf.get("attention_bias"))  # Llama, Qwen3(-MoE), OLMoE: q, k, v and o
    qkv_bias = family == "qwen2" or (family == "qwen2_moe" and hf.get("qkv_bias", True)) or bias
    return LlamaConfig(
        vocab_size=hf["vocab_size"], dim=dim, n_layers=hf["num_hidden_layers"],
        n_heads=n_heads, n_kv_heads=hf.get("num_key_value_heads") or n_heads,
        ffn_dim=hf["intermediate_size"], rope_theta=theta,
        norm_eps=float(hf.get("rms_norm_eps", 1e-5)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        max_seq_len=max_len, qkv_bias=qkv_bias, o_bias=bias,
        qk_norm=family in ("qwen3", "qwen3_moe", "olmoe"), qk_norm_all_heads=family == "olmoe",
        rope_scaling=scaling, head_dim_override=head_dim if head_dim * n_heads != dim else 0,
        moe=moe_config_from_hf(hf, family) if family in _MOE_ARCH_OF else None,
    )


def config_to_hf(cfg: LlamaConfig) -> dict:
    """A ``config.json`` dict (transformers 4 spelling, which transformers 5 also reads):
    Qwen3 for q/k norms, Qwen2 for q/k/v biases without an o bias, else Llama; with MoE, the
    family :func:`moe_family` picks."""
    if cfg.o_bias and not cfg.qkv_bias:
        raise ValueError("an o_proj bias without q/k/v biases has no Hugging Face architecture")
    if cfg.moe is not None:
        return _moe_config_to_hf(cfg)
    if cfg.qk_norm:
        arch, model_type = "Qwen3ForCausalLM", "qwen3"
    elif cfg.qkv_bias and not cfg.o_bias:
        arch, model_type = "Qwen2ForCausalLM", "qwen2"
    else:
        arch, model_type = "LlamaForCausalLM", "llama"
    out = {
        "architectures": [arch], "model_type": model_type,
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.dim,
        "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads, "intermediate_size": cfg.ffn_dim,
        "head_dim": cfg.head_dim,
        "rope_theta": cfg.rope_theta, "rms_norm_eps": cfg.norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings, "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len, "torch_dtype": "float32",
        "rope_scaling": dict(cfg.rope_scaling) or None,
    }
    if model_type == "llama":
        out.update({"attention_bias": cfg.o_bias, "mlp_bias": False})
    else:
        out.update({"use_sliding_window": False, "sliding_window": None})
    if model_type == "qwen3":
        out["attention_bias"] = cfg.o_bias
    return out


def _moe_config_to_hf(cfg: LlamaConfig) -> dict:
    family = moe_family(cfg.moe, cfg.qk_norm, cfg.qk_norm_all_heads)
    if cfg.o_bias and family in ("mixtral", "qwen2_moe"):
        raise ValueError(f"an o_proj bias has no {family} spelling")
    if cfg.qkv_bias and not cfg.o_bias and family != "qwen2_moe":
        raise ValueError(f"q/k/v biases without an o bias have no {family} spelling")
    out = {
        "architectures": [_MOE_ARCH_OF[family]], "model_type": family,
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.dim,
        "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads, "intermediate_size": cfg.ffn_dim,
        "rope_theta": cfg.rope_theta, "rms_norm_eps": cfg.norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings, "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len, "torch_dtype": "float32",
        "rope_scaling": dict(cfg.rope_scaling) or None, "sliding_window": None,
        **moe_config_to_hf(cfg.moe, family),
    }
    if cfg.head_dim_override:
        if family == "olmoe":
            raise ValueError("OLMoE has no head_dim: the head width is hidden_size / heads")
        out["head_dim"] = cfg.head_dim
    if family == "qwen2_moe":
        out.update({"qkv_bias": cfg.qkv_bias, "use_sliding_window": False})
    elif family in ("qwen3_moe", "olmoe"):  # attention_bias: q, k, v and o
        out["attention_bias"] = cfg.o_bias
        if family == "qwen3_moe":
            out["use_sliding_window"] = False
    return out


def name_from_hf(name: str) -> str:
    """A Hugging Face tensor name as ours (Mixtral's expert names renamed)."""
    return name_from_mixtral(name[len("model."):] if name.startswith("model.") else name)


def name_to_hf(name: str, model_type: str = "llama") -> str:
    """Our tensor name as ``model_type`` (config.json's) writes it."""
    if model_type == "mixtral":
        name = name_to_mixtral(name)
    return name if name.startswith("lm_head.") else f"model.{name}"
