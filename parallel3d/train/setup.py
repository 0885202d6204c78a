"""Resolving the model and checking the whole job before any process group exists.

Every check here is pure arithmetic on the config, so the CLI runs it in the launching
process (a bad layout fails in well under a second, before any worker starts) and every
worker runs it again (under torchrun there is no launching process of ours).
"""

from __future__ import annotations

from dataclasses import asdict

from parallel3d.config import JobConfig, ModelConfig
from parallel3d.errors import UserError
from parallel3d.models.llama import LlamaConfig, config_from_preset
from parallel3d.topology import validate_layout


def resolve_model_config(cfg: ModelConfig) -> LlamaConfig:
    overrides = {k: v for k, v in asdict(cfg).items() if k != "preset"}
    try:
        model_cfg = config_from_preset(cfg.preset, **overrides)
        model_cfg.validate()
    except ValueError as e:
        raise UserError(str(e)) from None
    return model_cfg


def _positive(name: str, value) -> None:
    if value <= 0:
        raise UserError(f"{name} must be positive, got {value}")


def check_job(cfg: JobConfig, model: LlamaConfig, world_size: int) -> None:
    """Raise :class:`UserError` naming the numbers for anything that cannot run."""
    par, train = cfg.parallel, cfg.train
    for name in ("steps", "global_batch", "micro_batch", "seq_len", "lr"):
        _positive(f"train.{name}", getattr(train, name))
    if train.grad_clip < 0:
        raise UserError(f"train.grad_clip must be >= 0 (0 disables clipping), got {train.grad_clip}")
    if train.dtype not in ("auto", "fp32", "bf16"):
        raise UserError(f"train.dtype '{train.dtype}' is not supported: use auto, fp32 or bf16")
    validate_layout(par.tp, par.pp, par.dp, world_size)
    check_parallel_options(cfg, model)
    if model.n_heads % par.tp:
        raise UserError(f"model.n_heads {model.n_heads} is not divisible by parallel.tp {par.tp}: "
                        "choose a tp that divides the number of heads")
    if model.n_kv_heads % par.tp:
        raise UserError(f"model.n_kv_heads {model.n_kv_heads} is not divisible by parallel.tp "
                        f"{par.tp}: choose a tp that divides the number of kv-heads")
    if model.n_layers < par.pp:
        raise UserError(f"model.n_layers {model.n_layers} is fewer than parallel.pp {par.pp}: "
                        "every pipeline stage needs at least one layer")
    per_step = train.micro_batch * par.dp
    if train.global_batch % per_step:
        raise UserError(
            f"train.global_batch {train.global_batch} is not divisible by train.micro_batch "
            f"{train.micro_batch} * parallel.dp {par.dp} = {per_step}")
    n_micro = train.global_batch // per_step
    if n_micro < par.pp:
        raise UserError(
            f"{n_micro} micro-batches per step (train.global_batch {train.global_batch} / "
            f"(micro_batch {train.micro_batch} * dp {par.dp})) is fewer than parallel.pp "
            f"{par.pp}: raise train.global_batch or lower train.micro_batch")
    if train.seq_len > model.max_seq_len:
        raise UserError(f"train.seq_len {train.seq_len} exceeds the model's max_seq_len {model.max_seq_len}")


def job_world_size(cfg: JobConfig) -> int:
    """The world size a recipe asks for: ``launch.nnodes * launch.nproc``."""
    for name in ("nnodes", "nproc"):
        value = getattr(cfg.launch, name)
        if value < 1:
            raise UserError(f"launch.{name} must be at least 1, got {value}")
    return cfg.launch.nnodes * cfg.launch.nproc


SCHEDULES = ("gpipe", "1f1b", "interleaved")
RECOMPUTE = ("none", "full", "selective")


def check_parallel_options(cfg: JobConfig, model: LlamaConfig) -> None:
    """The value domains of the pipeline, ZeRO and recomputation keys."""
    par = cfg.parallel
    if par.schedule not in SCHEDULES:
        raise UserError(f"parallel.schedule '{par.schedule}' is not supported: use {', '.join(SCHEDULES)}")
    if par.virtual_stages < 1:
        raise UserError(f"parallel.virtual_stages must be at least 1, got {par.virtual_stages}")
    if par.schedule == "interleaved" and par.pp > 1 and par.virtual_stages < 2:
        raise UserError("parallel.schedule 'interleaved' needs parallel.virtual_stages >= 2")
    if par.virtual_stages > 1 and par.schedule != "interleaved":
        raise UserError(f"parallel.virtual_stages {par.virtual_stages} needs parallel.schedule 'interleaved'")
    if par.virtual_stages > 1 and model.n_layers < par.pp * par.virtual_stages:
        raise UserError(f"model.n_layers {model.n_layers} is fewer than parallel.pp {par.pp} * "
                        f"parallel.virtual_stages {par.virtual_stages}: every chunk needs a layer")
    if par.pp_layers is not None and (len(par.pp_layers) != par.pp * par.virtual_stages
                                      or sum(par.pp_layers) != model.n_layers
                                      or min(par.pp_layers) < 1):
        raise UserError(f"parallel.pp_layers {par.pp_layers} must give pp*virtual_stages = "
                        f"{par.pp * par.virtual_stages} positive counts summing to model.n_layers "
                        f"{model.n_layers}")
    if par.zero not in (0, 1, 2):
        raise UserError(f"parallel.zero must be 0, 1 or 2, got {par.zero}")
    if par.offload_optimizer and par.zero == 0:
        raise UserError("parallel.offload_optimizer needs the sharded optimizer: set parallel.zero=1 or 2")
    if cfg.train.recompute not in RECOMPUTE:
        raise UserError(f"train.recompute '{cfg.train.recompute}' is not supported: use {', '.join(RECOMPUTE)}")


def refuse_unbuilt(cfg: JobConfig) -> None:
    """Refuse, before training, the keys whose implementation is not in this build.

    The tensor-parallel, pipeline and ZeRO branches each remove their lines here when they
    land, so that a key never silently does nothing."""
    par, train = cfg.parallel, cfg.train
    unbuilt = [("parallel.zero", par.zero, 0), ("parallel.offload_optimizer", par.offload_optimizer, False),
               ("parallel.sequence_parallel", par.sequence_parallel, False),
               ("train.recompute", train.recompute, "none")]
    if par.pp > 1:
        unbuilt += [("parallel.schedule", par.schedule, "1f1b"),
                    ("parallel.virtual_stages", par.virtual_stages, 1),
                    ("parallel.pp_layers", par.pp_layers, None)]
    for name, value, default in unbuilt:
        if value != default:
            raise UserError(f"{name}={value!r} is not available in this build yet: use {default!r}")
