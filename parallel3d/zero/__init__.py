"""ZeRO-style sharding of optimizer state (stage 1) and gradients (stage 2) over the
data-parallel group, and memory accounting."""

from .memory import AllocationMeter, memory_report
from .optimizer import ZeroOptimizer

__all__ = ["AllocationMeter", "ZeroOptimizer", "memory_report"]
