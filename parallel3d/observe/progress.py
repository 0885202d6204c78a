"""Rank 0's live progress: one line redrawn in place on a terminal.

``observability.progress``: ``auto`` shows the bar when stdout is a terminal and prints the
usual log lines otherwise (files, CI logs); ``on`` / ``off`` force it. The bar costs one
string format and one write per step, after the step's clock has stopped.

While the bar is up, anything else this process prints (the memory line, a warning, a
straggler report) must not land at the end of the bar's line. The bar therefore holds
``sys.stdout`` and ``sys.stderr`` (as rich's live display does): a write through either
first blanks the bar's line, and the bar comes back at the next step, below what was
printed. :meth:`ProgressBar.close` gives the streams back.
"""

from __future__ import annotations

import statistics
import sys
import time

from parallel3d.config import AutoOnOff

GiB = 2**30


def wants_bar(mode: AutoOnOff, stream=None) -> bool:
    stream = stream or sys.stdout
    return mode == "on" or (mode == "auto" and stream.isatty())


def duration(seconds: float) -> str:
    seconds = int(round(seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s" if m else f"{s}s"


class _AboveTheBar:
    """A stream (stdout or stderr) whose writes first take the bar off the line."""

    def __init__(self, stream, bar: "ProgressBar"):
        self._stream, self._bar = stream, bar

    def write(self, text: str) -> int:
        if text:
            self._bar.clear()
        written = self._stream.write(text)
        if text:
            self._stream.flush()  # before the bar redraws on the other stream
            self._bar.line_open = not text.endswith("\n")
        return written

    def __getattr__(self, name):  # flush, isatty, fileno, encoding, ...
        return getattr(self._stream, name)


MEMORY_LABELS = {"cuda_max_allocated": "peak alloc", "cpu_max_rss": "peak rss"}


class ProgressBar:
    """``step 12/100 [####......] loss 5.123  val_loss 5.301 (step 10)  12,345 tok/s  MFU 41.2%
    peak alloc 3.20 GiB (max rank)  ETA 1m23s``: "peak alloc" is the CUDA caching allocator's
    peak, "peak rss" the process's resident set on CPU, of the rank with the most.

    The ETA is the median wall time between recent updates times the steps left (wall
    time, so it includes what happens between steps, which step_time_s does not). The
    held-out loss is the latest evaluation's, shown until the next one.

    ``hold_streams`` (default: when drawing on the process's own stdout) routes other
    prints above the bar (see the module docstring)."""

    def __init__(self, total: int, stream=None, width: int = 20, hold_streams: bool | None = None):
        self.total, self.width = total, width
        self.stream = stream or sys.stdout
        self._last = None
        self._gaps: list[float] = []
        self._shown = 0  # characters of the bar on the line now (0: not drawn)
        self.line_open = False  # something else left the cursor mid-line
        self.memory: int | None = None  # peak memory of the latest complete record
        self.val_loss: float | None = None
        self.val_step: int | None = None  # the step of that evaluation
        self.memory_label = "peak mem"
        self._held = None
        if hold_streams if hold_streams is not None else stream is None:
            self._held = (sys.stdout, sys.stderr)
            sys.stdout, sys.stderr = _AboveTheBar(sys.stdout, self), _AboveTheBar(sys.stderr, self)

    def line(self, record: dict) -> str:
        step = record["step"]
        done = int(self.width * step / self.total)
        if "val_loss" in record:
            self.val_loss, self.val_step = record["val_loss"], step
        parts = [f"step {step}/{self.total} [{'#' * done}{'.' * (self.width - done)}]",
                 f"loss {record['loss']:.4f}"]
        if self.val_loss is not None:  # the latest evaluation's, and its step
            parts.append(f"val_loss {self.val_loss:.4f} (step {self.val_step})")
        parts.append(f"{record['tokens_per_s']:,.0f} tok/s")
        if "mfu" in record:
            parts.append(f"MFU {record['mfu'] * 100:.1f}%")
        if "peak_mem_bytes" in record:
            self.complete(record)
        if self.memory is not None:  # the highest rank's peak: CUDA allocator's, or the process's resident set
            parts.append(f"{self.memory_label} {self.memory / GiB:.2f} GiB (max rank)")
        if self._gaps:
            parts.append(f"ETA {duration(statistics.median(self._gaps) * (self.total - step))}")
        return "  ".join(parts)

    def complete(self, record: dict) -> None:
        """Take a complete record's peak memory (the step's own record carries it one step
        later, once every rank's figures are in) and what it measures."""
        self.memory = record.get("peak_mem_bytes", self.memory)
        if "mem_source" in record:
            self.memory_label = MEMORY_LABELS.get(record["mem_source"], "peak mem")

    def update(self, record: dict) -> None:
        now = time.perf_counter()
        if self._last is not None:
            self._gaps = (self._gaps + [now - self._last])[-20:]
        self._last = now
        text = self.line(record)
        if self.line_open:  # another write left a partial line: the bar starts a new one
            self.stream.write("\n")
            self.line_open = False
        pad = max(0, self._shown - len(text))  # blank what a longer previous line left
        self.stream.write("\r" + text + " " * pad)
        self.stream.flush()
        self._shown = len(text)

    def clear(self) -> None:
        """Blank the bar's line and put the cursor at its start."""
        if self._shown:
            self.stream.write("\r" + " " * self._shown + "\r")
            self.stream.flush()
            self._shown = 0

    def close(self) -> None:
        if self._shown:
            self.stream.write("\n")
            self.stream.flush()
            self._shown = 0
        if self._held is not None:
            sys.stdout, sys.stderr = self._held
            self._held = None
