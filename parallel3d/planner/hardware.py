"""GPUs and links the planner knows, with where each figure comes from.

Peak figures are the vendors' dense (no sparsity) bf16 tensor-core numbers: datasheets
print the 2:4-sparse figure with an asterisk, twice the dense one. Memory is the total
the driver reports for the board (``nvidia-smi``, ``rocm-smi``), a little under the
marketing figure. Link figures are per GPU and per direction: the intra-node figure is
the GPU's aggregate NVLink (Infinity Fabric, PCIe) bandwidth one way, the inter-node
figure the GPU's own network adapter (DGX-style nodes give every GPU one NIC).
``gpus_per_node`` is the usual node, i.e. the NVLink domain tensor parallelism may span.

Sources, one GPU each (``*`` = with sparsity in the datasheet, halved here):

  a100-40g, a100-80g (A100 SXM4): 312 TFLOP/s bf16, 1,555 GB/s HBM2 (40GB) / 2,039 GB/s
    HBM2e (80GB), NVLink 3 at 600 GB/s both ways (NVIDIA A100 Tensor Core GPU datasheet);
    DGX A100 has one 200 Gb/s HDR InfiniBand HCA per GPU (Narayanan et al. 2021, SC'21,
    sec. 5: "eight NVIDIA Mellanox 200Gbps HDR"). nvidia-smi totals: 40,536 MiB
    (A100-SXM4-40GB), 81,920 MiB (A100-SXM4-80GB).
  h100-80g (H100 SXM5, alias h100-sxm): 1,979* TFLOP/s bf16, 3.35 TB/s HBM3, NVLink 4 at
    900 GB/s both ways (NVIDIA H100 Tensor Core GPU datasheet); 400 Gb/s per GPU (DGX H100:
    eight single-port ConnectX-7, NVIDIA DGX BasePOD reference architecture; Llama 3
    paper, sec. 3.3.1: "400 Gbps interconnects between GPUs"). nvidia-smi: 81,559 MiB.
  h100-nvl (H100 NVL, PCIe card): 1,671* TFLOP/s bf16, 94 GB HBM3 at 3.9 TB/s; NVLink
    bridges join pairs of cards only (600 GB/s), so a node-wide ring runs over PCIe Gen5
    x16, 128 GB/s both ways (H100 datasheet, NVL column). nvidia-smi: 95,830 MiB.
  h100-pcie (H100 PCIe 80GB): 1,513* TFLOP/s bf16, 2.0 TB/s HBM2e, PCIe Gen5 x16 128 GB/s
    both ways (H100 PCIe product brief, PB-11133-001). nvidia-smi: 81,559 MiB. PCIe
    servers have no reference network: both PCIe entries assume one 400 Gb/s NIC per GPU
    like the SXM nodes (``--nodes-interconnect`` sets yours).
  h200 (H200 SXM 141GB): compute and NVLink of the H100 SXM, 4.8 TB/s HBM3e (NVIDIA H200
    datasheet); DGX H200: eight ConnectX-7 at 400 Gb/s (DGX BasePOD reference
    architecture). nvidia-smi: 143,771 MiB.
  b200 (HGX/DGX B200, 1,000 W): 4.5* PFLOP/s FP16/BF16 per GPU (NVIDIA Blackwell
    datasheet, HGX B200 column), 8 TB/s HBM3e, NVLink 5 at 1.8 TB/s both ways (DGX B200
    user guide: 2 NVSwitch chips, 14.4 TB/s for 8 GPUs; 8x ConnectX-7 up to 400 Gb/s).
    nvidia-smi: 183,359 MiB.
  gb200 (GB200 NVL72): 360* PFLOP/s FP16/BF16 for 72 GPUs = 2.5 PFLOP/s dense each,
    13.4 TB HBM3e at 576 TB/s (8 TB/s each), NVLink 5 at 130 TB/s for 72 (1.8 TB/s each)
    (NVIDIA GB200 NVL72 datasheet); one 72-GPU NVLink domain per rack; NDR 400 Gb/s
    InfiniBand compute fabric (DGX SuperPOD reference architecture, DGX GB200).
    nvidia-smi: 189,471 MiB.
  mi300x (AMD Instinct MI300X): 1,307.4 TFLOP/s bf16 dense (2,614.9 with sparsity),
    192 GB HBM3 at 5.3 TB/s, 7 Infinity Fabric links at 128 GB/s both ways each to the
    other GPUs of an 8-GPU platform: 448 GB/s one way in all (AMD Instinct MI300X data
    sheet); one 400 Gb/s NIC per GPU (AMD Instinct MI300 Series cluster reference
    architecture guide, 63916). rocm-smi: 205,822,885,888 bytes.
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
    nvlink_bytes_per_s: float  # intra-node, per GPU, one direction
    internode_bytes_per_s: float  # per GPU, one direction (its NIC)
    gpus_per_node: int = 8  # the node (NVLink domain) it usually comes in
    # Share of the board kept free beyond every estimate (the runtime reserve and the
    # fragmentation margin are estimates too): `plan` / `--dry-run` --headroom.
    headroom: float = 0.05

    def describe(self) -> str:
        return (f"{self.name}: {self.peak_flops / 1e12:,.0f} TFLOP/s bf16, {self.memory_bytes / GiB:.1f} GiB, "
                f"intra-node {self.nvlink_bytes_per_s / 1e9:,.0f} GB/s, inter-node "
                f"{self.internode_bytes_per_s * 8 / 1e9:,.0f} Gbit/s per GPU, {self.gpus_per_node} a node")


_GBIT = 1e9 / 8  # bytes/s in one Gbit/s

GPUS: dict[str, GPU] = {
    "a100-40g": GPU("a100-40g", 312e12, 40536 * MiB, 1.555e12, 300e9, 200 * _GBIT),
    "a100-80g": GPU("a100-80g", 312e12, 81920 * MiB, 2.039e12, 300e9, 200 * _GBIT),
    "h100-80g": GPU("h100-80g", 989e12, 81559 * MiB, 3.35e12, 450e9, 400 * _GBIT),
    "h100-nvl": GPU("h100-nvl", 835.5e12, 95830 * MiB, 3.9e12, 64e9, 400 * _GBIT),
    "h100-pcie": GPU("h100-pcie", 756.5e12, 81559 * MiB, 2.0e12, 64e9, 400 * _GBIT),
    "h200": GPU("h200", 989e12, 143771 * MiB, 4.8e12, 450e9, 400 * _GBIT),
    "b200": GPU("b200", 2.25e15, 183359 * MiB, 8.0e12, 900e9, 400 * _GBIT),
    "gb200": GPU("gb200", 2.5e15, 189471 * MiB, 8.0e12, 900e9, 400 * _GBIT, gpus_per_node=72),
    "mi300x": GPU("mi300x", 1307.4e12, 205_822_885_888, 5.3e12, 448e9, 400 * _GBIT),
}
ALIASES = {"h100-sxm": "h100-80g", "h100": "h100-80g", "h200-sxm": "h200", "a100": "a100-80g"}


def gpu_names() -> list[str]:
    """Every name ``--gpu`` accepts: the table's and the aliases."""
    return sorted([*GPUS, *ALIASES])


def gpu_named(name: str, internode_gbit_per_s: float | None = None) -> GPU:
    """The GPU ``name``, with its inter-node bandwidth replaced when given (Gbit/s/GPU)."""
    key = ALIASES.get(name, name)
    if key not in GPUS:
        raise UserError(f"unknown GPU '{name}': choose one of {', '.join(gpu_names())}, "
                        "or describe it with --gpu-spec")
    return with_internode(GPUS[key], internode_gbit_per_s)


def with_internode(gpu: GPU, internode_gbit_per_s: float | None) -> GPU:
    """``gpu`` with its inter-node bandwidth set to ``internode_gbit_per_s`` (when given)."""
    if internode_gbit_per_s is None:
        return gpu
    if internode_gbit_per_s <= 0:
        raise UserError(f"--nodes-interconnect must be positive (Gbit/s per GPU), got {internode_gbit_per_s}")
    return replace(gpu, internode_bytes_per_s=internode_gbit_per_s * _GBIT)


# --gpu-spec KEY=VALUE,...: the keys, their units and how each becomes a GPU field.
SPEC_KEYS = {
    "tflops": ("dense bf16 TFLOP/s", "peak_flops", 1e12),
    "memory_gib": ("GiB a GPU", "memory_bytes", GiB),
    "intra_gbyte_s": ("GB/s one way, per GPU, inside a node", "nvlink_bytes_per_s", 1e9),
    "inter_gbit_s": ("Gbit/s per GPU between nodes", "internode_bytes_per_s", _GBIT),
    "hbm_tbyte_s": ("TB/s of memory bandwidth", "hbm_bytes_per_s", 1e12),
    "gpus_per_node": ("GPUs a node", "gpus_per_node", 1),
}
SPEC_REQUIRED = ("tflops", "memory_gib", "intra_gbyte_s", "inter_gbit_s")
# Memory bandwidth only times the optimizer step (a small share of a step): when a new GPU
# does not say, the H100 SXM's is taken.
DEFAULT_HBM_BYTES_PER_S = GPUS["h100-80g"].hbm_bytes_per_s

SPEC_HELP = ("describe a GPU: name=NAME,tflops=N,memory_gib=N,intra_gbyte_s=N,inter_gbit_s=N"
             "[,hbm_tbyte_s=N][,gpus_per_node=N] (" + "; ".join(
                 f"{k}: {unit}" for k, (unit, _, _) in SPEC_KEYS.items())
             + "); with --gpu, only the keys given replace that GPU's figures")


def gpu_from_spec(spec: str, base: GPU | None = None) -> GPU:
    """A GPU from ``--gpu-spec`` (see :data:`SPEC_HELP`), over ``base`` when given."""
    fields: dict[str, object] = {}
    name = None
    for item in filter(None, (part.strip() for part in spec.split(","))):
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep:
            raise UserError(f"--gpu-spec item '{item}' is not KEY=VALUE (e.g. tflops=989,memory_gib=80)")
        if key == "name":
            name = value.strip()
            continue
        if key not in SPEC_KEYS:
            raise UserError(f"--gpu-spec key '{key}' is not known: use name, {', '.join(SPEC_KEYS)}")
        unit, field, scale = SPEC_KEYS[key]
        try:
            number = float(value)
        except ValueError:
            raise UserError(f"--gpu-spec {key}={value}: expected a number ({unit})") from None
        if not number > 0:
            raise UserError(f"--gpu-spec {key} must be positive ({unit}), got {value}")
        fields[field] = int(number * scale) if field in ("memory_bytes", "gpus_per_node") else number * scale
    if base is None:
        missing = [k for k in SPEC_REQUIRED if SPEC_KEYS[k][1] not in fields]
        if missing:
            raise UserError(f"--gpu-spec needs {', '.join(missing)} (or start from a known GPU with --gpu NAME)")
        fields.setdefault("hbm_bytes_per_s", DEFAULT_HBM_BYTES_PER_S)
        return GPU(name=name or "custom", **fields)
    return replace(base, name=name or f"{base.name}-custom", **fields)


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
    """Memory a rank's tensors may occupy: the board minus the runtime reserve and the
    headroom (``gpu.headroom`` of the board, default 5%: what no model here counts, such as
    allocator fragmentation beyond the margin, or a communicator created late)."""
    return gpu.memory_bytes - RUNTIME_RESERVE_BYTES - int(gpu.headroom * gpu.memory_bytes)


def memory_terms(gpu: GPU) -> str:
    """How :func:`usable_bytes` comes about, for the plan's and the dry run's output."""
    return (f"{usable_bytes(gpu) / GiB:.1f} GiB usable = {gpu.memory_bytes / GiB:.1f} GiB - "
            f"{RUNTIME_RESERVE_BYTES / GiB:.0f} GiB runtime reserve - {gpu.headroom:.0%} headroom "
            f"({gpu.headroom * gpu.memory_bytes / GiB:.1f} GiB, --headroom)")


def with_headroom(gpu: GPU, headroom: float | None) -> GPU:
    """``gpu`` keeping ``headroom`` (a share of its memory) free, when given."""
    if headroom is None:
        return gpu
    if not 0 <= headroom < 0.5:
        raise UserError(f"--headroom is a share of the GPU's memory in [0, 0.5), got {headroom}")
    return replace(gpu, headroom=headroom)
