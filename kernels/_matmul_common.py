"""Tile configurations for the Triton GEMM kernels, and how ranks agree on them.

A kernel launch is described by a `TileConfig` (block sizes, L2 grouping, warps,
pipeline stages). Which config a launch uses is looked up by the key
``(kind, dtype, M, N, K)``, where ``kind`` names the GEMM ("fwd", "dgrad", "wgrad"),
because the three GEMMs of a linear layer read their operands in different layouts.

Lookup order: the process-local table of tuned configs, else a deterministic heuristic
of the shape alone. Nothing here benchmarks behind the caller's back: tuning happens
only when `autotune` is called, and it never runs on CPU tensors (the Triton
interpreter's timings mean nothing). Ranks that tuned independently could pick
different tiles and so sum in different orders; to prevent that, tune on one rank and
ship `tuned_configs()` (a JSON-serialisable dict) to the others, which call
`load_tuned_configs`. This module never imports torch.distributed.

The same goes for the choice between the Triton GEMM and torch's (cuBLAS) under
``backend="auto"``: `record_backend_choice` stores, per GPU model and GEMM
(``kind, dtype, M, N, K``), which of the two was measured faster (Triton only if at least
as fast); `prefers_triton` answers from that table and says False for anything not in
it, so an unmeasured shape never runs Triton. `backend_choices` / `load_backend_choices`
ship the table between ranks exactly like the tile table.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable

import torch

KERNEL_KINDS = ("fwd", "dgrad", "wgrad")
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


@dataclasses.dataclass(frozen=True)
class TileConfig:
    """One launch configuration of a tiled GEMM C[M, N] = A[M, K] B[K, N]."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int  # rows of output tiles swept together so the B panel stays in L2
    num_warps: int
    num_stages: int  # software-pipeline depth of the K loop (shared-memory buffers)

    def __post_init__(self):
        for field in ("block_m", "block_n", "block_k"):
            value = getattr(self, field)
            # tl.dot needs every tile dimension to be a power of two of at least 16.
            if not (isinstance(value, int) and value >= 16 and value & (value - 1) == 0):
                raise ValueError(f"TileConfig.{field}={value!r}: use a power of two >= 16")
        for field in ("group_m", "num_warps", "num_stages"):
            value = getattr(self, field)
            if not (isinstance(value, int) and value >= 1):
                raise ValueError(f"TileConfig.{field}={value!r}: use a positive integer")

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, entry: dict) -> "TileConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        if not isinstance(entry, dict) or set(entry) != names:
            raise ValueError(f"tile config {entry!r}: expected exactly the keys {sorted(names)}")
        return cls(**entry)


# Hopper (sm_90) candidates for 16-bit inputs; 8 warps = two warpgroups, the natural
# split of a 128-row wgmma tile. Compiled offline for sm_90a (bench_linear.py
# --compile-sm90): all pipeline onto async copies + wgmma and fit the 227 KiB of shared
# memory. Without fused extras none spills; with them (bias, bias-grad row sum, main-grad
# read) 128x256x64/w8 spills (248 bytes in the wgrad+db+main_grad variant, triton 3.9)
# while 128x128x64/w8 spills in no variant, which is why the heuristic falls back to it.
HOPPER_16BIT = (
    TileConfig(128, 256, 64, 8, 8, 3),
    TileConfig(256, 128, 64, 8, 8, 3),
    TileConfig(128, 128, 64, 8, 8, 4),
    TileConfig(128, 128, 64, 8, 4, 4),
    TileConfig(64, 256, 64, 8, 4, 4),
    TileConfig(128, 64, 64, 8, 4, 4),
    TileConfig(64, 128, 64, 8, 4, 4),
)
# fp32 runs with input_precision="ieee" (no TF32) on CUDA cores: 4-byte elements, so
# shallower K blocks; 128x128x32/w8 is the one that spills in no variant.
HOPPER_FP32 = (
    TileConfig(64, 64, 32, 8, 4, 3),
    TileConfig(128, 64, 32, 8, 4, 3),
    TileConfig(64, 128, 32, 8, 4, 3),
    TileConfig(128, 128, 32, 8, 8, 3),
)

_TUNED: dict[str, TileConfig] = {}  # process-local cache, filled by autotune/load
_CHOICES: dict[str, str] = {}  # "GPU name|kind:dtype:MxNxK" -> "triton" or "torch"
BACKEND_NAMES = ("triton", "torch")


def config_key(kind: str, dtype: torch.dtype, m: int, n: int, k: int) -> str:
    """The table key of one GEMM, e.g. ``"wgrad:bfloat16:4096x8192x8192"`` (M x N x K)."""
    if kind not in KERNEL_KINDS:
        raise ValueError(f"kernel kind {kind!r}: expected one of {KERNEL_KINDS}")
    if dtype not in _DTYPE_NAMES:
        raise ValueError(f"dtype {dtype}: expected one of {list(_DTYPE_NAMES)}")
    return f"{kind}:{_DTYPE_NAMES[dtype]}:{m}x{n}x{k}"


def candidate_configs(dtype: torch.dtype) -> tuple[TileConfig, ...]:
    return HOPPER_FP32 if dtype == torch.float32 else HOPPER_16BIT


def _pow2_clamp(size: int, lo: int, hi: int) -> int:
    return max(lo, min(hi, 1 << max(0, math.ceil(math.log2(max(size, 1))))))


def heuristic_config(dtype: torch.dtype, m: int, n: int, k: int, *, interpreted: bool,
                     fused_extras: bool = False) -> TileConfig:
    """A config computed from the shape alone, so every rank derives the same one.

    ``fused_extras``: the launch also adds a bias, sums rows (the bias gradient) or reads
    the fp32 main grad; these need registers.
    Under the Triton interpreter the cost is per program and per K step, not per flop,
    so use the biggest tiles the shape allows (capped at 64 to bound numpy temporaries).
    """
    if interpreted:
        return TileConfig(_pow2_clamp(m, 16, 64), _pow2_clamp(n, 16, 64), _pow2_clamp(k, 16, 64), 8, 4, 1)
    if dtype == torch.float32:
        return HOPPER_FP32[0] if m <= 64 else HOPPER_FP32[3]
    if m <= 64:  # few rows: a 128-row tile would mostly multiply padding
        return TileConfig(64, 128, 64, 8, 4, 4)
    # 128x256 tiles halve B-panel traffic, but only pay once there are enough tiles to
    # fill the 132 SMs of an H100/H200 about twice over; they spill with fused extras.
    if not fused_extras and math.ceil(m / 128) * math.ceil(n / 256) >= 264:
        return TileConfig(128, 256, 64, 8, 8, 3)
    return TileConfig(128, 128, 64, 8, 8, 4)


def select_config(kind: str, dtype: torch.dtype, m: int, n: int, k: int, *, interpreted: bool,
                  fused_extras: bool = False) -> TileConfig:
    """The tuned config for this GEMM if one is loaded, else the heuristic."""
    tuned = _TUNED.get(config_key(kind, dtype, m, n, k))
    if tuned is not None:
        return tuned
    return heuristic_config(dtype, m, n, k, interpreted=interpreted, fused_extras=fused_extras)


def tuned_configs() -> dict:
    """All tuned choices of this process as ``{key: {field: int}}`` (JSON-serialisable)."""
    return {key: _TUNED[key].as_dict() for key in sorted(_TUNED)}


def load_tuned_configs(table: dict, *, replace: bool = True) -> None:
    """Adopt another rank's `tuned_configs()`; with ``replace`` drop local entries first.

    The whole table is validated before anything changes, so a bad entry leaves the
    current table intact.
    """
    if not isinstance(table, dict):
        raise ValueError(f"load_tuned_configs expects a dict from tuned_configs(), got {type(table).__name__}")
    parsed = {}
    for key, entry in table.items():
        parts = key.split(":") if isinstance(key, str) else []
        dims = parts[2].split("x") if len(parts) == 3 else []
        if (len(parts) != 3 or parts[0] not in KERNEL_KINDS or parts[1] not in _DTYPE_NAMES.values()
                or len(dims) != 3 or not all(d.isdigit() for d in dims)):
            raise ValueError(f"tuned-config key {key!r}: expected 'kind:dtype:MxNxK' as made by config_key")
        parsed[key] = TileConfig.from_dict(entry)
    if replace:
        _TUNED.clear()
    _TUNED.update(parsed)


def clear_tuned_configs() -> None:
    _TUNED.clear()


def autotune(kind: str, dtype: torch.dtype, m: int, n: int, k: int,
             launch: Callable[[TileConfig], object], device: torch.device) -> TileConfig:
    """Time ``launch(config)`` for every candidate on a CUDA device, record and return the
    fastest. On any other device return the heuristic and record nothing."""
    if device.type != "cuda":
        return heuristic_config(dtype, m, n, k, interpreted=True)
    import triton.testing  # deferred: only needed on a GPU
    from triton.runtime.errors import OutOfResources

    timings = {}
    for config in candidate_configs(dtype):
        try:
            timings[config] = triton.testing.do_bench(lambda: launch(config), warmup=10, rep=50)
        except OutOfResources:  # e.g. too much shared memory for this epilogue/prologue
            continue
    if not timings:
        raise RuntimeError(f"no candidate config compiled for {config_key(kind, dtype, m, n, k)}")
    best = min(timings, key=timings.get)
    _TUNED[config_key(kind, dtype, m, n, k)] = best
    return best


# -------------------------------------------------------- Triton or torch, per GEMM
def choice_key(device_name: str, kind: str, dtype: torch.dtype, m: int, n: int, k: int) -> str:
    """The backend-table key, e.g. ``"NVIDIA H200|fwd:bfloat16:8192x1536x4096"``."""
    if not device_name or "|" in device_name:
        raise ValueError(f"device name {device_name!r}: expected a non-empty name without '|'")
    return f"{device_name}|{config_key(kind, dtype, m, n, k)}"


def record_backend_choice(device_name: str, kind: str, dtype: torch.dtype, m: int, n: int, k: int,
                          triton_s: float, torch_s: float) -> str:
    """Store the faster backend of one measured GEMM (Triton when at least as fast); return it."""
    if not (triton_s > 0 and torch_s > 0):
        raise ValueError(f"GEMM timings must be positive seconds, got triton {triton_s!r}, torch {torch_s!r}")
    best = "triton" if triton_s <= torch_s else "torch"
    _CHOICES[choice_key(device_name, kind, dtype, m, n, k)] = best
    return best


def prefers_triton(device_name: str, kind: str, dtype: torch.dtype, m: int, n: int, k: int) -> bool:
    """True only if this GEMM on this GPU model was measured and Triton won."""
    return _CHOICES.get(choice_key(device_name, kind, dtype, m, n, k)) == "triton"


def backend_choices() -> dict:
    """The measured choices of this process, ``{key: "triton" | "torch"}`` (JSON-serialisable)."""
    return {key: _CHOICES[key] for key in sorted(_CHOICES)}


def load_backend_choices(table: dict, *, replace: bool = True) -> None:
    """Adopt another rank's `backend_choices()`; validated whole before anything changes."""
    if not isinstance(table, dict):
        raise ValueError(f"load_backend_choices expects a dict from backend_choices(), got {type(table).__name__}")
    for key, value in table.items():
        name, _, gemm = key.partition("|") if isinstance(key, str) else ("", "", "")
        parts = gemm.split(":")
        dims = parts[2].split("x") if len(parts) == 3 else []
        if (not name or len(parts) != 3 or parts[0] not in KERNEL_KINDS or parts[1] not in _DTYPE_NAMES.values()
                or len(dims) != 3 or not all(d.isdigit() for d in dims) or value not in BACKEND_NAMES):
            raise ValueError(f"backend choice {key!r}: {value!r}: expected 'GPU|kind:dtype:MxNxK': "
                             f"'triton' or 'torch' as made by record_backend_choice")
    if replace:
        _CHOICES.clear()
    _CHOICES.update(table)


def clear_backend_choices() -> None:
    _CHOICES.clear()
