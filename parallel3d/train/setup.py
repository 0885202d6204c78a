"""Resolving the model and checking the whole job before any process group exists.

Every check here is pure arithmetic on the config, so the CLI runs it in the launching
process (a bad layout fails in well under a second, before any worker starts) and every
worker runs it again (under torchrun there is no launching process of ours).
"""

from __future__ import annotations

import os
from pathlib import Path

from parallel3d.config import DataConfig, JobConfig
from parallel3d.errors import UserError
from parallel3d.model_config import resolve_model_config  # noqa: F401 - re-exported
from parallel3d.lora.apply import lora_problems
from parallel3d.models import model_family
from parallel3d.observe.sinks import check_observability
from parallel3d.pipeline.partition import check_split
from parallel3d.topology import layout_problems


def _positive(name: str, value) -> None:
    if value <= 0:
        raise UserError(f"{name} must be positive, got {value}")


def check_job(cfg: JobConfig, model, world_size: int) -> None:
    """Raise :class:`UserError` naming the numbers for anything that cannot run."""
    check_data_source(cfg)  # first: a missing input matters more than any size
    par, train = cfg.parallel, cfg.train
    for name in ("steps", "global_batch", "micro_batch", "seq_len", "lr"):
        _positive(f"train.{name}", getattr(train, name))
    if train.grad_clip < 0:
        raise UserError(f"train.grad_clip must be >= 0 (0 disables clipping), got {train.grad_clip}")
    # the layout's problems and the model's split over tp, all named in one message
    problems = layout_problems(par.tp, par.pp, par.dp, world_size, par.cp, par.ep)
    if isinstance(par.tp, int) and par.tp >= 1:
        problems += model_family(cfg.model.family).tensor_parallel_problems(model, par.tp)  # heads, kv-heads, MLP width vs tp
    if problems:
        raise UserError("; ".join(problems))
    check_new_axes(par, model)
    lora = lora_problems(cfg)  # the run's own check, before the dry run's figures
    if lora:
        raise UserError("; ".join(lora))
    check_observability(cfg.observability)
    check_memory_options(cfg)
    check_zero3(cfg)
    check_context_parallel(par, train.seq_len)
    if par.sequence_parallel and (train.seq_len // par.cp) % par.tp:
        tokens = (f"train.seq_len {train.seq_len}" if par.cp == 1 else
                  f"train.seq_len {train.seq_len} / parallel.cp {par.cp} = {train.seq_len // par.cp} tokens a rank")
        raise UserError(f"{tokens} is not divisible by parallel.tp {par.tp}, which "
                        "parallel.sequence_parallel needs: change one or turn it off")
    if model.n_layers < par.pp:
        raise UserError(f"model.n_layers {model.n_layers} is fewer than parallel.pp {par.pp}: "
                        "every pipeline stage needs at least one layer")
    if par.virtual_stages < 1:
        raise UserError(f"parallel.virtual_stages must be >= 1, got {par.virtual_stages}")
    check_split(model.n_layers, par.pp, par.virtual_stages, par.pp_layers)
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
    check_pipeline(cfg, n_micro)
    if cfg.run.trace_steps < 0:
        raise UserError(f"run.trace_steps must be >= 0 (0: no trace), got {cfg.run.trace_steps}")
    for name, value, least in (("eval.interval", cfg.eval.interval, 0), ("eval.batches", cfg.eval.batches, 1),
                               ("data.prefetch", cfg.data.prefetch, 0)):
        if value < least:
            raise UserError(f"{name} must be at least {least}, got {value}")
    if train.seq_len > model.max_seq_len:
        where = "model.hf_checkpoint's config.json" if cfg.model.hf_checkpoint else "model.max_seq_len"
        raise UserError(f"train.seq_len {train.seq_len} exceeds the model's context of {model.max_seq_len} "
                        f"tokens ({where}): set --train.seq_len={model.max_seq_len}")
    check_reliability(cfg)
    check_autopilot(cfg)


def check_autopilot(cfg: JobConfig) -> None:
    ap = cfg.autopilot
    if ap.measure_steps < 1 or ap.skip_steps < 0:
        raise UserError(f"autopilot.measure_steps must be >= 1 and autopilot.skip_steps >= 0, got "
                        f"{ap.measure_steps} and {ap.skip_steps}")
    for name in ("min_gain", "memory_margin"):
        value = getattr(ap, name)
        if not 0 <= value < 1:
            raise UserError(f"autopilot.{name} is a share in [0, 1), got {value}")
    if ap.tolerance <= 0 or ap.memory_gib < 0 or ap.move_cost_s < 0:
        raise UserError(f"autopilot.tolerance must be > 0, autopilot.memory_gib and autopilot.move_cost_s >= 0 "
                        f"(0: the device's memory, the estimated cost), got {ap.tolerance}, {ap.memory_gib} "
                        f"and {ap.move_cost_s}")


def check_data_source(cfg: JobConfig) -> None:
    """``data.source``: "stdlib" (the demo corpus, unless data.path is set) or "prepared"
    (data.path is required: a fine-tuning run must not fall back to the demo corpus, whose
    ids mean nothing to a pretrained model)."""
    data = cfg.data
    if data.source == "prepared" and not data.path and not data.blend:
        tokenizer = cfg.model.hf_checkpoint or "MODEL_DIR"
        raise UserError(f"data.source 'prepared' needs data.path: make a dataset with `parallel3d "
                        f"prepare-data INPUTS --tokenizer {tokenizer} --out DATA_DIR` and pass "
                        "--data.path=DATA_DIR")
    default = DataConfig.val_fraction
    if (data.path or data.blend) and data.val_fraction != default:
        raise UserError(f"data.val_fraction {data.val_fraction} does not apply to a prepared dataset "
                        f"(data.path '{data.path}'), whose validation split prepare-data fixed: drop "
                        f"data.val_fraction, or prepare the data again with --val-fraction {data.val_fraction}")


def check_reliability(cfg: JobConfig) -> None:
    rel = cfg.reliability
    _positive("reliability.comm_timeout_s", rel.comm_timeout_s)
    _positive("reliability.heartbeat_s", rel.heartbeat_s)
    _positive("reliability.spike_window", rel.spike_window)
    if rel.spike_factor < 0 or 0 < rel.spike_factor <= 1:
        raise UserError(f"reliability.spike_factor must be above 1 (or 0 to turn the check "
                        f"off), got {rel.spike_factor}")


def check_pipeline(cfg: JobConfig, n_micro: int) -> None:
    """What the schedule needs of the stages and micro-batches."""
    par = cfg.parallel
    if par.schedule == "interleaved" and (par.pp < 2 or par.virtual_stages < 2):
        raise UserError(f"parallel.schedule 'interleaved' needs parallel.pp >= 2 and parallel.virtual_stages "
                        f">= 2, got pp {par.pp} and virtual_stages {par.virtual_stages}: change them or "
                        "use schedule '1f1b'")
    if par.schedule == "zb-v" and par.virtual_stages != 2:
        raise UserError(f"parallel.schedule 'zb-v' runs two chunks per pipeline rank (its V), got "
                        f"parallel.virtual_stages {par.virtual_stages}: leave virtual_stages out (zb-v sets 2)")
    if par.schedule == "zb-v" and par.pp < 2:
        raise UserError(f"parallel.schedule 'zb-v' needs parallel.pp >= 2, got pp {par.pp}: raise "
                        "parallel.pp or use schedule '1f1b'")
    if par.schedule not in ("interleaved", "zb-v") and par.virtual_stages != 1:
        raise UserError(f"parallel.virtual_stages {par.virtual_stages} needs parallel.schedule "
                        f"'interleaved' or 'zb-v' (schedule '{par.schedule}' runs one chunk per stage)")
    if par.schedule == "zb-h1" and par.pp < 2:
        raise UserError("parallel.schedule 'zb-h1' needs parallel.pp >= 2 (with one stage there is "
                        "no bubble to fill): raise parallel.pp or use schedule '1f1b'")
    if par.schedule == "interleaved" and n_micro % par.pp:
        raise UserError(f"the interleaved schedule needs the micro-batches per step ({n_micro} = "
                        f"train.global_batch {cfg.train.global_batch} / (micro_batch "
                        f"{cfg.train.micro_batch} * dp {par.dp})) to be a multiple of "
                        f"parallel.pp {par.pp}: change train.global_batch or train.micro_batch")


def check_memory_options(cfg: JobConfig) -> None:
    """ZeRO and optimizer offload settings."""
    par = cfg.parallel
    if par.offload_optimizer and par.zero == 0:
        raise UserError("parallel.offload_optimizer needs the sharded optimizer: "
                        "set parallel.zero=1 or 2 (or parallel.offload_optimizer=false)")
    if par.bucket_mb <= 0:
        raise UserError(f"parallel.bucket_mb must be positive, got {par.bucket_mb}")


def check_zero3(cfg: JobConfig) -> None:
    """ZeRO 3 (parameters sharded and gathered around each module) is built and tested for
    models with every weight trained (dense and Mixture-of-Experts) and for LoRA (the
    frozen base sharded too, ``zero/frozen.py``), optimizer state on the device."""
    if cfg.parallel.zero != 3:
        return
    if cfg.parallel.offload_optimizer:
        raise UserError("parallel.offload_optimizer is not supported with parallel.zero=3: use zero 1 or 2 "
                        "or parallel.offload_optimizer=false")


def check_new_axes(par, model_cfg=None) -> None:
    """Expert parallelism needs experts to split: a Mixture-of-Experts model whose expert
    count ep divides."""
    if par.ep == 1:
        return
    moe = getattr(model_cfg, "moe", None)
    if model_cfg is not None and moe is None:
        raise UserError(f"parallel.ep {par.ep}: expert parallelism needs a Mixture-of-Experts model "
                        "(model.moe, or a Hugging Face MoE checkpoint): set parallel.ep = 1")
    if moe is not None and moe.n_experts % par.ep:
        raise UserError(f"parallel.ep {par.ep} does not divide the model's {moe.n_experts} experts: "
                        f"choose an ep that divides {moe.n_experts} (and parallel.dp)")


def check_context_parallel(par, seq_len: int) -> None:
    """Each sequence cuts into 2 cp equal chunks (head-tail)."""
    if par.cp > 1 and seq_len % (2 * par.cp):
        raise UserError(f"train.seq_len {seq_len} does not split into 2 x parallel.cp = {2 * par.cp} equal "
                        f"chunks: use a multiple of {2 * par.cp}, or change parallel.cp")


def job_world_size(cfg: JobConfig) -> int:
    """The world size a recipe asks for: ``launch.nnodes * launch.nproc``."""
    for name in ("nnodes", "nproc"):
        value = getattr(cfg.launch, name)
        if value < 1:
            raise UserError(f"launch.{name} must be at least 1, got {value}")
    return cfg.launch.nnodes * cfg.launch.nproc


def check_paths(cfg: JobConfig) -> None:
    """The directories the job writes (corpus cache, run directory) must be directories,
    or creatable under a writable one."""
    cache = cfg.data.cache_dir or os.path.join(os.path.expanduser("~"), ".cache", "parallel3d")
    for name, value in (("data.cache_dir", cache), ("run.dir", cfg.run.dir)):
        path = Path(value)
        if path.exists() and not path.is_dir():
            raise UserError(f"{name} '{value}' is a file, not a directory: give a directory path")
        parent = path
        while not parent.exists():
            parent = parent.parent
        if not parent.is_dir():
            raise UserError(f"{name} '{value}' cannot be created: '{parent}' is a file")
        if not os.access(parent, os.W_OK | os.X_OK):
            raise UserError(f"{name} '{value}' cannot be created: '{parent}' is not writable")
