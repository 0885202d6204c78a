"""Per-step metrics: one JSON object per line in ``RUN_DIR/metrics.jsonl`` (rank 0), the
resolved config in ``RUN_DIR/config.json``, and the console line of a step."""

from __future__ import annotations

import copy
import json
import sys
import time
from dataclasses import asdict, fields
from pathlib import Path

import torch

from parallel3d.config import JobConfig, ModelConfig, config_from_dict
from parallel3d.train.setup import resolve_model_config

_KEEP = ("family", "preset", "hf_checkpoint")  # what names the model; every other field is its shape


def resolved_config(cfg: JobConfig) -> JobConfig:
    """The job as it runs: ``cfg`` with every model field filled from the resolved model
    (its preset, or the Hugging Face config.json of ``model.hf_checkpoint``), and
    ``launch.backend`` and ``train.dtype`` resolved from ``auto`` as the workers resolve
    them (nccl and bf16 on CUDA; gloo and fp32 on CPU). Loaded back, it is the same job."""
    model = resolve_model_config(cfg.model)
    out = copy.deepcopy(cfg)
    for f in fields(ModelConfig):
        if f.name == "moe":  # the [model.moe] table (empty: no experts)
            out.model.moe = asdict(model.moe) if model.moe is not None else {}
        elif f.name not in _KEEP:
            setattr(out.model, f.name, getattr(model, f.name))
    if out.launch.backend == "auto":
        out.launch.backend = "nccl" if torch.cuda.is_available() else "gloo"
    if out.train.dtype == "auto":
        out.train.dtype = "bf16" if out.launch.backend == "nccl" else "fp32"
    return out


def _extras(record: dict, data_wait_s: float) -> str:
    out = ""
    if data_wait_s >= 1e-3:  # only when the step waited for data
        out += f"  data_wait {data_wait_s * 1e3:.0f} ms"
    if "val_loss" in record:
        out += f"  val_loss {record['val_loss']:.4f}"
    if "mfu" in record:
        out += f"  MFU {record['mfu'] * 100:.1f}%"
    per_source = [(k.split("/", 1)[1], v) for k, v in record.items() if k.startswith("loss/")]
    if per_source:  # a data.blend: each source's loss
        out += "  " + " ".join(f"{name} {v:.3f}" for name, v in per_source)
    if "expert_imbalance" in record:  # a Mixture-of-Experts model
        out += f"  aux {record['aux_loss']:.4f}  experts max/mean {record['expert_imbalance']:.2f}"
        if record.get("dropped_tokens"):
            out += f"  dropped {record['dropped_tokens']}"
        if record.get("all_to_all_s"):
            out += f"  all-to-all {record['all_to_all_share'] * 100:.0f}%"
    return out


class MetricsLogger:
    """Appends each step's record to ``metrics.jsonl`` (flushed per line, so a killed run
    keeps every finished step) and writes the resolved config (:func:`resolved_config`)
    to ``config.json``.

    A ``metrics.jsonl`` left by an earlier run in the same directory is kept, renamed
    with its modification time, never overwritten. A run resumed from a checkpoint at
    step ``resume_step`` continues the same file instead: the records up to that step stay,
    later ones (steps the interrupted run made after its last checkpoint, which the
    resumed run repeats) move to ``metrics.<time>.jsonl``.
    """

    def __init__(self, run_dir: Path, config: dict, resume_step: int | None = None):
        run_dir.mkdir(parents=True, exist_ok=True)
        self.path = run_dir / "metrics.jsonl"
        if self.path.exists() and resume_step is not None:
            self._truncate_after(resume_step)
        elif self.path.exists():
            stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(self.path.stat().st_mtime))
            self.path.rename(run_dir / f"metrics.{stamp}.jsonl")
        resolved = resolved_config(config_from_dict(config)).to_dict()
        (run_dir / "config.json").write_text(json.dumps(resolved, indent=1))
        self._file = open(self.path, "a", encoding="utf-8")

    def _truncate_after(self, step: int) -> None:
        keep, drop = [], []
        for line in self.path.read_text(encoding="utf-8").splitlines():
            try:
                past = json.loads(line).get("step", 0) > step
            except (json.JSONDecodeError, AttributeError):
                past = True  # a line cut short by a kill
            (drop if past else keep).append(line)
        if drop:
            stamp = time.strftime("%Y%m%d-%H%M%S")
            (self.path.parent / f"metrics.{stamp}.jsonl").write_text("\n".join(drop) + "\n")
        self.path.write_text("".join(line + "\n" for line in keep), encoding="utf-8")

    def log(self, record: dict) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def log_ranks(self, table: dict) -> None:
        """One straggler check's per-rank rows (``{"step", "ranks": [...]}``) to
        ``ranks.jsonl``: the only per-rank output, every ``straggler_interval`` steps, so
        that a metrics.jsonl record has the same size at any world size."""
        with open(self.path.parent / "ranks.jsonl", "a", encoding="utf-8") as f:
            f.write(json.dumps(table) + "\n")

    @staticmethod
    def show(record: dict, data_wait_s: float = 0.0) -> None:
        """The step's console line (``data_wait_s``: how long this rank waited for the
        step's batches, shown only when it did)."""
        print(f"step {record['step']:>5}  loss {record['loss']:.4f}  lr {record['lr']:.2e}  "
              f"grad_norm {record['grad_norm']:.3f}  {record['tokens_per_s']:,.0f} tok/s  "
              f"{record['step_time_s'] * 1e3:.0f} ms" + _extras(record, data_wait_s), file=sys.stdout, flush=True)

    def close(self) -> None:
        self._file.close()
