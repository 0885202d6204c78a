"""The Llama family as the trainer sees a model family (``models.model_family("llama")``):
how to build this rank's part of a model on the meta device, initialise it, recompute its
activations, and what a pipeline stage sends. Dense Llama, Mistral, Qwen2/3 and the MoE
families (Qwen2/3-MoE, Mixtral, OLMoE: ``LlamaConfig.moe``) are all this family."""

from __future__ import annotations

from .model import LlamaConfig
from .parallelize import activation_shape, apply_recompute, stage_costs, tensor_parallel_problems
from .sharded_init import build_meta_llama as build_meta
from .sharded_init import init_llama_ as initialize_

NAME = "llama"
CONFIG = LlamaConfig

__all__ = ["CONFIG", "NAME", "activation_shape", "apply_recompute", "build_meta", "initialize_",
           "stage_costs", "tensor_parallel_problems"]
