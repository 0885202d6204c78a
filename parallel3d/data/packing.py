"""Windows of documents packed without leaks: positions per document, targets masked.

``data.packing`` chooses how a split's documents become training windows of ``S + 1``
tokens (inputs ``[:-1]``, targets ``[1:]``):

* ``concat``: windows cut every S tokens from the stream; a token attends to everything
  before it in the window, across documents (:class:`~parallel3d.data.sampler.TokenWindows`,
  plain text's default). Chat data under ``concat`` still trains only on its mask.
* ``documents``: the same windows, but each document in a window (and the piece of one
  that the window starts inside) restarts its positions at 0 and attends only within
  itself; a document's first token is not a target (nothing before it in its document
  predicts it).
* ``whole``: windows hold whole documents, packed in order while they fit in S + 1
  tokens, the rest padded (padding is its own segment and no target); a document longer
  than a window is cut into window-sized pieces (each piece's first token is the previous
  piece's last target, as in ``concat``). Positions and attention as in ``documents``.
  Chat data's default: a conversation is seen with its prompt.

A window of :class:`PackedWindows` is a span ``[start, start + length)`` of the stream,
``length <= S + 1``. Its targets hold ``IGNORE_INDEX`` where not trained on: outside the
loss mask (chat), at a document's first token, past the span. :meth:`supervised` counts
the targets trained on without reading any token, so every rank can count a whole
global batch (the loss divisor) from the sampler alone.
"""

from __future__ import annotations

import numpy as np
import torch

from parallel3d.data.batch import IGNORE_INDEX, MicroBatch, document_spans
from parallel3d.errors import UserError

PACKINGS = ("auto", "concat", "documents", "whole")


def whole_document_spans(starts: np.ndarray, n_tokens: int, seq_len: int) -> np.ndarray:
    """(windows, 2) int64 [start, length]: documents packed greedily in order into windows of
    at most ``seq_len + 1`` tokens; a document longer than that is cut into pieces of
    ``seq_len + 1`` overlapping by one token. Windows of a single token (no target) are
    left out."""
    ends = np.append(starts[1:], n_tokens).astype(np.int64)
    spans, cur = [], int(starts[0]) if len(starts) else 0
    while cur < n_tokens - 1:
        limit = cur + seq_len + 1
        k = int(np.searchsorted(ends, limit, side="right")) - 1  # the last document end <= limit
        if k >= 0 and ends[k] > cur:
            end, nxt = int(ends[k]), int(ends[k])
        else:  # the document at cur is longer than a window: cut it
            end = min(limit, n_tokens)
            nxt = end - 1 if end < n_tokens else end
        if end - cur > 1:
            spans.append((cur, end - cur))
        cur = nxt
    return np.asarray(spans, dtype=np.int64).reshape(-1, 2)


class PackedWindows:
    """Training samples with a loss mask and (unless ``separate=False``) per-document
    positions. ``tokens`` and ``mask`` are sliceable streams (a
    :class:`~parallel3d.data.format.TokenStream`); ``starts`` the sorted document starts."""

    def __init__(self, tokens, seq_len: int, *, starts: np.ndarray | None = None, mask=None,
                 separate: bool = True, whole: bool = False, pad_id: int = 0, what: str = "corpus"):
        if (separate or whole) and starts is None:
            raise ValueError("packing by document needs the document starts")
        self.tokens, self.seq_len, self.mask, self.pad_id = tokens, seq_len, mask, pad_id
        self.starts = None if starts is None else np.asarray(starts, dtype=np.int64)
        self.separate = separate or whole
        self.spans = whole_document_spans(self.starts, len(tokens), seq_len) if whole else None
        self.num_samples = len(self.spans) if whole else max(0, (len(tokens) - 1) // seq_len)
        if self.num_samples < 1:
            raise UserError(f"{what} of {len(tokens)} tokens is shorter than train.seq_len {seq_len} + 1")

    def span(self, i: int) -> tuple[int, int]:
        if self.spans is not None:
            start, length = self.spans[i]
            return int(start), int(length)
        return i * self.seq_len, self.seq_len + 1

    def _layout(self, i: int) -> tuple[int, int, np.ndarray, np.ndarray | None]:
        """(start, length, trained (S+1,) bool per token of the window, segment starts
        (S,) bool per input or None): everything but the token ids."""
        S = self.seq_len
        start, length = self.span(i)
        trained = np.zeros(S + 1, dtype=bool)
        trained[1:length] = True  # token k is the target of input k - 1
        if self.mask is not None:
            trained[:length] &= np.asarray(self.mask[start:start + length], dtype=bool)
        if not self.separate:
            return start, length, trained, None
        lo, hi = np.searchsorted(self.starts, [start, start + length])
        first = self.starts[lo:hi] - start  # document starts inside the window
        trained[first] = False
        segment = np.zeros(S, dtype=bool)
        segment[0] = True
        segment[first[first < S]] = True
        if length < S:
            segment[length] = True  # the padding inputs are a segment of their own
        return start, length, trained, segment

    def sample(self, i: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """(token ids (S+1,), targets (S,) with IGNORE_INDEX, positions (S,) or None)."""
        S = self.seq_len
        start, length, trained, segment = self._layout(i)
        ids = np.full(S + 1, self.pad_id, dtype=np.int64)
        ids[:length] = self.tokens[start:start + length]
        targets = np.where(trained[1:], ids[1:], IGNORE_INDEX)
        positions = None
        if segment is not None:
            index = np.arange(S)
            positions = index - np.maximum.accumulate(np.where(segment, index, 0))
        return ids, targets, positions

    def supervised(self, indices) -> int:
        """How many targets of samples ``indices`` are trained on (reads no token)."""
        return int(sum(self._layout(i)[2][1:].sum() for i in indices))

    def micro_batch(self, indices: list[int], loss_divisor: float | None) -> MicroBatch:
        ids, targets, positions = zip(*(self.sample(i) for i in indices))
        x = torch.from_numpy(np.stack(ids)[:, :-1].copy())
        if positions[0] is None:
            return MicroBatch(x, torch.from_numpy(np.stack(targets)), None, loss_divisor)
        pos = torch.from_numpy(np.stack(positions))
        return MicroBatch(x, torch.from_numpy(np.stack(targets)), pos, loss_divisor, *document_spans(pos))
