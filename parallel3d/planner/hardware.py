"""GPUs and links the planner knows, with where each figure comes from.

Peak figures are the vendors' dense (no sparsity) bf16 tensor-core numbers. Memory is
what ``nvidia-smi`` reports as total for the board. Link figures are per GPU and per
direction: NVLink is the GPU's aggregate NVLink bandwidth one way, the inter-node figure
is the GPU's own network adapter (DGX-style nodes give every GPU one NIC).

Sources:
  A100 SXM 80GB: 312 TFLOP/s bf16, 2,039 GB/s HBM2e, NVLink 3 at 600 GB/s both ways
    (NVIDIA A100 datasheet); DGX A100 has one 200 Gb/s HDR InfiniBand HCA per GPU
    (Narayanan et al. 2021, SC'21, sec. 5: "eight NVIDIA Mellanox 200Gbps HDR").
  H100 SXM 80GB: 989 TFLOP/s bf16 dense, 3.35 TB/s HBM3, NVLink 4 at 900 GB/s both ways
    (NVIDIA H100 datasheet); 400 Gb/s per GPU (DGX H100 ConnectX-7; Llama 3 paper,
    sec. 3.3.1: "400 Gbps interconnects between GPUs").
  H200 SXM 141GB: same compute and NVLink as H100, 4.8 TB/s HBM3e (NVIDIA H200 datasheet).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from parallel3d.errors import UserError

MiB = 2**20
GiB = 2**30


@dataclass(frozen=True)
class GPU:
    name: str
    peak_flops: float  # dense bf16 FLOP/s
    memory_bytes: int  # total board memory
    hbm_bytes_per_s: float
    nvlink_bytes_per_s: float  # per GPU, one direction
    internode_bytes_per_s: float  # per GPU, one direction (its NIC)


GPUS: dict[str, GPU] = {
    "a100-80g": GPU("a100-80g", 312e12, 81920 * MiB, 2.039e12, 300e9, 200e9 / 8),
    "h100-80g": GPU("h100-80g", 989e12, 81559 * MiB, 3.35e12, 450e9, 400e9 / 8),
    "h200": GPU("h200", 989e12, 143771 * MiB, 4.8e12, 450e9, 400e9 / 8),
}


def gpu_named(name: str, internode_gbit_per_s: float | None = None) -> GPU:
    """The GPU ``name``, with its inter-node bandwidth replaced when given (Gbit/s/GPU)."""
    if name not in GPUS:
        raise UserError(f"unknown GPU '{name}': choose one of {', '.join(GPUS)}")
    gpu = GPUS[name]
    if internode_gbit_per_s is not None:
        if internode_gbit_per_s <= 0:
            raise UserError(f"--nodes-interconnect must be positive (Gbit/s per GPU), got {internode_gbit_per_s}")
        gpu = replace(gpu, internode_bytes_per_s=internode_gbit_per_s * 1e9 / 8)
    return gpu


@dataclass(frozen=True)
class Efficiency:
    """What fraction of the hardware's peaks a training step achieves (the calibration).

    ``compute``: achieved over peak FLOP/s while the GPU computes a transformer layer
    (GEMMs, attention, element-wise kernels together), counted in hardware FLOPs
    (:mod:`parallel3d.flops`). The default is not fitted to the configurations the planner
    is tested against: :mod:`parallel3d.planner.published` derives it by inverting this
    time model on one anchor run (Narayanan et al. 2021, Table 1, the 18.4B row), and
    ``parallel3d plan --calibrate RUN/metrics.jsonl`` replaces it with a run's own figure.

    ``link``: achieved bus bandwidth over link peak for large ring collectives. 0.8 is the
    ratio NCCL's ring all-reduce typically reaches in ``nccl-tests`` on NVLink and on
    InfiniBand (bus bandwidth about 80% of the wire); ``latency_s`` is one ring step.
    """

    compute: float  # see calibrate.default_efficiency() for the default
    link: float = 0.80
    nvlink_latency_s: float = 5e-6
    internode_latency_s: float = 10e-6
    # HBM-bound optimizer step: fraction of HBM bandwidth its element-wise kernels reach.
    memory: float = 0.70


# GPU memory the caching allocator cannot use: the CUDA context, cuBLAS/cuDNN workspaces
# and NCCL's buffers (each communicator holds a few hundred MiB). An estimate.
RUNTIME_RESERVE_BYTES = 2 * GiB
# Fragmentation: the caching allocator reserves more than it hands out; 10% is the usual
# reserved/allocated gap seen in training runs. An estimate, stated in every table.
FRAGMENTATION = 0.10


def usable_bytes(gpu: GPU) -> int:
    """Memory a rank's tensors may occupy: the board minus the runtime reserve."""
    return gpu.memory_bytes - RUNTIME_RESERVE_BYTES
