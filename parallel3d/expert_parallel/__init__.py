"""Expert parallelism: the experts of each MoE layer split over an expert group, tokens
travelling to them by all-to-all."""

from .dispatch import all_to_all_rows, dispatch_experts_combine, exchange_counts

__all__ = ["all_to_all_rows", "dispatch_experts_combine", "exchange_counts"]
