"""The model a job's ``[model]`` section names: a preset with fields overridden, or a
Hugging Face folder's config.json (``model.hf_checkpoint``).

Above the model and checkpoint code it reads (a preset, an HF folder's config.json) and
below both the trainer and the planner, which each resolve a job's model: neither imports
the other for it.
"""

from __future__ import annotations

from dataclasses import asdict
from dataclasses import fields as dataclass_fields

from parallel3d.config import ModelConfig
from parallel3d.errors import UserError

from parallel3d.models.llama import PRESETS, LlamaConfig, config_from_preset
from parallel3d.models import FAMILIES
from parallel3d.models.moe import MoEConfig


def resolve_model_config(cfg: ModelConfig) -> LlamaConfig:
    if cfg.family not in FAMILIES:
        raise UserError(f"unknown model.family '{cfg.family}': choose one of {list(FAMILIES)}")
    if cfg.hf_checkpoint:
        return _model_config_from_hf(cfg)
    if cfg.preset == "hf":
        raise UserError("model.preset 'hf' takes the model from a Hugging Face folder: set "
                        "model.hf_checkpoint (--model.hf_checkpoint=DIR, a folder with config.json "
                        "and *.safetensors)")
    overrides = {k: v for k, v in asdict(cfg).items() if k != "preset"}
    overrides["moe"] = moe_section(cfg.moe)
    try:
        model_cfg = config_from_preset(cfg.preset, **overrides)
        model_cfg.validate()
    except ValueError as e:
        hint = " or 'hf' (with model.hf_checkpoint)" if cfg.preset not in PRESETS else ""
        raise UserError(f"{e}{hint}") from None
    return model_cfg


def moe_section(fields: dict) -> MoEConfig | None:
    """``[model.moe]`` as the model's :class:`MoEConfig` (None when empty: the preset's)."""
    if not fields:
        return None
    known = {f.name for f in dataclass_fields(MoEConfig)}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise UserError(f"unknown config key 'model.moe.{unknown[0]}': the keys of [model.moe] are "
                        f"{', '.join(sorted(known))}")
    try:
        moe = MoEConfig(**fields)
        moe.validate()
    except (TypeError, ValueError) as e:
        raise UserError(str(e)) from None
    return moe


def _model_config_from_hf(cfg: ModelConfig) -> LlamaConfig:
    """The shape comes from the folder's config.json; a model.* field set as well must agree
    (init_std excepted: the weights come from the folder)."""
    from dataclasses import replace
    from pathlib import Path

    from parallel3d.checkpoint.foreign.hf import model_config_from_folder

    folder = Path(cfg.hf_checkpoint)
    if not folder.is_dir():
        raise UserError(f"model.hf_checkpoint '{folder}' is not a folder: give a Hugging Face "
                        "model folder (config.json + safetensors)")
    model_cfg = model_config_from_folder(folder)
    for key, value in asdict(cfg).items():
        if key in ("family", "preset", "hf_checkpoint", "init_std") or value is None or (key == "moe" and not value):
            continue
        if key == "moe":
            value = moe_section(value)
        if getattr(model_cfg, key) != value:
            raise UserError(f"model.{key} = {value!r} disagrees with model.hf_checkpoint's config.json "
                            f"({getattr(model_cfg, key)!r}): drop model.{key}")
    if cfg.init_std is not None:
        model_cfg = replace(model_cfg, init_std=cfg.init_std)
    return model_cfg


