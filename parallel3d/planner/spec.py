"""What the planner evaluates: a workload (model, sequence, batch, precision) and a layout.

A :class:`Layout` is everything the parallel recipe keys decide: the degrees (tp, cp, pp,
dp, and ep carved from dp), the micro-batch, the pipeline schedule, ZeRO, recomputation and sequence parallelism. It maps
one to one onto ``[parallel]`` and ``[train]`` keys (:meth:`Layout.from_config`).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from parallel3d.errors import UserError

# Bytes per element for each precision policy: ``fp32`` trains in fp32 (the CPU path);
# ``bf16`` is mixed precision: bf16 weights and activations for the matmuls, fp32 master
# weights, fp32 gradients and fp32 Adam moments (the policy of Megatron-LM and of the
# sharded optimizer's ``param_dtype=bf16``). The residual stream and RMSNorm internals
# stay fp32 in both (the model computes norms in fp32 and the embedding output is fp32).
PRECISION = {
    "fp32": {"weight": 4, "master": 0, "grad": 4, "act": 4},
    "bf16": {"weight": 2, "master": 4, "grad": 4, "act": 2},
}
RESIDUAL_BYTES = 4
ADAM_BYTES = 8  # two fp32 moments


# LoRA's projections by their Hugging Face names (parallel3d.lora.apply.TARGETS, which
# imports torch; tests/test_planner_lora.py checks the two agree)
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class LoraSpec:
    """``[lora]`` as the planner needs it (:mod:`parallel3d.planner.lora`): adapters of
    ``rank`` on the ``targets``, the weights ``trainable`` names trained whole, the rest frozen."""

    rank: int = 16
    targets: tuple[str, ...] = LORA_TARGETS
    trainable: tuple[str, ...] = ()
    dropout: float = 0.0  # > 0: one adapter's dropped input rebuilt at a time in the backward (lora/dropout.py)

    @classmethod
    def from_config(cls, lora) -> "LoraSpec | None":
        """The spec of a ``LoraConfig``; None when ``lora.rank`` is 0 (every weight trains)."""
        if not lora.rank:
            return None
        return cls(lora.rank, tuple(lora.targets), tuple(lora.trainable), lora.dropout)


@dataclass(frozen=True)
class Workload:
    model: object  # a LlamaConfig (duck-typed: dim, n_layers, n_heads, ...)
    seq_len: int
    global_batch: int  # sequences per optimizer step
    dtype: str = "bf16"
    lora: LoraSpec | None = None  # LoRA: the base frozen, only the adapters train

    def __post_init__(self):
        if self.dtype not in PRECISION:
            raise UserError(f"precision '{self.dtype}' is not modelled: use fp32 or bf16")

    @property
    def bytes(self) -> dict[str, int]:
        return PRECISION[self.dtype]

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.seq_len


def bucket_mb_for(replicas: int) -> float:
    """The bucket the planner writes for ``replicas`` data-parallel ranks (MiB of fp32):
    Megatron-Core's default, ``max(40M, 1M x dp)`` parameters a bucket, "larger DP sizes
    need larger buckets to ensure collectives do not become latency-bound"
    (``DistributedDataParallelConfig.bucket_size``); rounded to whole MiB."""
    return float(round(4 * max(40_000_000, 1_000_000 * replicas) / 2**20))


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    pp: int = 1
    dp: int = 1
    micro_batch: int = 1
    schedule: str = "1f1b"  # gpipe, 1f1b, interleaved, zb-h1, zb-v (ignored when pp == 1)
    virtual_stages: int = 1
    zero: int = 0
    recompute: str = "none"
    sequence_parallel: bool = False
    cp: int = 1  # context parallelism: sequences split over cp ranks (weights replicated)
    ep: int = 1  # expert parallelism, carved from dp
    cp_comm: str = "auto"  # allgather, ring, or auto (context_parallel.cost.choose_comm)
    reduce_dtype: str = "fp32"  # what gradient reductions send: fp32 or bf16 (parallel.reduce_dtype)
    # ZeRO 1/2: the post-step all-gather runs under the next forward (parallel.overlap_param_gather)
    overlap_param_gather: bool = True
    # fp32 bytes of a gradient bucket, each its own collective (parallel.bucket_mb); ZeRO 3
    # gathers the parameters in the same buckets (a bucket as large as a layer: FSDP's units)
    bucket_mb: float = 25.0

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    @property
    def replicas(self) -> int:
        """Ranks holding the same weights: gradients reduce and ZeRO shards over dp x cp."""
        return self.dp * self.cp

    @property
    def expert_replicas(self) -> int:
        """Ranks holding the same routed experts: ZeRO shards them over edp x cp (dp / ep x cp)."""
        return self.dp // self.ep * self.cp

    def cp_mode(self, model) -> str:
        """The context-parallel comm the trainer runs: ``cp_comm`` with "auto" resolved
        as ``apply_context_parallel`` resolves it."""
        from parallel3d.context_parallel.cost import choose_comm

        return choose_comm(self.cp_comm, model.n_heads, model.n_kv_heads)

    @property
    def chunks(self) -> int:
        return self.pp * self.virtual_stages

    def n_micro(self, work: Workload) -> int:
        """Micro-batches per step on each data-parallel rank."""
        return work.global_batch // (self.micro_batch * self.dp)

    def describe(self) -> str:
        cp = f" cp{self.cp}" + (f"-{self.cp_comm}" if self.cp_comm != "auto" else "") if self.cp > 1 else ""
        ep = f" ep{self.ep}" if self.ep > 1 else ""
        parts = [f"tp{self.tp}{cp} pp{self.pp} dp{self.dp}{ep}", f"mb{self.micro_batch}"]
        if self.pp > 1:
            parts.append(self.schedule + (f"x{self.virtual_stages}" if self.virtual_stages > 1 else ""))
        parts.append(f"zero{self.zero}")
        if self.reduce_dtype != "fp32":
            parts.append(f"{self.reduce_dtype}-reduce")
        if not self.overlap_param_gather and self.zero in (1, 2):
            parts.append("gather-after-step")
        if self.bucket_mb != bucket_mb_for(self.replicas) and self.replicas > 1:
            parts.append(f"bucket{self.bucket_mb:g}MB")
        parts.append(f"rc-{self.recompute}")
        if self.sequence_parallel:
            parts.append("sp")
        return " ".join(parts)

    @classmethod
    def from_config(cls, cfg) -> "Layout":
        """The layout of a :class:`~parallel3d.config.JobConfig`."""
        par = cfg.parallel
        return cls(tp=par.tp, pp=par.pp, dp=par.dp, micro_batch=cfg.train.micro_batch,
                   schedule=par.schedule, virtual_stages=par.virtual_stages, zero=par.zero,
                   recompute=cfg.train.recompute, sequence_parallel=par.sequence_parallel,
                   cp=par.cp, ep=par.ep,
                   cp_comm=par.cp_comm if par.cp > 1 else "auto",  # no comm at cp 1: one layout
                   reduce_dtype=par.reduce_dtype,
                   overlap_param_gather=getattr(par, "overlap_param_gather", True), bucket_mb=par.bucket_mb)


def kv_width(model, tp: int) -> int:
    """K (or V) elements per token on one tensor-parallel rank: its kv-heads, at least one
    (kv-heads are replicated when tp exceeds their number)."""
    return max(1, model.n_kv_heads // tp) * model.head_dim


def layer_split(model, pp: int, virtual_stages: int, pp_layers: list[int] | None = None,
                schedule: str = "1f1b") -> list[int]:
    """Layers per global pipeline chunk: the pipeline's own rule
    (:func:`parallel3d.pipeline.partition.resolve_split`, weighing the output head by its
    GEMM cost; zb-v's ranks balanced), so the planner and the dry run predict the split
    training will use."""
    return list(_layer_split(model, pp, virtual_stages, tuple(pp_layers) if pp_layers else None, schedule))


@lru_cache(maxsize=None)
def _layer_split(model, pp: int, virtual_stages: int, pp_layers: tuple[int, ...] | None,
                 schedule: str) -> tuple[int, ...]:
    # The search asks for the same (model, pp, v) split for every micro-batch size,
    # schedule, ZeRO stage and recompute setting; the rule's exact arithmetic is slow.
    from parallel3d.models import family_of
    from parallel3d.pipeline.partition import resolve_split

    return tuple(resolve_split(model.n_layers, pp, virtual_stages,
                               list(pp_layers) if pp_layers else None, *family_of(model).stage_costs(model),
                               schedule=schedule))


def rank_chunks(pp_rank: int, pp: int, virtual_stages: int, schedule: str = "1f1b") -> list[int]:
    """Global chunks held by pipeline rank ``pp_rank`` under ``schedule``: ``pp_rank + j * pp``,
    or zb-v's ``pp_rank, 2 pp - 1 - pp_rank`` (``parallel3d.pipeline.partition``)."""
    return list(_rank_chunks(pp_rank, pp, virtual_stages, schedule))


@lru_cache(maxsize=4096)  # asked for every stage of every layout the search evaluates
def _rank_chunks(pp_rank: int, pp: int, virtual_stages: int, schedule: str) -> tuple[int, ...]:
    from parallel3d.pipeline.partition import rank_chunks as placed

    return tuple(placed(pp_rank, pp, virtual_stages, schedule))
