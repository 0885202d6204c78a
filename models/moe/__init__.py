"""Mixture-of-Experts layers as plain PyTorch: router, routed and shared experts, balancing.
The config imports no torch; the layers are imported on first use."""

from .config import MoEConfig, dense_layers_from

__all__ = ["MoEBlock", "MoEConfig", "Router", "RouterStats", "dense_layers_from",
           "load_balancing_loss", "route", "update_expert_bias_"]

_LAYERS = {"MoEBlock": "block", "RouterStats": "block", "load_balancing_loss": "block",
           "Router": "router", "route": "router", "update_expert_bias_": "router"}


def __getattr__(name: str):
    if name in _LAYERS:
        import importlib
        return getattr(importlib.import_module(f".{_LAYERS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
