"""ZeRO-style sharding of optimizer state (stage 1), gradients (stage 2) and parameters
(stage 3) over the data-parallel group, and memory accounting."""

from .memory import AllocationMeter, memory_report
from .optimizer import ZeroOptimizer

__all__ = ["AllocationMeter", "ZeroOptimizer", "memory_report"]
