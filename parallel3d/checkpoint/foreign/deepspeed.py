"""DeepSpeed checkpoints (``engine.save_checkpoint``, ZeRO stages 0 to 3) as a source.

Layout of such a checkpoint (one model-parallel rank; DeepSpeed 0.1x)::

    DIR/latest                                           the tag, e.g. "global_step30"
    DIR/<tag>/mp_rank_00_model_states.pt                 stages 0-2: "module" (weights in the
                                                         training dtype), "param_shapes" (per
                                                         param group, in order), "shared_params",
                                                         "global_steps", ...
    DIR/<tag>/zero_pp_rank_R_mp_rank_00_model_states.pt  stage 3: the same per dp rank R
    DIR/<tag>/zero_pp_rank_R_mp_rank_00_optim_states.pt  ZeRO 1-3, one per dp rank R:
        optimizer_state_dict.single_partition_of_fp32_groups[g]   (1/2) R's fp32 slice of group g
        optimizer_state_dict.base_optimizer_state.state[g]        (1/2) its exp_avg / exp_avg_sq
        optimizer_state_dict.fp32_flat_groups[g]                  (3) R's fp32 partitions of g
        optimizer_state_dict.optimizer_state_dict.state[g]        (3) their exp_avg / exp_avg_sq

Stages 1/2: for param group g, the ranks' slices concatenated are the group's parameters
flattened in ``param_shapes`` order (each followed by its alignment padding), padded at
the end. Stage 3 partitions each parameter by itself: rank R holds its elements
``[R * c, (R + 1) * c)`` with ``c = ceil(numel / ranks)`` (the last padded), at a running
offset of R's groups concatenated. Either way each parameter is a list of flat segments of
the ranks' tensors: the same flat-range model as parallel3d's own ZeRO pieces.

The files are read with :class:`~parallel3d.checkpoint.foreign.torchfile.TorchFile`: nothing in
them executes, DeepSpeed is never imported (its loss scaler, ``fragment_address`` and
``ZeroStageEnum`` are allow-listed as inert stand-ins), and a tensor's bytes are read only
when asked for.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import torch

from parallel3d.models.llama.hf import name_from_hf

from ..errors import CheckpointError
from .. import zerocopy
from ..source import Source, find_config, model_config_of
from ..state import logical_shapes
from .torchfile import LazyTensor, TorchFile, record_class

_MODEL_FILE = re.compile(r"^(?:zero_pp_rank_(\d+)_)?mp_rank_(\d+)_model_states\.pt$")
_OPTIM_FILE = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
_ZeroStage = type("ZeroStageEnum", (int,), {})
_ALLOWED = {
    ("deepspeed.runtime.fp16.loss_scaler", "LossScaler"): record_class("deepspeed.LossScaler"),
    ("deepspeed.runtime.fp16.loss_scaler", "DynamicLossScaler"): record_class("deepspeed.DynamicLossScaler"),
    ("deepspeed.utils.tensor_fragment", "fragment_address"): record_class("deepspeed.fragment_address"),
    ("deepspeed.runtime.zero.config", "ZeroStageEnum"): _ZeroStage,
}


def load_torch_file(path: Path) -> TorchFile:
    """A DeepSpeed ``.pt`` file, unpickled without executing code; tensors read lazily."""
    return TorchFile(path, extra=_ALLOWED)


def _value(x):
    """A scalar that a file stored as a tensor (the optimizer step), as a Python number."""
    return x.read().item() if isinstance(x, LazyTensor) else x


def find_deepspeed_dir(path: Path) -> Path | None:
    """The tag folder of a DeepSpeed checkpoint at ``path`` (the folder itself, or the
    one its ``latest`` names), else None."""
    if any(_MODEL_FILE.match(p.name) for p in path.iterdir()):
        return path
    latest = path / "latest"
    if latest.is_file():
        try:
            tag = latest.read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError):
            return None
        if tag and "/" not in tag and not tag.startswith(".") and (path / tag).is_dir():
            if any(_MODEL_FILE.match(p.name) for p in (path / tag).iterdir()):
                return path / tag
    return None


class DeepSpeedCheckpoint(Source):
    """Logical tensors ``model/`` (fp32 masters under ZeRO, else the module's weights) and,
    under ZeRO 1-3, ``optim/exp_avg/`` and ``optim/exp_avg_sq/``."""

    def __init__(self, folder: Path, config: str | Path | None = None):
        self.folder = Path(folder)
        self._files: list[TorchFile] = []
        names = sorted(p.name for p in self.folder.iterdir())
        models = sorted((int(m.group(1) or 0), int(m.group(2)), n) for n in names if (m := _MODEL_FILE.match(n)))
        optims = sorted((int(m.group(1)), int(m.group(2)), n) for n in names if (m := _OPTIM_FILE.match(n)))
        if any(mp for _, mp, _ in models + optims) or any(n.startswith("layer_") for n in names):
            raise CheckpointError(f"{self.folder} was saved with tensor or pipeline parallelism "
                                  f"({[n for *_, n in models][:3]}): only DeepSpeed data-parallel "
                                  "(ZeRO 0-3) checkpoints convert")
        self.states = self._open(self.folder / models[0][2]).obj
        if not isinstance(self.states, dict) or not isinstance(self.states.get("module"), dict):
            raise CheckpointError(f"{self.folder / models[0][2]} holds no 'module' state dict: "
                                  "not a DeepSpeed model-states file")
        self.hf_config = find_config(self.folder, config, "DeepSpeed")
        self.model_config = model_config_of(self.hf_config, self.folder)
        self.step = int(self.states.get("global_steps") or 0)
        self._shapes = {"model/" + n: s for n, s in logical_shapes(self.model_config).items()}
        self._module = {self._logical(k): v for k, v in self.states["module"].items()
                        if isinstance(v, LazyTensor)}
        self._segments: dict[str, dict[str, list]] = {}  # kind -> param -> flat segments
        self.zero_stage = 0
        if optims:
            self._read_zero([self.folder / n for *_, n in optims], [self.folder / n for *_, n in models])
        missing = sorted(n for n in self._shapes if n not in self._module and n not in self._segments.get("master", {}))
        if missing:
            raise CheckpointError(f"{self.folder}: no weights for {missing[:4]} (does config.json "
                                  "describe this model?)")
        self.trainer = {"step": self.step, "optimizer": self._optimizer_scalars()} if self._segments else None

    def _open(self, path: Path) -> TorchFile:
        f = load_torch_file(path)
        self._files.append(f)
        return f

    def _logical(self, ds_name: str) -> str:
        name = ds_name[len("module."):] if ds_name.startswith("module.") else ds_name
        return "model/" + name_from_hf(name)

    # -- ZeRO partitions -------------------------------------------------------------------------
    def _read_zero(self, files: list[Path], model_files: list[Path]) -> None:
        parts = [self._open(f).obj.get("optimizer_state_dict") for f in files]
        if not all(isinstance(p, dict) for p in parts):
            raise CheckpointError(f"{files[0]} holds no optimizer_state_dict: not a ZeRO optimizer state")
        stage = int(parts[0].get("zero_stage", -1))
        counts = parts[0].get("partition_count")
        count = max(counts) if isinstance(counts, list) else counts
        if count != len(files):
            raise CheckpointError(f"{self.folder} has {len(files)} optimizer files for {count} ranks "
                                  "(a rank's file is missing)")
        self.zero_stage = stage
        if stage in (1, 2):
            key, inner = "single_partition_of_fp32_groups", "base_optimizer_state"
        elif stage == 3:
            key, inner = "fp32_flat_groups", "optimizer_state_dict"
        else:
            raise CheckpointError(f"{files[0]} is a ZeRO stage {stage} checkpoint: stages 0 to 3 convert")
        for k in (key, inner):
            if k not in parts[0]:
                raise CheckpointError(f"{files[0]} has no {k}: not a ZeRO-{stage} optimizer state")
        self._parts, self._inner = parts, [p[inner] for p in parts]
        flats = {"master": [p[key] for p in parts]}
        for m in ("exp_avg", "exp_avg_sq"):
            try:
                flats[m] = [[st["state"][g][m] for g in range(len(p[key]))] for p, st in zip(parts, self._inner)]
            except (KeyError, TypeError, IndexError):
                flats.pop(m, None)  # not Adam, or no step taken yet: weights only
                break
        layout = self._stage3_layout(len(files)) if stage == 3 else self._stage12_layout(parts)
        for kind, per_rank in flats.items():
            self._segments[kind] = {n: self._place(segs, per_rank) for n, segs in layout.items()}
        if stage == 3:
            self._frozen_stage3(model_files)

    def _stage12_layout(self, parts) -> dict[str, list]:
        """param -> [(rank, group, lo in that rank's tensor, position in param, count)]."""
        paddings = parts[0].get("param_alignment_paddings")
        shared = set(self.states.get("shared_params") or {})
        sizes = [[p["single_partition_of_fp32_groups"][g].numel() for p in parts]
                 for g in range(len(self.states["param_shapes"]))]
        out = {}
        for g, group in enumerate(self.states["param_shapes"]):
            offset = 0
            for i, (name, shape) in enumerate(group.items()):
                numel = math.prod(shape)
                if name not in shared:
                    out[self._logical(name)] = _spread(offset, numel, g, sizes[g])
                offset += numel + (paddings[g][i] if paddings else 0)
            if sum(sizes[g]) < offset:
                raise CheckpointError(f"{self.folder}: param group {g} needs {offset} elements, "
                                      f"the ranks' partitions hold {sum(sizes[g])}")
        return out

    def _stage3_layout(self, ranks: int) -> dict[str, list]:
        group_sizes = [t.numel() for t in self._parts[0]["fp32_flat_groups"]]
        out, offset = {}, 0
        for group in self.states["param_shapes"]:
            for name, shape in group.items():
                numel = math.prod(shape)
                part = math.ceil(numel / ranks)
                segs = []
                for r in range(ranks):
                    n = max(0, min(part, numel - r * part))
                    segs += [(r, g, lo, r * part + pos, k) for g, lo, pos, k in _locate(offset, n, group_sizes)]
                out[self._logical(name)] = segs
                offset += part
        if offset > sum(group_sizes):
            raise CheckpointError(f"{self.folder}: the parameters need {offset} elements per rank, "
                                  f"the partitions hold {sum(group_sizes)}")
        return out

    def _frozen_stage3(self, model_files: list[Path]) -> None:
        frozen = self.states.get("frozen_param_shapes") or {}
        if not frozen:
            return
        fragments = [self.states.get("frozen_param_fragments") or {}]
        fragments += [self._open(f).obj.get("frozen_param_fragments") or {} for f in model_files[1:]]
        for name, shape in frozen.items():
            numel, part = math.prod(shape), math.ceil(math.prod(shape) / len(fragments))
            segs = [(fr[name], 0, r * part, max(0, min(part, numel - r * part)))
                    for r, fr in enumerate(fragments)]
            self._segments["master"][self._logical(name)] = [s for s in segs if s[3] > 0]

    def _place(self, segs, per_rank) -> list:
        return [(per_rank[r][g], lo, pos, n) for r, g, lo, pos, n in segs if n > 0]

    def _optimizer_scalars(self) -> dict:
        out = {"kind": "adamw", "step": self.step}
        state = self._inner[0].get("state") or {}
        steps = [int(_value(s["step"])) for s in state.values() if isinstance(s, dict) and "step" in s]
        if steps:
            out["step"] = steps[0]
        groups = self._inner[0].get("param_groups") or []
        if groups:
            g = groups[0]
            out.update({k: (list(g[k]) if k == "betas" else g[k]) for k in ("lr", "betas", "eps", "weight_decay") if k in g})
        return out

    # -- the source interface ------------------------------------------------------------------
    def names(self) -> list[str]:
        out = list(self._shapes)
        if "exp_avg" in self._segments:
            out += [f"optim/{m}/{n[6:]}" for m in ("exp_avg", "exp_avg_sq") for n in self._shapes
                    if n in self._segments[m]]
        return out

    def _split(self, name: str) -> tuple[str, str]:
        if name.startswith("model/"):
            return "master", name
        parts = name.split("/", 2)
        return parts[1], "model/" + parts[-1]

    def spec(self, name: str) -> tuple[tuple[int, ...], torch.dtype]:
        kind, param = self._split(name)
        if param not in self._shapes or (kind != "master" and not self.has(name)):
            raise CheckpointError(f"{self.folder} has no tensor {name!r}")
        if param in self._segments.get(kind, {}):
            return self._shapes[param], torch.float32
        return self._shapes[param], self._module[param].dtype

    def read_flat(self, name: str, lo: int, hi: int) -> torch.Tensor:
        kind, param = self._split(name)
        shape, dtype = self.spec(name)
        segs = self._segments.get(kind, {}).get(param)
        if segs is None:  # stage 0, or frozen: the module's full weights
            t = self._module[param]
            if t.numel() != math.prod(shape):
                raise CheckpointError(f"{self.folder}: {param} has {t.numel()} elements, the model "
                                      f"{math.prod(shape)}")
            return t.read_flat(lo, hi)
        out = torch.empty(hi - lo, dtype=dtype)
        got = 0
        for tensor, src, pos, n in segs:
            a, b = max(lo, pos), min(hi, pos + n)
            if a < b:
                if tensor.dtype == dtype:
                    tensor.read_flat(src + a - pos, src + b - pos, out=out[a - lo:b - lo])
                else:
                    part = tensor.read_flat(src + a - pos, src + b - pos)
                    out[a - lo:b - lo] = part
                    zerocopy.release(part)
                got += b - a
        if got != hi - lo:
            raise CheckpointError(f"{self.folder}: elements [{lo}, {hi}) of {name} are not in the "
                                  "ranks' partitions (a rank's file is missing?)")
        return out

    def close(self) -> None:
        for f in self._files:
            f.close()
        self._files, self.states, self._module, self._segments, self._parts = [], {}, {}, {}, []


def _spread(offset: int, numel: int, g: int, sizes: list[int]) -> list:
    """Elements ``[offset, offset + numel)`` of group g, split over ranks of ``sizes``."""
    segs, start = [], 0
    for r, size in enumerate(sizes):
        a, b = max(offset, start), min(offset + numel, start + size)
        if a < b:
            segs.append((r, g, a - start, a - offset, b - a))
        start += size
    return segs


def _locate(offset: int, n: int, group_sizes: list[int]) -> list:
    """``[offset, offset + n)`` of a rank's groups concatenated, as (group, lo, pos, count)."""
    out, start = [], 0
    for g, size in enumerate(group_sizes):
        a, b = max(offset, start), min(offset + n, start + size)
        if a < b:
            out.append((g, a - start, a - offset, b - a))
        start += size
    return out
