"""Rank 0's live progress: one line redrawn in place on a terminal.

``observability.progress``: ``auto`` shows the bar when stdout is a terminal and prints the
usual log lines otherwise (files, CI logs); ``on`` / ``off`` force it. The bar costs one
string format and one write per step, after the step's clock has stopped.
"""

from __future__ import annotations

import statistics
import sys
import time

from parallel3d.errors import UserError

MODES = ("auto", "on", "off")
GiB = 2**30


def wants_bar(mode: str, stream=None) -> bool:
    if mode not in MODES:
        raise UserError(f"observability.progress '{mode}' is not supported: use auto, on or off")
    stream = stream or sys.stdout
    return mode == "on" or (mode == "auto" and stream.isatty())


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s" if m else f"{s}s"


class ProgressBar:
    """``step 12/100 [####......] loss 5.123  12,345 tok/s  MFU 41.2%  mem 3.2 GiB  ETA 1m23s``.

    The ETA is the median wall time between recent updates times the steps left (wall
    time, so it includes what happens between steps, which step_time_s does not)."""

    def __init__(self, total: int, stream=None, width: int = 20):
        self.total, self.width = total, width
        self.stream = stream or sys.stdout
        self._last = None
        self._gaps: list[float] = []
        self._shown = 0
        self.memory: int | None = None  # peak memory of the latest complete record

    def line(self, record: dict) -> str:
        step = record["step"]
        done = int(self.width * step / self.total)
        parts = [f"step {step}/{self.total} [{'#' * done}{'.' * (self.width - done)}]",
                 f"loss {record['loss']:.4f}", f"{record['tokens_per_s']:,.0f} tok/s"]
        if "mfu" in record:
            parts.append(f"MFU {record['mfu'] * 100:.1f}%")
        mem = record.get("peak_mem_bytes", self.memory)
        if mem is not None:
            parts.append(f"mem {mem / GiB:.2f} GiB")
        if self._gaps:
            parts.append(f"ETA {_duration(statistics.median(self._gaps) * (self.total - step))}")
        return "  ".join(parts)

    def update(self, record: dict) -> None:
        now = time.perf_counter()
        if self._last is not None:
            self._gaps = (self._gaps + [now - self._last])[-20:]
        self._last = now
        text = self.line(record)
        pad = max(0, self._shown - len(text))  # blank what a longer previous line left
        self.stream.write("\r" + text + " " * pad)
        self.stream.flush()
        self._shown = len(text)

    def close(self) -> None:
        if self._shown:
            self.stream.write("\n")
            self.stream.flush()
