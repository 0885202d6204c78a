"""Hugging Face ``LlamaForCausalLM`` (and Mistral, Qwen2) <-> parallel3d names and configs.

Our parameter names are Hugging Face's without the ``model.`` prefix, so the state-dict
adapter is a rename; the config adapter maps field names and refuses what we do not model
(with the field and what to do).

Config versions: transformers 4 writes ``rope_theta`` and ``rope_scaling``; transformers 5
writes ``rope_parameters = {"rope_type", "rope_theta", ...scaling fields}``. Both are read.
"""

from __future__ import annotations

from .model import ROPE_SCALINGS, LlamaConfig

_ARCHS = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2"}
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


def config_from_hf(hf: dict) -> LlamaConfig:
    """A :class:`LlamaConfig` from a Hugging Face ``config.json`` dict."""
    archs = hf.get("architectures")
    if archs:
        known = [a for a in archs if a in _ARCHS]
        if not known:
            raise ValueError(f"unsupported Hugging Face architecture {archs}: parallel3d reads {sorted(_ARCHS)}")
        family = _ARCHS[known[0]]
    else:
        family = hf.get("model_type", "llama")
        if family not in _ARCHS.values():
            raise ValueError(f"unsupported Hugging Face model_type '{family}': parallel3d reads "
                             f"{sorted(_ARCHS.values())}")
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act '{hf['hidden_act']}' is not supported: the MLP is SwiGLU (silu)")
    if hf.get("attention_bias") or hf.get("mlp_bias"):
        raise ValueError("attention_bias / mlp_bias (biases on o_proj or the MLP) are not supported; "
                         "q/k/v biases are, as in Qwen2")
    if hf.get("use_sliding_window"):
        raise ValueError("use_sliding_window = true is not supported: attention is full causal")
    n_heads, dim = hf["num_attention_heads"], hf["hidden_size"]
    if hf.get("head_dim") not in (None, dim // n_heads):
        raise ValueError(f"head_dim {hf['head_dim']} != hidden_size/num_attention_heads "
                         f"{dim // n_heads}: unsupported")
    theta, scaling = _rope(hf)
    max_len = hf.get("max_position_embeddings", 8192)
    window = hf.get("sliding_window") if family == "mistral" else None
    if window:
        # Sliding-window attention equals full causal attention on sequences that fit in
        # the window: cap the sequence length there and the model is exact.
        max_len = min(max_len, window)
    return LlamaConfig(
        vocab_size=hf["vocab_size"], dim=dim, n_layers=hf["num_hidden_layers"],
        n_heads=n_heads, n_kv_heads=hf.get("num_key_value_heads") or n_heads,
        ffn_dim=hf["intermediate_size"], rope_theta=theta,
        norm_eps=float(hf.get("rms_norm_eps", 1e-5)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        max_seq_len=max_len, qkv_bias=family == "qwen2", rope_scaling=scaling,
    )


def config_to_hf(cfg: LlamaConfig) -> dict:
    """A ``config.json`` dict (transformers 4 spelling, which transformers 5 also reads)."""
    arch, model_type = ("Qwen2ForCausalLM", "qwen2") if cfg.qkv_bias else ("LlamaForCausalLM", "llama")
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
        out.update({"attention_bias": False, "mlp_bias": False})
    else:
        out.update({"use_sliding_window": False, "sliding_window": None})
    return out


def name_from_hf(name: str) -> str:
    return name[len("model."):] if name.startswith("model.") else name


def name_to_hf(name: str) -> str:
    return name if name.startswith("lm_head.") else f"model.{name}"
