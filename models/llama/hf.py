"""Hugging Face ``LlamaForCausalLM`` <-> parallel3d names and configs.

Our parameter names are Hugging Face's without the ``model.`` prefix, so the state-dict
adapter is a rename; the config adapter maps field names and refuses what we do not model.
"""

from __future__ import annotations

from .model import LlamaConfig

_SUPPORTED_ARCHS = {"LlamaForCausalLM", "MistralForCausalLM"}


def config_from_hf(hf: dict) -> LlamaConfig:
    """A :class:`LlamaConfig` from a Hugging Face ``config.json`` dict."""
    archs = set(hf.get("architectures") or ["LlamaForCausalLM"])
    if not archs & _SUPPORTED_ARCHS:
        raise ValueError(f"unsupported Hugging Face architecture {sorted(archs)}: "
                         f"parallel3d reads {sorted(_SUPPORTED_ARCHS)}")
    if hf.get("rope_scaling"):
        raise ValueError(f"rope_scaling {hf['rope_scaling']} is not supported yet: "
                         "remove it from config.json or use a base (unscaled) checkpoint")
    n_heads = hf["num_attention_heads"]
    dim = hf["hidden_size"]
    if hf.get("head_dim", dim // n_heads) != dim // n_heads:
        raise ValueError(f"head_dim {hf['head_dim']} != hidden_size/num_attention_heads: unsupported")
    return LlamaConfig(
        vocab_size=hf["vocab_size"], dim=dim, n_layers=hf["num_hidden_layers"],
        n_heads=n_heads, n_kv_heads=hf.get("num_key_value_heads", n_heads),
        ffn_dim=hf["intermediate_size"], rope_theta=float(hf.get("rope_theta", 10000.0)),
        norm_eps=float(hf.get("rms_norm_eps", 1e-5)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        max_seq_len=hf.get("max_position_embeddings", 8192),
    )


def config_to_hf(cfg: LlamaConfig) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.dim,
        "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads, "intermediate_size": cfg.ffn_dim,
        "rope_theta": cfg.rope_theta, "rms_norm_eps": cfg.norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings, "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len, "attention_bias": False,
        "mlp_bias": False, "torch_dtype": "float32",
    }


def name_from_hf(name: str) -> str:
    return name[len("model."):] if name.startswith("model.") else name


def name_to_hf(name: str) -> str:
    return name if name.startswith("lm_head.") else f"model.{name}"
