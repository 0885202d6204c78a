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
  device-to-host read to size itself;
* ``token_keys`` (B, S) int64: each token's place in the run's token stream
  (:func:`stream_token_keys`), only when something draws per-token randomness from it
  (LoRA's dropout, ``lora/dropout.py``). The pipeline runtime makes them current while
  it runs the micro-batch's forward, backward (recomputation included) or W
  (:func:`running`); a validation batch has none.
"""

from __future__ import annotations

import contextlib
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
    token_keys: torch.Tensor | None = None  # (B, S) int64: each token's place in the token stream

    def _map(self, fn) -> "MicroBatch":
        keep = (lambda t: None if t is None else fn(t))
        return MicroBatch(keep(self.inputs), keep(self.targets), keep(self.positions), self.loss_divisor,
                          keep(self.cu_seqlens), self.max_doc_len, keep(self.sources), keep(self.token_keys))

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


def stream_token_keys(first_sample: int, rows: int, seq_len: int) -> torch.Tensor:
    """(rows, seq_len) int64: the token keys of ``rows`` consecutive samples of the
    sampler's stream from ``first_sample`` on, windows of ``seq_len`` tokens: sample
    position x window length + index in the window (unique over the run, whatever the
    layout, and the same after a resume)."""
    first = torch.arange(first_sample, first_sample + rows, dtype=torch.int64) * seq_len
    return first[:, None] + torch.arange(seq_len, dtype=torch.int64)


_CURRENT_KEYS: list = [None]  # the token keys of the micro-batch being run (single-threaded)


def current_token_keys() -> torch.Tensor | None:
    """The token keys of the micro-batch whose action the pipeline runs now (None outside
    one, or when its batch carries none)."""
    return _CURRENT_KEYS[0]


@contextlib.contextmanager
def running(mb):
    """Make ``mb``'s token keys current for the enclosed forward, backward or W."""
    saved, _CURRENT_KEYS[0] = _CURRENT_KEYS[0], getattr(mb, "token_keys", None)
    try:
        yield
    finally:
        _CURRENT_KEYS[0] = saved


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
