"""Job configuration: nested dataclasses, one per component, loaded from TOML.

A recipe is a TOML file whose tables match the sections below (``[parallel]``,
``[train]``, ...). Command-line overrides use dotted keys (``--parallel.tp=2``); their
values are parsed as TOML literals, so ``--train.lr=3e-4`` is a float and
``--parallel.pp_layers=[2,2]`` a list. Unknown keys, wrong types and values outside a
fixed choice (a ``Literal`` field, ``config_choices.py``) raise
:class:`~parallel3d.errors.UserError` in one line, with a did-you-mean; a section built in
code checks its choices too. Each component receives its own section; the trainer's wiring of
data (``train/data.py``) and checkpoints (``checkpoint/checkpointer.py``) also reads the
few fields of other sections it needs (the batch shape, the run directory, the
fine-tuning source), and a checkpoint records the whole job. The reading itself (keys and
types checked against the dataclasses, overrides parsed and merged) is ``config_toml.py``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from parallel3d.config_toml import build, merge, parse_overrides, read_toml  # noqa: F401 - parse_overrides is API

from parallel3d.config_choices import (  # noqa: F401 - the choices are part of this module's API
    AutoOnOff, Backend, CpComm, DataSource, Dtype, HostMemory, LinearBackend, OnNonfinite, Packing, Recompute,
    ReduceDtype, Schedule, ZeroStage, checks_choices)


@dataclass
class ModelConfig:
    """Which model to build: a named preset, with any field overridden.

    Fields left as None take the preset's value (see ``parallel3d.models.llama.PRESETS``).
    """

    # The model family (a folder under models/ with its model and its parallelize): "llama"
    # (Llama, Mistral, Qwen2/3, and the MoE families Qwen2/3-MoE, Mixtral, OLMoE).
    family: str = "llama"
    preset: str = "debug"  # or "hf": the model is model.hf_checkpoint (required then)
    vocab_size: int | None = None
    dim: int | None = None
    n_layers: int | None = None
    n_heads: int | None = None
    n_kv_heads: int | None = None
    ffn_dim: int | None = None
    rope_theta: float | None = None
    norm_eps: float | None = None
    tie_embeddings: bool | None = None
    init_std: float | None = None
    # The longest sequence the model takes (train.seq_len at most): a preset's is its
    # pre-training context; a long-context recipe raises it (RoPE has no table to outgrow).
    max_seq_len: int | None = None
    # A Hugging Face model folder (config.json + safetensors): the model's shape comes from
    # its config.json and its weights initialize the model at any layout (fine-tuning).
    hf_checkpoint: str = ""
    # Mixture-of-Experts ([model.moe]: n_experts, top_k, ffn_dim, aux_loss_coef,
    # expert_bias, capacity_factor, dense_layers, ...; see models/moe/config.py); replaces
    # the preset's (the "debug-moe" preset has one). A Hugging Face folder brings its own.
    moe: dict = field(default_factory=dict)


@dataclass
@checks_choices
class ParallelConfig:
    """The layout: tensor x pipeline x data parallel degrees (tp innermost), and how the
    pipeline runs (see ``parallel3d/pipeline``)."""

    tp: int = 1
    pp: int = 1
    # "auto": world / (tp * pp * cp), from the world the launcher gives (elastic runs:
    # parallel3d/reliability/elastic.py)
    dp: int | Literal["auto"] = 1
    # Context parallelism: each sequence split over cp ranks (2 cp chunks, head-tail), the
    # attention of local queries over the whole sequence by an all-gather of K/V or a ring
    # of p2p steps (cp_comm); weights replicated, gradients reduced over dp x cp.
    cp: int = 1
    cp_comm: CpComm = "auto"
    # Expert parallelism: the experts of each MoE layer split over ep ranks carved from dp
    # (ep divides dp); tokens travel to their experts by all-to-all.
    ep: int = 1
    # Tensor parallelism: norms on sequence shards, all-gather before the column-parallel
    # layers, reduce-scatter after the row-parallel ones (activation memory / tp).
    sequence_parallel: bool = False
    # GEMM of the tensor-parallel layers: torch, triton, or auto (torch on CPU; on CUDA Triton
    # only for the GEMM shapes rank 0 measured at least as fast as cuBLAS).
    linear_backend: LinearBackend = "auto"
    # pipeline schedule: gpipe, 1f1b, interleaved, or the zero-bubble zb-h1 and zb-v
    # (backward split into input and weight gradients, the latter filling the bubble)
    schedule: Schedule = "1f1b"
    # chunks per pipeline rank: interleaved needs >= 2; zb-v runs exactly 2 (its V); the
    # others 1. Left unset, it is 2 under zb-v and 1 otherwise (__post_init__).
    virtual_stages: int | None = None
    pp_layers: list[int] | None = None  # layers per chunk, by hand; default: the balanced rule
    # ZeRO: 0 replicates optimizer state; 1 shards it (fp32 master weights and Adam
    # moments) over the dp ranks; 2 also shards the gradients; 3 the parameters too (each
    # module's buckets all-gathered before its forward and its backward, freed after).
    zero: ZeroStage = 0
    offload_optimizer: bool = False  # zero >= 1: master weights, moments and the Adam step on CPU
    bucket_mb: float = 25.0  # zero >= 1: fp32 gradient bucket size for reduce-scatter/all-gather
    # the dtype data-parallel gradient reductions send: fp32, or bf16 (half the bytes; each
    # contribution rounded to bf16, a relative 2^-8, summed into fp32 where the backend lets)
    reduce_dtype: ReduceDtype = "fp32"
    # zero >= 1: the all-gather of the updated parameters after the optimizer step runs
    # under the next forward, each module waiting only for the buckets it reads (false:
    # the step waits for every bucket before it ends)
    overlap_param_gather: bool = True

    def __post_init__(self) -> None:  # run by checks_choices, after the schedule was checked
        if self.virtual_stages is None:
            self.virtual_stages = 2 if self.schedule == "zb-v" else 1


@dataclass
@checks_choices
class TrainConfig:
    steps: int = 100
    seed: int = 1234
    global_batch: int = 16  # sequences per optimizer step, summed over data-parallel ranks
    micro_batch: int = 4  # sequences per rank in one forward pass
    seq_len: int = 128
    lr: float = 1e-3
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    warmup_steps: int = 10
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0  # global L2 norm; 0 disables clipping
    dtype: Dtype = "auto"  # auto: bf16 autocast on CUDA, fp32 on CPU; or fp32 / bf16
    log_interval: int = 1
    # activation recomputation: none; full (each transformer layer re-run in backward);
    # selective (keep the matmul outputs, recompute attention and element-wise ops)
    recompute: Recompute = "none"
    # Measure the job, fit the planner's terms to it and move it to a layout predicted
    # faster, inside the running processes ([autopilot], parallel3d/autopilot).
    autopilot: bool = False


@dataclass
class BlendSourceConfig:
    """One ``[[data.blend]]`` table: a dataset made by ``prepare-data`` and its share."""

    name: str = ""  # names the source in logs and per-source figures (loss/<name>)
    path: str = ""  # the prepare-data --out directory
    weight: float = 0.0  # its share of the training tokens; weights are normalised to sum 1


@dataclass
@checks_choices
class DataConfig:
    # "stdlib": the running Python's standard-library sources, tokenized with a byte-level
    # BPE trained on them (every machine has this corpus). "prepared": data.path is
    # required (fine-tuning: never fall back to the demo corpus).
    source: DataSource = "stdlib"
    max_bytes: int = 8_000_000  # how much of the corpus to read
    vocab_size: int = 2048  # BPE vocabulary trained on the corpus
    cache_dir: str = ""  # default: ~/.cache/parallel3d
    val_fraction: float = 0.02  # stdlib: share of the documents held out for validation
    # A dataset made by `parallel3d prepare-data` (its --out directory); when set, it is
    # read instead of the stdlib corpus, and source / max_bytes / vocab_size / val_fraction
    # do not apply.
    path: str = ""
    prefetch: int = 2  # steps of batches built ahead in a background thread; 0: in the step
    # How documents become windows (parallel3d/data/packing.py): "concat" (cut from the
    # stream, attention across documents), "documents" (the same windows, positions and
    # attention per document), "whole" (whole documents packed and padded, positions and
    # attention per document); "auto": "whole" for chat data, "concat" for plain text.
    packing: Packing = "auto"
    # Several prepared datasets mixed by weight ([[data.blend]] tables: name, path, weight;
    # parallel3d/data/blend.py). When set it is read instead of data.path or the stdlib corpus.
    blend: list[BlendSourceConfig] = field(default_factory=list)


@dataclass
class EvalConfig:
    interval: int = 0  # evaluate on the validation split every N steps; 0: never
    batches: int = 4  # global batches of the validation split per evaluation


@dataclass
@checks_choices
class LaunchConfig:
    nproc: int = 1  # worker processes per node when not already under torchrun
    nnodes: int = 1  # nodes of the job: the world size is nnodes * nproc
    backend: Backend = "auto"  # auto: nccl on CUDA, gloo on CPU
    threads_per_proc: int = 0  # 0: cores / local processes
    host_memory: HostMemory = "fast"  # CPU: fast, tight (resident memory follows the tensors), libc


@dataclass
class RunConfig:
    dir: str = "runs/debug"
    trace_steps: int = 0  # write the first N steps' timeline to RUN_DIR/trace.json (0: off)


@dataclass
class CheckpointConfig:
    """Sharded checkpoints: see parallel3d/checkpoint/ (format, atomic saves, resharding)."""

    interval: int = 0  # save every N optimizer steps and at the last one; 0: never
    dir: str = ""  # "": RUN_DIR/checkpoints
    keep: int = 3  # complete checkpoints kept, newest first; 0: all
    resume: str = "auto"  # auto: the latest checkpoint in dir, if any; never; or a checkpoint path
    async_save: bool = False  # copy to host memory, write in a background thread
    verify: bool = True  # check each file's sha256 when loading (sizes are always checked)
    export_hf: str = ""  # at the end, write a Hugging Face folder here (relative: under RUN_DIR); LoRA: merged
    export_peft: str = ""  # LoRA: at the end, write the adapters as a PEFT folder here (relative: under RUN_DIR)


@dataclass
@checks_choices
class ObservabilityConfig:
    progress: AutoOnOff = "auto"  # rank 0's live progress bar: auto (when stdout is a terminal), on, off
    straggler_factor: float = 1.2  # warn about a rank busier than this times the median rank
    straggler_interval: int = 10  # compare the ranks' step times every N steps (0: never)
    tensorboard: bool = False  # also log to RUN_DIR/tensorboard (needs the tensorboard package)
    wandb: bool = False  # also log to Weights & Biases (needs the wandb package)


@dataclass
@checks_choices
class ReliabilityConfig:
    """Timeouts, heartbeats, and what to do with bad numbers (``parallel3d/reliability``)."""

    # Every collective and send/receive fails after this long; the survivors report the
    # operation, the group and the rank that did not arrive, then exit.
    comm_timeout_s: float = 300.0
    heartbeat_s: float = 5.0  # how often each rank writes (step, operation) to the store
    # A non-finite loss or gradient norm: "skip" drops the update (counted, logged) and
    # goes on; "stop" saves through the checkpoint hook and exits with status 3.
    on_nonfinite: OnNonfinite = "skip"
    spike_factor: float = 3.0  # log a loss above this multiple of the recent mean (0: off)
    spike_window: int = 20  # how many recent steps make that mean
    # A thread that reports and exits when this rank made no progress for comm_timeout_s:
    # auto (on for NCCL, whose own watchdog would kill the process without a report), on, off.
    watchdog: AutoOnOff = "auto"


@dataclass
class AutopilotConfig:
    """``train.autopilot = true``: after ``skip_steps + measure_steps`` steps the job fits
    the planner's terms to its own measured steps, ranks every layout of the same world,
    global batch and micro-batch that fits, and moves when one is predicted faster by more
    than ``min_gain`` and the remaining steps pay for the move; after a move it measures
    again and moves back once when the new layout is slower than predicted by more than
    ``tolerance``. Decisions go to metrics.jsonl (``"event": "autopilot"``)."""

    measure_steps: int = 20  # steps whose medians make a measurement
    skip_steps: int = 5  # steps left out before each measurement (start-up, after a move)
    min_gain: float = 0.1  # move only for a predicted step time lower by more than this share
    memory_margin: float = 0.1  # a layout must fit in this much less than the memory budget
    tolerance: float = 0.15  # the prediction's stated error: beyond it after a move, move back
    memory_gib: float = 0.0  # memory budget of a rank; 0: the GPU's, or the host's / local ranks
    move_cost_s: float = 0.0  # what a move costs (save, regroup, reload); 0: the first build's time
    act: bool = True  # false: measure, fit and log the decision, never move
    layouts: bool = True  # rank the world's other layouts and move to the fastest
    # move layers off a pipeline stage slower per layer than the others (autopilot/balance.py),
    # judged every skip_steps + measure_steps steps on the straggler checks' per-rank rows
    rebalance: bool = True


@dataclass
class LoraConfig:
    """Low-rank adapters (``parallel3d/lora``): ``W x + (alpha / rank) B A x`` on the
    ``targets`` projections, the base weights frozen. ``rank`` 0: off (every weight trains)."""

    rank: int = 0  # r of A (r, in) and B (out, r); 0: no adapters
    alpha: float = 16.0  # the adapters' output is scaled by alpha / rank (PEFT's lora_alpha)
    dropout: float = 0.0  # the probability of zeroing an adapter input element (lora/dropout.py); 0: none
    # projections that get adapters, by their Hugging Face names (as PEFT's target_modules)
    targets: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    # other weights that stay trainable: a name part of the parameter ("norm", "embed_tokens",
    # "lm_head", "input_layernorm", ...)
    trainable: list[str] = field(default_factory=list)
    adapter: str = ""  # a PEFT adapter folder to start from (adapter_config.json + safetensors)


@dataclass
class JobConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    run: RunConfig = field(default_factory=RunConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    observability: ObservabilityConfig = field(default_factory=ObservabilityConfig)
    reliability: ReliabilityConfig = field(default_factory=ReliabilityConfig)
    autopilot: AutopilotConfig = field(default_factory=AutopilotConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# ---------------------------------------------------------------------------------------
# Loading (the generic reading: config_toml.py)


def load_config(recipe: str | Path | None = None, overrides: list[str] | dict | None = None) -> JobConfig:
    """Build a :class:`JobConfig` from a recipe file (or defaults) plus overrides."""
    data = read_toml(recipe) if recipe is not None else {}
    if overrides:
        extra = parse_overrides(overrides) if isinstance(overrides, list) else overrides
        data = merge(data, extra)
    return build(JobConfig, data, "")


def config_from_dict(data: dict[str, Any]) -> JobConfig:
    return build(JobConfig, data, "")
