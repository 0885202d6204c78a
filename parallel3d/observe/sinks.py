"""Optional metric sinks: TensorBoard (``observability.tensorboard``) and Weights & Biases
(``observability.wandb``). Each logs the numeric fields of every step's record on rank 0."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from parallel3d.errors import UserError


def check_observability(obs) -> None:
    """The ``[observability]`` values that their types do not settle, checked before any
    worker starts."""
    if obs.straggler_factor <= 1.0:
        raise UserError(f"observability.straggler_factor must be above 1 (a multiple of the median "
                        f"rank's busy time), got {obs.straggler_factor}")
    if obs.straggler_interval < 0:
        raise UserError(f"observability.straggler_interval must be >= 0 steps (0: never), "
                        f"got {obs.straggler_interval}")
    check_sinks(obs)


def check_sinks(obs) -> None:
    """Refuse, before anything starts, a sink whose package is not installed."""
    if obs.tensorboard and importlib.util.find_spec("tensorboard") is None:
        raise UserError("observability.tensorboard needs the tensorboard package: "
                        "pip install tensorboard, or set observability.tensorboard=false")
    if obs.wandb and importlib.util.find_spec("wandb") is None:
        raise UserError("observability.wandb needs the wandb package: pip install wandb, "
                        "or set observability.wandb=false")


def _scalars(record: dict) -> dict[str, float]:
    return {k: float(v) for k, v in record.items()
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}


class Sinks:
    def __init__(self, obs, run_dir: Path, config: dict):
        check_sinks(obs)
        self._tb = self._wandb = None
        if obs.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(run_dir / "tensorboard"))
        if obs.wandb:
            import wandb

            self._wandb = wandb.init(project="parallel3d", dir=str(run_dir), config=config)

    def log(self, record: dict) -> None:
        values = _scalars(record)
        if self._tb is not None:
            for k, v in values.items():
                self._tb.add_scalar(k, v, record["step"])
        if self._wandb is not None:
            self._wandb.log(values, step=record["step"])

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
