"""Data stalls measured and named: is the run waiting for its batches, and by how much?

The loader (:class:`~parallel3d.data.loader.PrefetchLoader`) tells :class:`StallMonitor`
three numbers per step: how long ``next()`` blocked for the batch (the step's
``data_wait_s``), the time from the previous ``next()`` to this one (a whole step:
wait, compute and everything between), and how long its background thread took to build
the batch (reading the shards, packing, the id check). Over the last ``window`` steps:

    share = sum(wait) / sum(step)            the part of the run spent waiting for data
    compute = mean(step - wait)              what a step costs without its wait

The run is **data-bound** when ``share >= threshold`` (5%): then the monitor returns one
line for the console (at most every ``window`` steps): the share, the wait and the
step in milliseconds, the batch's build time, and what to do about it:

* a batch builds faster than a step computes on average (``build < compute``): prefetch can
  hide it, the queue was too short for the slow batches; :func:`prefetch_for` sizes the
  queue from the measured costs, ``ceil(slowest build / compute) + 1`` steps ahead, and the
  loader raises its depth to that (up to :data:`MAX_PREFETCH`) and says so;
* it builds slower: no queue depth hides it (one builder thread delivers one batch per
  ``build`` seconds); the data path itself must get faster (shards on a local disk,
  fewer, larger reads), and the share is what the run loses to it.
"""

from __future__ import annotations

import collections
import math

DATA_BOUND_SHARE = 0.05  # below it, waiting for data is noise beside a step's own jitter
MAX_PREFETCH = 8  # the loader raises its queue up to this many steps of batches


def prefetch_for(build_s: float, compute_s: float) -> int:
    """Steps of batches to build ahead so that one builder hides a batch costing ``build_s``
    behind steps computing ``compute_s``: the batches one step's compute covers, plus one
    for jitter."""
    return max(1, math.ceil(build_s / max(compute_s, 1e-6)) + 1)


class StallMonitor:
    def __init__(self, depth: int, window: int = 20, threshold: float = DATA_BOUND_SHARE):
        self.depth, self.window, self.threshold = depth, window, threshold
        self.steps: collections.deque = collections.deque(maxlen=window)  # (wait, step)
        self.builds: collections.deque = collections.deque(maxlen=window)
        self._since_said = window  # steps since the last line (say it at once the first time)

    def built(self, seconds: float) -> None:
        """A batch took ``seconds`` to build (any thread)."""
        self.builds.append(seconds)

    def figures(self) -> dict:
        """share, wait_s (mean), step_s (mean), compute_s (mean), build_s (mean) over the
        window; empty before two steps."""
        if len(self.steps) < 2:
            return {}
        wait = sum(w for w, _ in self.steps)
        step = sum(s for _, s in self.steps)
        n = len(self.steps)
        build = sum(self.builds) / len(self.builds) if self.builds else 0.0
        return {"share": wait / step if step > 0 else 0.0, "wait_s": wait / n, "step_s": step / n,
                "compute_s": (step - wait) / n, "build_s": build, "build_max_s": max(self.builds, default=0.0)}

    def wanted_depth(self, f: dict) -> int | None:
        """The queue depth that hides the measured builds, when a deeper queue can (the
        mean build is shorter than a step's compute); None when none can."""
        if f["build_s"] >= f["compute_s"]:
            return None
        return prefetch_for(max(f["build_max_s"], f["build_s"]), f["compute_s"])

    def step(self, wait_s: float, step_s: float | None) -> str | None:
        """Record a step; the console line when the run is data-bound (at most once every
        ``window`` steps), else None. ``step_s`` None: the first step (no previous one)."""
        if step_s is None:
            return None
        self.steps.append((wait_s, step_s))
        self._since_said += 1
        f = self.figures()
        if not f or len(self.steps) < min(self.window, 5) or f["share"] < self.threshold:
            return None
        if self._since_said < self.window:
            return None
        self._since_said = 0
        return self.line(f)

    def line(self, f: dict) -> str:
        head = (f"data-bound: {f['share']:.0%} of the last {len(self.steps)} steps waited for data "
                f"({f['wait_s'] * 1e3:.0f} ms of {f['step_s'] * 1e3:.0f} ms a step); a batch takes "
                f"{f['build_s'] * 1e3:.0f} ms to build, a step computes {f['compute_s'] * 1e3:.0f} ms")
        want = self.wanted_depth(f)
        if want is not None:
            if want > self.depth:
                return head + f": raise data.prefetch from {self.depth} to {want}"
            return head + f": data.prefetch {self.depth} should hide it; the reads are uneven (slow storage?)"
        return (head + ": prefetch cannot hide a batch slower than a step; make the reads faster "
                "(shards on local disk) or the step longer (a larger micro-batch)")
