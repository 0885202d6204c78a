"""Per-step metrics: one JSON object per line in ``RUN_DIR/metrics.jsonl`` (rank 0), and
the console line of a step."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path


def _extras(record: dict, data_wait_s: float) -> str:
    out = ""
    if data_wait_s >= 1e-3:  # only when the step waited for data
        out += f"  data_wait {data_wait_s * 1e3:.0f} ms"
    if "val_loss" in record:
        out += f"  val_loss {record['val_loss']:.4f}"
    if "mfu" in record:
        out += f"  MFU {record['mfu'] * 100:.1f}%"
    return out


class MetricsLogger:
    """Appends each step's record to ``metrics.jsonl`` (flushed per line, so a killed run
    keeps every finished step) and writes the resolved config to ``config.json``.

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
        (run_dir / "config.json").write_text(json.dumps(config, indent=1))
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

    @staticmethod
    def show(record: dict, data_wait_s: float = 0.0) -> None:
        """The step's console line (``data_wait_s``: how long this rank waited for the
        step's batches, shown only when it did)."""
        print(f"step {record['step']:>5}  loss {record['loss']:.4f}  lr {record['lr']:.2e}  "
              f"grad_norm {record['grad_norm']:.3f}  {record['tokens_per_s']:,.0f} tok/s  "
              f"{record['step_time_s'] * 1e3:.0f} ms" + _extras(record, data_wait_s), file=sys.stdout, flush=True)

    def close(self) -> None:
        self._file.close()
