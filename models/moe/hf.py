"""Hugging Face MoE families <-> :class:`MoEConfig` and parameter names.

The MoE fields of a ``config.json`` (``models/llama/hf.py`` reads the attention part and
calls these):

==============  ==================  =======================  ==========================
family          experts             expert width             dense layers
==============  ==================  =======================  ==========================
qwen3_moe       num_experts*        moe_intermediate_size    mlp_only_layers,
                                                             decoder_sparse_step
qwen2_moe       num_experts         moe_intermediate_size    the same; plus a shared
                                                             expert (shared_expert_
                                                             intermediate_size) and gate
mixtral         num_local_experts   intermediate_size        none; top-k always renormalised
olmoe           num_experts         intermediate_size        none
==============  ==================  =======================  ==========================

(* transformers 5 writes Qwen3-MoE's as ``num_local_experts``; both are read.)

Names: on disk every family stores each expert separately; ours are Hugging Face's
Qwen/OLMoE names (``mlp.experts.{e}.gate_proj.weight``, ``mlp.gate.weight``), and
Mixtral's ``block_sparse_moe.experts.{e}.w1/w3/w2`` (gate, up, down) and
``block_sparse_moe.gate`` rename to them and back.
"""

from __future__ import annotations

import re

from .config import MoEConfig, dense_layers_from

MOE_ARCHS = {"Qwen3MoeForCausalLM": "qwen3_moe", "Qwen2MoeForCausalLM": "qwen2_moe",
             "MixtralForCausalLM": "mixtral", "OlmoeForCausalLM": "olmoe"}
_MIXTRAL_FROM = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_MIXTRAL_TO = {v: k for k, v in _MIXTRAL_FROM.items()}


def moe_config_from_hf(hf: dict, family: str) -> MoEConfig:
    """The MoE section of a ``config.json`` of ``family`` (one of MOE_ARCHS' values)."""
    if hf.get("router_jitter_noise"):
        raise ValueError(f"router_jitter_noise {hf['router_jitter_noise']} is not supported: "
                         "routing is deterministic (set it to 0.0)")
    qwen = family in ("qwen3_moe", "qwen2_moe")
    dense = ()
    if qwen:
        dense = dense_layers_from(hf["num_hidden_layers"], hf.get("mlp_only_layers") or (),
                                  hf.get("decoder_sparse_step", 1))
    shared = hf.get("shared_expert_intermediate_size", 0) if family == "qwen2_moe" else 0
    return MoEConfig(
        n_experts=hf.get("num_experts") or hf["num_local_experts"],
        top_k=hf["num_experts_per_tok"],
        ffn_dim=hf["moe_intermediate_size"] if qwen else hf["intermediate_size"],
        norm_topk_prob=True if family == "mixtral" else bool(hf.get("norm_topk_prob", False)),
        shared_ffn_dim=shared, shared_gate=bool(shared), dense_layers=dense,
        aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.0)),
    )


def moe_family(moe: MoEConfig, qk_norm: bool, qk_norm_all_heads: bool) -> str:
    """The Hugging Face family that models ``moe`` (with the attention's q/k norms), or a
    ValueError naming what none of them has."""
    beyond = [name for name, off in (("score_func", "softmax"), ("n_group", 1), ("routed_scaling", 1.0),
                                     ("capacity_factor", 0.0), ("expert_bias", False))
              if getattr(moe, name) != off]
    if beyond:
        raise ValueError(f"moe {beyond} have no Hugging Face architecture among {sorted(MOE_ARCHS)}")
    if qk_norm:
        family = "olmoe" if qk_norm_all_heads else "qwen3_moe"
    else:
        family = "qwen2_moe" if moe.shared_ffn_dim else "mixtral"
    if moe.shared_ffn_dim and (family != "qwen2_moe" or not moe.shared_gate):
        raise ValueError("a shared expert is written as Qwen2-MoE only: without q/k norms, with its gate")
    if moe.dense_layers and family in ("mixtral", "olmoe"):
        raise ValueError(f"dense layers {list(moe.dense_layers)} have no {family} spelling")
    if family == "mixtral" and not moe.norm_topk_prob:
        raise ValueError("Mixtral always renormalises the top-k weights: set moe.norm_topk_prob")
    return family


def moe_config_to_hf(moe: MoEConfig, family: str) -> dict:
    """The MoE fields of ``family``'s ``config.json``."""
    out = {"num_experts_per_tok": moe.top_k, "router_aux_loss_coef": moe.aux_loss_coef}
    if family == "mixtral":
        return {**out, "num_local_experts": moe.n_experts, "intermediate_size": moe.ffn_dim,
                "router_jitter_noise": 0.0}
    out.update({"num_experts": moe.n_experts, "norm_topk_prob": moe.norm_topk_prob})
    if family == "olmoe":
        return {**out, "intermediate_size": moe.ffn_dim, "clip_qkv": None}
    out.update({"moe_intermediate_size": moe.ffn_dim, "mlp_only_layers": list(moe.dense_layers),
                "decoder_sparse_step": 1})
    if family == "qwen2_moe":
        out["shared_expert_intermediate_size"] = moe.shared_ffn_dim
    return out


def name_from_mixtral(name: str) -> str:
    """``layers.3.block_sparse_moe.experts.5.w1.weight`` -> ``layers.3.mlp.experts.5.gate_proj.weight``;
    other names unchanged."""
    if ".block_sparse_moe." not in name:
        return name
    name = name.replace(".block_sparse_moe.", ".mlp.")
    return re.sub(r"(\.experts\.\d+\.)(w[123])\.", lambda m: m[1] + _MIXTRAL_FROM[m[2]] + ".", name)


def name_to_mixtral(name: str) -> str:
    """The inverse of :func:`name_from_mixtral` on our sparse-layer names."""
    if ".mlp." not in name:
        return name
    name = re.sub(r"(\.experts\.\d+\.)(gate_proj|up_proj|down_proj)\.",
                  lambda m: m[1] + _MIXTRAL_TO[m[2]] + ".", name)
    return name.replace(".mlp.", ".block_sparse_moe.")
