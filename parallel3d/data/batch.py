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
  global batch (``PackedWindows.supervised``): no collective;
* ``sources`` (B,): the ``data.blend`` source of each row (a window holds one source's
  tokens only), from which per-source losses are summed;
* ``cu_seqlens`` / ``max_doc_len``: the same documents as spans of the B*S flattened
  tokens (int32 starts and the total, the longest span), computed on the host with the
  batch (:func:`document_spans`) so that a GPU's variable-length attention kernel needs no
  device-to-host read to size itself.
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
    cu_seqlens: torch.Tensor | None = None  # (N+1,) int32: document starts over B*S, then B*S
    max_doc_len: int | None = None  # the longest document span (host int)
    sources: torch.Tensor | None = None  # (B,) int64: each row's data.blend source; None: one dataset

    def _map(self, fn) -> "MicroBatch":
        keep = (lambda t: None if t is None else fn(t))
        return MicroBatch(keep(self.inputs), keep(self.targets), keep(self.positions), self.loss_divisor,
                          keep(self.cu_seqlens), self.max_doc_len, keep(self.sources))

    def to(self, device, non_blocking: bool = False) -> "MicroBatch":
        """On ``device``; off the CPU the positions keep their host copy as
        ``positions.p3d_host``: what is decided from them in Python (context parallelism's
        document blocks) reads it, not the device (no wait for the device in a forward)."""
        out = self._map(lambda t: t.to(device, non_blocking=non_blocking))
        if self.positions is not None and out.positions.device.type != "cpu":
            out.positions.p3d_host = self.positions
        return out

    def pin_memory(self) -> "MicroBatch":
        return self._map(lambda t: t.pin_memory())

    def chunk_kwargs(self) -> dict:
        """What every pipeline chunk takes besides its input: the documents' positions
        and spans (nothing for one causal sequence per row)."""
        if self.positions is None:
            return {}
        side = {"positions": self.positions}
        if self.cu_seqlens is not None:
            side.update(cu_seqlens=self.cu_seqlens, max_doc_len=self.max_doc_len)
        return side


def document_spans(positions: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(cu_seqlens, longest) of the documents of positions (B, S) (a document starts where
    its position is 0, and every row starts one), over the B*S tokens in memory order:
    int32 ``[start_0, start_1, ..., B*S]``. The segments are exactly :func:`document_mask`'s
    (``models/llama/model.py``); call it on the host."""
    first = positions == 0
    first[:, 0] = True  # a row is a window of its own, whatever position it starts at
    starts = torch.nonzero(first.reshape(-1)).reshape(-1)
    cu = torch.cat([starts, torch.tensor([positions.numel()])]).to(torch.int32)
    return cu, int((cu[1:] - cu[:-1]).max())
