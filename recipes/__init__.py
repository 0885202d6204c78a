"""Shipped TOML recipes (installed as ``parallel3d.recipes`` so the CLI finds them)."""
