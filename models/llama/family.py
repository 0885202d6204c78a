"""The Llama family as the trainer sees a model family (``models.model_family("llama")``):
how to build this rank's part of a model on the meta device, initialise it, recompute its
activations, and what a pipeline stage sends. Dense Llama, Mistral, Qwen2/3 and the MoE
families (Qwen2/3-MoE, Mixtral, OLMoE: ``LlamaConfig.moe``) are all this family.

What follows from the config alone (``CONFIG``, ``stage_costs``,
``tensor_parallel_problems``) imports no torch, so the planner's ``parallel3d plan`` starts
in a fraction of a second; the rest imports the model when first called."""

from __future__ import annotations

from .config import LlamaConfig, stage_costs, tensor_parallel_problems

NAME = "llama"
CONFIG = LlamaConfig

__all__ = ["CONFIG", "NAME", "activation_shape", "apply_recompute", "build_meta", "initialize_",
           "stage_costs", "tensor_parallel_problems"]


def build_meta(*args, **kwargs):
    from .sharded_init import build_meta_llama
    return build_meta_llama(*args, **kwargs)


def initialize_(*args, **kwargs):
    from .sharded_init import init_llama_
    return init_llama_(*args, **kwargs)


def apply_recompute(*args, **kwargs):
    from .recompute import apply_recompute as apply
    return apply(*args, **kwargs)


def activation_shape(*args, **kwargs):
    from .parallelize import activation_shape as shape
    return shape(*args, **kwargs)
