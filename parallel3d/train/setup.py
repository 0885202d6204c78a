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
from parallel3d.models.llama.parallelize import check_tensor_parallel
from parallel3d.topology import validate_layout


def resolve_model_config(cfg: ModelConfig) -> LlamaConfig:
    if cfg.hf_checkpoint:
        return _model_config_from_hf(cfg)
    overrides = {k: v for k, v in asdict(cfg).items() if k != "preset"}
    try:
        model_cfg = config_from_preset(cfg.preset, **overrides)
        model_cfg.validate()
    except ValueError as e:
        raise UserError(str(e)) from None
    return model_cfg


def _model_config_from_hf(cfg: ModelConfig) -> LlamaConfig:
    """The shape comes from the folder's config.json; a model.* field set as well must agree
    (init_std excepted: the weights come from the folder)."""
    from dataclasses import replace
    from pathlib import Path

    from parallel3d.checkpoint.hf import model_config_from_folder

    folder = Path(cfg.hf_checkpoint)
    if not folder.is_dir():
        raise UserError(f"model.hf_checkpoint '{folder}' is not a folder: give a Hugging Face "
                        "model folder (config.json + safetensors)")
    model_cfg = model_config_from_folder(folder)
    for key, value in asdict(cfg).items():
        if key in ("preset", "hf_checkpoint", "init_std") or value is None:
            continue
        if getattr(model_cfg, key) != value:
            raise UserError(f"model.{key} = {value!r} disagrees with model.hf_checkpoint's config.json "
                            f"({getattr(model_cfg, key)!r}): drop model.{key}")
    if cfg.init_std is not None:
        model_cfg = replace(model_cfg, init_std=cfg.init_std)
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
    check_tensor_parallel(model, par.tp)  # heads, kv-heads, MLP width vs tp
    if par.sequence_parallel and train.seq_len % par.tp:
        raise UserError(f"train.seq_len {train.seq_len} is not divisible by parallel.tp {par.tp}, "
                        "which parallel.sequence_parallel needs: change one or turn it off")
    if par.linear_backend not in ("auto", "triton", "torch"):
        raise UserError(f"parallel.linear_backend '{par.linear_backend}' is not supported: "
                        "use auto, triton or torch")
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
