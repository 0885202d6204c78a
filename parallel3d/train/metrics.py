"""Per-step metrics: one JSON object per line in ``RUN_DIR/metrics.jsonl`` (rank 0)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path


def _extras(record: dict) -> str:
    out = ""
    if record.get("data_wait_s", 0) >= 1e-3:  # only when the step waited for data
        out += f"  data_wait {record['data_wait_s'] * 1e3:.0f} ms"
    if "val_loss" in record:
        out += f"  val_loss {record['val_loss']:.4f}"
    if "mfu" in record:
        out += f"  MFU {record['mfu'] * 100:.1f}%"
    return out


class MetricsLogger:
    """Appends each step's record to ``metrics.jsonl`` (flushed per line, so a killed run
    keeps every finished step) and writes the resolved config to ``config.json``.

    A ``metrics.jsonl`` left by an earlier run in the same directory is kept, renamed
    with its modification time, never overwritten.
    """

    def __init__(self, run_dir: Path, config: dict):
        run_dir.mkdir(parents=True, exist_ok=True)
        self.path = run_dir / "metrics.jsonl"
        if self.path.exists():
            stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(self.path.stat().st_mtime))
            self.path.rename(run_dir / f"metrics.{stamp}.jsonl")
        (run_dir / "config.json").write_text(json.dumps(config, indent=1))
        self._file = open(self.path, "a", encoding="utf-8")

    def log(self, record: dict, console: bool = True) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if console:
            print(f"step {record['step']:>5}  loss {record['loss']:.4f}  lr {record['lr']:.2e}  "
                  f"grad_norm {record['grad_norm']:.3f}  {record['tokens_per_s']:,.0f} tok/s  "
                  f"{record['step_time_s'] * 1e3:.0f} ms" + _extras(record), file=sys.stdout, flush=True)

    def close(self) -> None:
        self._file.close()
