"""DeepSpeed checkpoints (``engine.save_checkpoint``, ZeRO stages 0 to 2) as a source.

Layout of such a checkpoint (one model-parallel rank; DeepSpeed 0.1x)::

    DIR/latest                                    the tag, e.g. "global_step30"
    DIR/<tag>/mp_rank_00_model_states.pt          "module" (weights in the training dtype),
                                                  "param_shapes" (per param group, in order),
                                                  "shared_params", "global_steps", ...
    DIR/<tag>/zero_pp_rank_R_mp_rank_00_optim_states.pt   (ZeRO 1/2, one per dp rank R)
        optimizer_state_dict.single_partition_of_fp32_groups[g]   rank R's fp32 master slice
        optimizer_state_dict.base_optimizer_state.state[g]        its exp_avg / exp_avg_sq
        optimizer_state_dict.param_alignment_paddings[g][i]       (newer versions)

For param group g, the ranks' slices concatenated are the group's parameters flattened in
``param_shapes`` order (each followed by its alignment padding), padded at the end: the
same flat-range model as parallel3d's own ZeRO pieces, so each parameter is read as the
slices of the ranks that hold it.

The files are torch pickles. They are opened with ``torch.load(weights_only=True)``, which
executes no code; the three DeepSpeed types these files hold are allow-listed by name and
mapped to inert stand-ins defined here (``LossScaler`` and ``fragment_address`` become
plain attribute records, ``ZeroStageEnum`` an int), so DeepSpeed itself is never imported.
"""

from __future__ import annotations

import math
import pickle
import re
from pathlib import Path

import torch

from parallel3d.errors import UserError
from parallel3d.models.llama.hf import config_from_hf, name_from_hf

from .errors import CheckpointError, read_json_object
from .state import logical_shapes

_MODEL_FILE = re.compile(r"^mp_rank_(\d+)_model_states\.pt$")
_OPTIM_FILE = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_00_optim_states\.pt$")


class _Record:
    """Inert stand-in for an allow-listed DeepSpeed object: keeps its arguments and state."""

    def __new__(cls, *args, **kwargs):
        obj = object.__new__(cls)
        obj.args = args
        return obj


class _LossScaler(_Record):
    pass


class _FragmentAddress(_Record):
    pass


class _ZeroStage(int):
    pass


_SAFE_GLOBALS = [
    (_LossScaler, "deepspeed.runtime.fp16.loss_scaler.LossScaler"),
    (_LossScaler, "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"),
    (_FragmentAddress, "deepspeed.utils.tensor_fragment.fragment_address"),
    (_ZeroStage, "deepspeed.runtime.zero.config.ZeroStageEnum"),
]


def load_torch_file(path: Path) -> dict:
    """A DeepSpeed ``.pt`` file, unpickled without executing code (memory-mapped)."""
    try:
        with torch.serialization.safe_globals(_SAFE_GLOBALS):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except (pickle.UnpicklingError, RuntimeError, OSError, EOFError) as e:
        first = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"{path} cannot be read safely: {first[:300]}") from None


def find_deepspeed_dir(path: Path) -> Path | None:
    """The tag folder of a DeepSpeed checkpoint at ``path`` (the folder itself, or the
    one its ``latest`` names), else None."""
    if any(_MODEL_FILE.match(p.name) for p in path.iterdir()):
        return path
    latest = path / "latest"
    if latest.is_file():
        tag = latest.read_text(encoding="utf-8").strip()
        if tag and "/" not in tag and not tag.startswith(".") and (path / tag).is_dir():
            if any(_MODEL_FILE.match(p.name) for p in (path / tag).iterdir()):
                return path / tag
    return None


def _find_config(folder: Path, config: str | Path | None) -> dict:
    candidates = [Path(config)] if config else [folder / "config.json", folder.parent / "config.json"]
    for c in candidates:
        if c.is_file():
            hf = read_json_object(c, "a model config")
            from .hf import check_no_remote_code

            check_no_remote_code(hf, c)
            return hf
    raise UserError(f"convert: the DeepSpeed checkpoint {folder} has no config.json beside or above "
                    "it: give the model's Hugging Face config.json with --config")


class DeepSpeedCheckpoint:
    """Logical tensors ``model/`` (fp32 masters under ZeRO, else the module's weights) and,
    under ZeRO 1/2, ``optim/exp_avg/`` and ``optim/exp_avg_sq/``."""

    def __init__(self, folder: Path, config: str | Path | None = None):
        self.folder = Path(folder)
        names = sorted(p.name for p in self.folder.iterdir())
        model_files = [n for n in names if _MODEL_FILE.match(n)]
        if model_files != ["mp_rank_00_model_states.pt"] or any(n.startswith("layer_") for n in names):
            raise CheckpointError(f"{self.folder} was saved with tensor or pipeline parallelism "
                                  f"({model_files}): only DeepSpeed data-parallel (ZeRO 0-2) checkpoints convert")
        self.states = load_torch_file(self.folder / model_files[0])
        if not isinstance(self.states, dict) or not isinstance(self.states.get("module"), dict):
            raise CheckpointError(f"{self.folder / model_files[0]} holds no 'module' state dict: "
                                  "not a DeepSpeed model-states file")
        self.hf_config = _find_config(self.folder, config)
        try:
            self.model_config = config_from_hf(self.hf_config)
        except (KeyError, ValueError) as e:
            raise CheckpointError(f"config.json of {self.folder}: {e}") from None
        self.step = int(self.states.get("global_steps", 0))
        shapes = logical_shapes(self.model_config)
        self._shapes = {"model/" + n: s for n, s in shapes.items()}
        self._module = {self._logical(k): v for k, v in self.states["module"].items()}
        optim_files = sorted((int(m.group(1)), n) for n in names if (m := _OPTIM_FILE.match(n)))
        self._flat: dict[str, tuple[int, int, tuple]] = {}
        self._parts: list[dict] = []
        if optim_files:
            self._read_zero([self.folder / n for _, n in optim_files])
        missing = sorted(set(self._shapes) - set(self._module))
        if missing:
            raise CheckpointError(f"{self.folder}: no weights for {missing[:4]} (does config.json "
                                  "describe this model?)")
        opt_step = self._opt_step()
        self.trainer = {"step": self.step, "optimizer": {"kind": "adamw", "step": opt_step}} \
            if self._flat else None

    def _logical(self, ds_name: str) -> str:
        name = ds_name[len("module."):] if ds_name.startswith("module.") else ds_name
        return "model/" + name_from_hf(name)

    def _read_zero(self, files: list[Path]) -> None:
        parts = [load_torch_file(f)["optimizer_state_dict"] for f in files]
        stage = int(parts[0].get("zero_stage", -1))
        if stage not in (1, 2):
            raise CheckpointError(f"{files[0]} is a ZeRO stage {stage} checkpoint: stages 0 to 2 convert "
                                  "(for stage 3, run DeepSpeed's zero_to_fp32.py first)")
        counts = parts[0].get("partition_count")
        count = max(counts) if isinstance(counts, list) else counts
        if count != len(files):
            raise CheckpointError(f"{self.folder} has {len(files)} optimizer files for {count} ranks")
        for key in ("single_partition_of_fp32_groups", "base_optimizer_state"):
            if key not in parts[0]:
                raise CheckpointError(f"{files[0]} has no {key}: not a ZeRO-1/2 optimizer state")
        self._parts = parts
        paddings = parts[0].get("param_alignment_paddings")
        shared = set(self.states.get("shared_params") or {})
        for g, group in enumerate(self.states["param_shapes"]):
            offset = 0
            for i, (name, shape) in enumerate(group.items()):
                numel = math.prod(shape)
                if name not in shared:
                    self._flat[self._logical(name)] = (g, offset, tuple(shape))
                offset += numel + (paddings[g][i] if paddings else 0)
            have = sum(p["single_partition_of_fp32_groups"][g].numel() for p in parts)
            if have < offset:
                raise CheckpointError(f"{self.folder}: param group {g} needs {offset} elements, "
                                      f"the ranks' partitions hold {have}")

    def _opt_step(self) -> int:
        if not self._parts:
            return 0
        state = self._parts[0]["base_optimizer_state"]["state"]
        steps = [int(s["step"]) for s in state.values() if "step" in s]
        return steps[0] if steps else self.step

    # -- the source interface ------------------------------------------------------------------
    def names(self) -> list[str]:
        out = list(self._shapes)
        if self._flat:
            out += [f"optim/{m}/{n[6:]}" for m in ("exp_avg", "exp_avg_sq") for n in self._shapes]
        return out

    def has(self, name: str) -> bool:
        return name in self.names()

    def spec(self, name: str) -> tuple[tuple[int, ...], torch.dtype]:
        param = "model/" + name.split("/", 2)[-1] if not name.startswith("model/") else name
        if param not in self._shapes:
            raise CheckpointError(f"{self.folder} has no tensor {name!r}")
        dtype = torch.float32 if self._flat else self._module[param].dtype
        return self._shapes[param], dtype

    def read(self, name: str) -> torch.Tensor:
        shape, _ = self.spec(name)
        if not self._flat:
            return self._module[name].detach().clone().reshape(shape)
        kind = "master" if name.startswith("model/") else name.split("/")[1]
        param = "model/" + name.split("/", 2)[-1] if kind != "master" else name
        if param not in self._flat:  # frozen: not in the optimizer
            if kind != "master":
                raise CheckpointError(f"{self.folder}: {param} has no optimizer state (frozen?)")
            return self._module[param].detach().float().clone().reshape(shape)
        g, offset, _ = self._flat[param]
        lo, hi = offset, offset + math.prod(shape)
        pieces, start = [], 0
        for part in self._parts:
            if kind == "master":
                flat = part["single_partition_of_fp32_groups"][g]
            else:
                flat = part["base_optimizer_state"]["state"][g][kind]
            a, b = max(lo, start), min(hi, start + flat.numel())
            if a < b:
                pieces.append(flat[a - start:b - start])
            start += flat.numel()
        return torch.cat(pieces).float().reshape(shape).clone()

    def read_region(self, name: str, offsets, shape) -> torch.Tensor:
        full = self.read(name)
        return full[tuple(slice(o, o + s) for o, s in zip(offsets, shape))].clone()

    def close(self) -> None:
        self.states, self._parts, self._module = {}, [], {}
