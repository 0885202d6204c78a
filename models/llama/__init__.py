"""Llama-family decoder: plain model, presets and Hugging Face adapters. The config and the
presets import no torch; ``Llama`` (the model) is imported on first use."""

from .config import PRESETS, LlamaConfig, config_from_preset

__all__ = ["Llama", "LlamaConfig", "PRESETS", "config_from_preset"]


def __getattr__(name: str):
    if name == "Llama":
        from .model import Llama
        return Llama
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
