"""One micro-batch as the pipeline schedule takes it.

Plain text windows are ``(inputs, targets)`` pairs: every target is trained on and each
micro-batch's loss is its mean, divided by the number of micro-batches (all micro-batches
hold the same number of targets, so that is the mean over the global batch).

Chat data and packed documents need more, carried by :class:`MicroBatch`:

* ``targets`` hold :data:`IGNORE_INDEX` where a token is not trained on (a user turn, a
  document's first token, padding);
* ``positions`` (B, S), the position of each token inside its document, go to every
  pipeline chunk: each restarts the rotation and keeps attention inside the document;
* ``loss_divisor``: the supervised targets of the whole global batch divided by dp. The
  last stage sums the per-token losses of the micro-batch and divides by it, so the
  step's loss (summed over micro-batches, averaged over dp ranks as the gradients are) is
  the mean over every supervised token of the global batch, whatever the split into
  micro-batches, stages and ranks. Every rank computes it from the sampler for the whole
  global batch (``PackedWindows.supervised``): no collective.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

IGNORE_INDEX = -100  # a target not trained on: torch's F.cross_entropy default


@dataclass
class MicroBatch:
    inputs: torch.Tensor  # (B, S) token ids
    targets: torch.Tensor  # (B, S) next-token ids, IGNORE_INDEX where not trained on
    positions: torch.Tensor | None = None  # (B, S) position within the document; None: 0..S-1
    loss_divisor: float | None = None  # supervised targets of the global batch / dp

    def to(self, device, non_blocking: bool = False) -> "MicroBatch":
        move = (lambda t: None if t is None else t.to(device, non_blocking=non_blocking))
        return MicroBatch(move(self.inputs), move(self.targets), move(self.positions), self.loss_divisor)

    def pin_memory(self) -> "MicroBatch":
        pin = (lambda t: None if t is None else t.pin_memory())
        return MicroBatch(pin(self.inputs), pin(self.targets), pin(self.positions), self.loss_divisor)
