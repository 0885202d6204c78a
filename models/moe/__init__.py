"""Mixture-of-Experts layers as plain PyTorch: router, routed and shared experts, balancing."""

from .block import MoEBlock, RouterStats, load_balancing_loss
from .config import MoEConfig, dense_layers_from
from .router import Router, route, update_expert_bias_

__all__ = ["MoEBlock", "MoEConfig", "Router", "RouterStats", "dense_layers_from",
           "load_balancing_loss", "route", "update_expert_bias_"]
