"""Non-finite steps and loss spikes.

The decision to drop a step must be the same on every rank, or the ranks' weights drift
apart. Both signals the trainer uses already are: the step's loss is summed over the
pipeline group and averaged over the data-parallel group (tensor-parallel ranks compute
the same vocab-parallel loss), and the gradient norm is all-reduced over the whole model
(both optimizers). A NaN on any rank's gradient reaches the norm of every rank through
those all-reduces, so checking these two scalars costs no extra collective.
"""

from __future__ import annotations

import math
from collections import deque


class TrainingStopped(RuntimeError):
    """``reliability.on_nonfinite = "stop"`` ended the run; the message says why."""


def nonfinite_reason(loss: float, grad_norm: float) -> str | None:
    """``None`` when both are finite, else e.g. ``"loss nan, grad norm inf"``."""
    bad = [f"{name} {value}" for name, value in (("loss", loss), ("grad norm", grad_norm))
           if not math.isfinite(value)]
    return ", ".join(bad) or None


class LossSpikeDetector:
    """Flags a loss above ``factor`` times the mean of the last ``window`` finite losses.

    Nothing is flagged until the window holds ``min(window, 5)`` losses (the first steps
    fall fast and have no meaningful average); ``factor <= 0`` disables the check. A
    spike is still added to the window, so a lasting level shift stops being flagged
    once it dominates the mean."""

    def __init__(self, factor: float, window: int):
        self.factor = factor
        self.recent: deque[float] = deque(maxlen=window)

    def update(self, loss: float) -> float | None:
        """Add ``loss``; return the window mean it exceeded, or ``None``."""
        if not math.isfinite(loss):
            return None
        mean = sum(self.recent) / len(self.recent) if self.recent else 0.0
        ready = len(self.recent) >= min(self.recent.maxlen, 5)
        self.recent.append(loss)
        if self.factor > 0 and ready and loss > self.factor * mean:
            return mean
        return None


class StepGuard:
    """A step's numbers judged after its one all-reduce (the same on every rank): a
    non-finite loss or gradient norm is counted and either tolerated (``on_nonfinite =
    "skip"``: the optimizer already changed no weight) or ends the run (``"stop"``: after
    ``on_stop()``, the checkpoint hook, when set); a finite loss above the spike detector's
    bar is flagged. Warnings go to ``warn`` (rank 0's stderr)."""

    def __init__(self, on_nonfinite: str, spike_factor: float, spike_window: int, warn):
        self.on_nonfinite, self.warn = on_nonfinite, warn
        self.spikes = LossSpikeDetector(spike_factor, spike_window)
        self.skipped_steps = 0

    def check(self, step: int, loss: float, grad_norm: float, on_stop=None, batch: str = "") -> dict:
        """The record's fields for step ``step``; ``batch`` names the step's samples in a
        spike's warning."""
        reason = nonfinite_reason(loss, grad_norm)
        spike_mean = None if reason else self.spikes.update(loss)
        if reason:
            self.skipped_steps += 1
            if self.on_nonfinite == "stop":
                saved = ""
                if on_stop is not None:
                    on_stop()
                    saved = " (saved by the checkpoint hook)"
                raise TrainingStopped(
                    f"step {step}: non-finite {reason}; stopped with the weights after step "
                    f"{step - 1}{saved} (reliability.on_nonfinite=stop): lower train.lr, "
                    "check the data, or set reliability.on_nonfinite=skip")
            self.warn(f"step {step}: non-finite {reason}: update skipped ({self.skipped_steps} skipped so far)")
        elif spike_mean is not None:
            self.warn(f"step {step}: loss spike {loss:.4f} > {self.spikes.factor:g} x {spike_mean:.4f} "
                      f"(mean of the previous {len(self.spikes.recent) - 1} steps){batch}")
        return {"skipped": reason is not None, "skipped_steps": self.skipped_steps,
                "loss_spike": spike_mean is not None}
