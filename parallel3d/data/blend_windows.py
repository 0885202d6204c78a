"""The windows of a blend: each source's :class:`~parallel3d.data.packing.PackedWindows`
side by side in one index space, and the checks of a ``[[data.blend]]`` list.

Sample ``offsets[k] + j`` is window ``j`` of source ``k``. Every source is read as
:class:`PackedWindows` (plain text under "concat" too: every target trained on, no
positions), so every micro-batch is a :class:`~parallel3d.data.batch.MicroBatch` with a
loss divisor, whatever the sources' kinds, and it carries ``sources`` (B,): the source of
each row, for per-source losses. ``tokens`` is every source's split read as one stream
(what :class:`~parallel3d.data.checks.IdRangeCheck` reads, naming a bad shard's file).
"""

from __future__ import annotations

import numpy as np
import torch

from parallel3d.data.batch import MicroBatch, document_spans
from parallel3d.data.format import TokenStream
from parallel3d.errors import UserError


def check_blend(blend) -> None:
    """One-line errors for a bad ``data.blend`` (a list of BlendSourceConfig)."""
    names = []
    for i, src in enumerate(blend):
        where = f"data.blend[{i}]"
        if not src.name or not src.name.replace("_", "").replace("-", "").isalnum():
            raise UserError(f"{where}.name {src.name!r} must be a non-empty name of letters, digits, "
                            "'-' or '_' (it becomes the metric loss/<name>)")
        if src.name in names:
            raise UserError(f"{where}.name '{src.name}' is used twice: give each source its own name")
        names.append(src.name)
        if not src.path:
            raise UserError(f"{where} ('{src.name}') has no path: set it to a prepare-data --out directory")
        if not (src.weight > 0 and np.isfinite(src.weight)):
            raise UserError(f"{where}.weight of '{src.name}' must be a positive number, got {src.weight}")


def check_same_tokens(names: list[str], datasets) -> None:
    """Every source's ids must mean the same tokens: the same tokenizer file and EOS."""
    first = datasets[0]
    for name, ds in zip(names[1:], datasets[1:]):
        for what, a, b in (("tokenizer", first.index.get("tokenizer", {}).get("sha256"),
                            ds.index.get("tokenizer", {}).get("sha256")), ("EOS id", first.eos_id, ds.eos_id)):
            if a != b:
                raise UserError(f"data.blend: '{name}' ({ds.dir}) was tokenized with another {what} than "
                                f"'{names[0]}' ({first.dir}): prepare every source with the same --tokenizer")
    fingerprints = [ds.fingerprint for ds in datasets]
    for i, f in enumerate(fingerprints):
        if f in fingerprints[:i]:
            raise UserError(f"data.blend: '{names[i]}' and '{names[fingerprints.index(f)]}' are the same "
                            "data: give it one entry with the summed weight")


def _stream(windows) -> TokenStream:
    tokens = windows.tokens
    return tokens if isinstance(tokens, TokenStream) else TokenStream([np.asarray(tokens)])


class BlendedWindows:
    """The samples of every source (see the module docstring); ``windows`` are
    :class:`PackedWindows` of one seq_len and one packing."""

    def __init__(self, names: list[str], windows: list):
        self.names, self.sources = list(names), list(windows)
        self.seq_len = windows[0].seq_len
        sizes = [w.num_samples for w in windows]
        self.offsets = np.cumsum([0] + sizes)  # source k: [offsets[k], offsets[k+1])
        self.num_samples = int(self.offsets[-1])
        streams = [_stream(w) for w in windows]
        self.token_offsets = np.cumsum([0] + [len(s) for s in streams])
        self.tokens = TokenStream([shard for s in streams for shard in s.shards])

    def locate(self, i: int) -> tuple[int, int]:
        """(source, its window) of sample ``i``."""
        k = int(np.searchsorted(self.offsets, i, side="right")) - 1
        return k, i - int(self.offsets[k])

    def span(self, i: int) -> tuple[int, int]:
        """(start in :attr:`tokens`, length) of what sample ``i`` reads."""
        k, j = self.locate(i)
        start, length = self.sources[k].span(j)
        return int(self.token_offsets[k]) + start, length

    def supervised(self, indices) -> int:
        return sum(self.sources[k].supervised([j]) for k, j in map(self.locate, indices))

    def source_ids(self, indices) -> torch.Tensor:
        """(len(indices),) int64: each sample's source."""
        return torch.tensor([self.locate(i)[0] for i in indices], dtype=torch.int64)

    def micro_batch(self, indices: list[int], loss_divisor: float | None) -> MicroBatch:
        rows = [self.sources[k].sample(j) for k, j in map(self.locate, indices)]
        ids, targets, positions = zip(*rows)
        x = torch.from_numpy(np.stack(ids)[:, :-1].copy())
        y = torch.from_numpy(np.stack(targets))
        sources = self.source_ids(indices)
        if positions[0] is None:
            return MicroBatch(x, y, None, loss_divisor, sources=sources)
        pos = torch.from_numpy(np.stack(positions))
        return MicroBatch(x, y, pos, loss_divisor, *document_spans(pos), sources=sources)
