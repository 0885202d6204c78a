"""When each forward, backward and wait ran on this rank; the bubble; a Chrome trace.

Each rank keeps a :class:`Timeline`. The schedule opens a step window as it starts the
step (every rank left the previous step's closing collectives together), records one span
per forward, backward and communication wait, and closes the window after the closing
collective of the step, so every stage's window covers the same stretch of time. The bubble of a stage is the part
of its window in which it computed nothing::

    bubble = 1 - (sum of forward and backward spans) / window

On CUDA the marks are CUDA events on the current stream (GPU time, resolved once the
window closes); on CPU they are ``time.perf_counter``.

``chrome_trace`` merges the recorded steps of all ranks into one Chrome-trace JSON object
(open it at https://ui.perfetto.dev): one process per rank, a "compute" and a "comm"
lane each. Clocks of different hosts are not comparable, so each rank's events of a step
are placed relative to that step's synchronisation point, which all ranks pass together.
"""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path

import torch

LANES = ("compute", "comm")
BUSY = ("forward", "backward", "weight")  # span categories that count as work in the bubble


class _CpuClock:
    def mark(self) -> float:
        return time.perf_counter()

    def seconds(self, a: float, b: float) -> float:
        return b - a


class _CudaClock:
    def mark(self):
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, a, b) -> float:
        b.synchronize()
        return a.elapsed_time(b) / 1e3


class Timeline:
    """Spans of this rank, step by step; keeps the events of the first ``record_steps``
    steps for the trace and the bubble of every step."""

    def __init__(self, device: torch.device | None = None, record_steps: int = 0):
        cuda = device is not None and device.type == "cuda"
        self.clock = _CudaClock() if cuda else _CpuClock()
        self.record_steps = record_steps
        self.recorded: list[dict] = []  # {"step", "offset_s", "spans": [(name, cat, lane, t0, t1, args)]}
        self.last_bubble: float | None = None
        self.last_shares: dict[str, float] = {}  # share of the last window per BUSY category
        self._origin = None  # mark of the first step's start
        self._step = None

    # -- recording ---------------------------------------------------------------------------
    def begin_step(self, step: int) -> None:
        """Open step ``step``'s record at the step's very start (the trainer, before it
        fetches data), so spans before the window (data, synchronisation) belong to it."""
        self._finish_step()
        mark = self.clock.mark()
        if self._origin is None:
            self._origin = mark
        self._step = {"step": step, "begin": mark, "start": mark, "spans": []}

    def start_step(self, step: int) -> None:
        """Open step ``step``'s window (the schedule, as it starts the step's work)."""
        if self._step is None or self._step["step"] != step:
            self.begin_step(step)
        self._step["start"] = self.clock.mark()

    @contextlib.contextmanager
    def span(self, name: str, cat: str, lane: str = "compute", **args):
        """Record the enclosed code as one span (``cat``: forward, backward, wait, ...)."""
        if self._step is None:
            yield
            return
        t0 = self.clock.mark()
        try:
            yield
        finally:
            self._step["spans"].append((name, cat, lane, t0, self.clock.mark(), args))

    def instant(self, name: str, lane: str = "comm", **args) -> None:
        """Record a point in time (a zero-length span of category "mark": a collective
        issued asynchronously, say); it counts in no breakdown field."""
        if self._step is not None:
            t = self.clock.mark()
            self._step["spans"].append((name, "mark", lane, t, t, args))

    def end_work(self) -> None:
        """Mark the end of the schedule's part of the step (its last send waited for)."""
        if self._step is not None:
            self._step["work_end"] = self.clock.mark()

    def close_window(self, closing: str | None = None) -> float:
        """End the step's window (after its closing collective); returns and keeps the
        bubble fraction of this rank for the step.

        ``closing``: the name of the span of the step's closing collective when the rank
        did work of its own between the schedule's end (:meth:`end_work`) and that
        collective (the trainer's gradient sync and local norm). The window is then the
        schedule's stretch plus the wait in the closing collective, so a stage that
        finished early still counts the time it waited for the others as idle, and the
        gradient sync does not count as pipeline time."""
        step = self._step
        end = self.clock.mark()
        if closing is not None and "work_end" in step:
            t0, t1 = next((t0, t1) for name, _, _, t0, t1, _ in reversed(step["spans"]) if name == closing)
            window = self.clock.seconds(step["start"], step["work_end"]) + self.clock.seconds(t0, t1)
        else:
            window = self.clock.seconds(step["start"], end)
        per = dict.fromkeys(BUSY, 0.0)
        for _, cat, _, t0, t1, _ in step["spans"]:
            if cat in per:
                per[cat] += self.clock.seconds(t0, t1)
        self.last_shares = {cat: t / window if window > 0 else 0.0 for cat, t in per.items()}
        self.last_bubble = max(0.0, 1.0 - sum(per.values()) / window) if window > 0 else 0.0
        return self.last_bubble

    def step_breakdown(self) -> dict[str, float]:
        """Seconds per span category (forward, backward, wait, optimizer, ...) of the step
        in progress or last closed; spans of one category on different lanes add up."""
        out: dict[str, float] = {}
        for _, cat, _, t0, t1, _ in (self._step or {}).get("spans", []):
            out[cat] = out.get(cat, 0.0) + self.clock.seconds(t0, t1)
        return out

    def step_spans(self) -> list[tuple[str, float, float]]:
        """The current step's spans as ``(cat, t0, t1)`` in seconds from the step's
        beginning (resolves CUDA events: call after the step's work is done)."""
        step = self._step
        if step is None:
            return []
        s, begin = self.clock.seconds, step["begin"]
        return [(cat, s(begin, t0), s(begin, t1)) for _, cat, _, t0, t1, _ in step["spans"]]

    def _finish_step(self) -> None:
        step, self._step = self._step, None
        if step is None or len(self.recorded) >= self.record_steps:
            return
        s = self.clock.seconds
        start = step["start"]
        spans = [(name, cat, lane, s(start, t0), s(start, t1), args)
                 for name, cat, lane, t0, t1, args in step["spans"]]
        self.recorded.append({"step": step["step"], "offset_s": s(self._origin, start), "spans": spans})

    def export(self) -> list[dict]:
        """The recorded steps (picklable), closing the step in progress."""
        self._finish_step()
        return self.recorded


def comm_span(timeline: Timeline | None, name: str):
    """A "comm" span (time blocked in a collective) on ``timeline``, or nothing without one
    (the optimizers hold ``timeline = None`` until the trainer gives them its own)."""
    if timeline is None:
        return contextlib.nullcontext()
    return timeline.span(name, "comm", lane="comm")


def chrome_trace(ranks: list[list[dict]], names: list[str]) -> dict:
    """One Chrome-trace object from every rank's ``Timeline.export()``.

    Step ``s`` of every rank starts at rank 0's offset of step ``s``, or later: never before
    that rank's previous step ended (ranks leave a step's closing collective a little apart,
    so a rank's step can last longer than rank 0's, and its steps would otherwise overlap
    on its own lanes); times in microseconds.
    """
    events: list[dict] = []
    base = {rec["step"]: rec["offset_s"] for rec in ranks[0]} if ranks else {}
    for pid, (recorded, name) in enumerate(zip(ranks, names)):
        previous_end = None
        events.append({"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": name}})
        events.append({"name": "process_sort_index", "ph": "M", "pid": pid, "tid": 0,
                       "args": {"sort_index": pid}})
        for tid, lane in enumerate(LANES):
            events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid,
                           "args": {"name": lane}})
        for rec in recorded:
            offset = base.get(rec["step"], rec["offset_s"])
            if rec["spans"]:
                first = min(t0 for _, _, _, t0, _, _ in rec["spans"])
                if previous_end is not None:
                    offset = max(offset, previous_end - first)
                previous_end = offset + max(t1 for _, _, _, _, t1, _ in rec["spans"])
            for span_name, cat, lane, t0, t1, args in rec["spans"]:
                events.append({
                    "name": span_name, "cat": cat, "ph": "i" if cat == "mark" else "X", "pid": pid,
                    "tid": LANES.index(lane), **({"s": "t"} if cat == "mark" else {}),
                    "ts": round((offset + t0) * 1e6, 3), "dur": round(max(0.0, t1 - t0) * 1e6, 3),
                    "args": {"step": rec["step"], **args},
                })
    # Spans before a step's synchronisation point (data, the sync itself) can start before
    # rank 0's first mark on another rank: move the whole trace so that time starts at 0.
    spans = [e for e in events if e["ph"] in ("X", "i")]
    first = min((e["ts"] for e in spans), default=0.0)
    if first < 0:
        for e in spans:
            e["ts"] = round(e["ts"] - first, 3)
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_trace(timeline: Timeline, path: Path, topo) -> None:
    """Gather every rank's recorded steps to rank 0 and write one trace file there
    (collective over the whole world)."""
    import torch.distributed as dist

    mine = (timeline.export(), topo.describe())
    if dist.is_available() and dist.is_initialized() and topo.world_size > 1:
        gathered = [None] * topo.world_size if topo.rank == 0 else None
        dist.gather_object(mine, gathered, dst=0)
    else:
        gathered = [mine]
    if topo.rank == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        trace = chrome_trace([g[0] for g in gathered], [g[1] for g in gathered])
        path.write_text(json.dumps(trace))
