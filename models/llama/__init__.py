"""Llama-family decoder: plain model, presets and Hugging Face adapters."""

from .model import PRESETS, Llama, LlamaConfig, config_from_preset

__all__ = ["Llama", "LlamaConfig", "PRESETS", "config_from_preset"]
