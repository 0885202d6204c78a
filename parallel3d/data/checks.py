"""Checks of the data a run reads: token ids against the model's vocabulary, and shard
bytes against the sha256 that ``index.json`` records.

**Ids in range** (:class:`IdRangeCheck`). An id at or above the model's vocabulary would
index past the embedding table: on CPU an ``IndexError`` from deep inside
``torch.embedding``, on a GPU a device-side assert that poisons every rank's CUDA
context. Before a step's batch is built (in the loader's background thread), every rank
checks the ids of the *whole global batch*, not only its own slice: every rank then
reaches the same verdict at the same step without any communication, and all of them stop
with the same one-line error (naming the shard file and the offset of the first bad id)
before the forward of that step. The cost is reading every rank's windows instead of
one's own, in the background: ``benchmarks/bench_data_checks.py`` measures it.

**Checksums** (:class:`ShardVerifier`). The shards are split over the ranks (shard ``i``
to rank ``i % world``: each is hashed once per run) and hashed in a background thread.
Small data (at most ``SMALL_DATA_BYTES`` in all) is verified before training starts: each
rank hashes its share and one all-reduce (MAX) over the world tells every rank the result.
Larger data is verified while training runs, agreed over a gloo group of its own (CPU
flags, apart from the training's groups): at the top of each step
(``PrefetchLoader.next``), every rank waits for the previous step's small all-reduce of
[first bad shard + 1, still hashing] (long finished by then) and starts the next, without
blocking; all ranks read the same result at the same step, so a mismatch stops every rank
at that step with an error naming the file, and nobody waits on a rank that left. Once
every rank has finished and all agree, the rounds end. A run shorter than the background
verification ends without its verdict.
"""

from __future__ import annotations

import threading

import numpy as np
import torch
import torch.distributed as dist

from parallel3d.data.format import PreparedDataset, all_shards, file_sha256, shard_mismatch_message
from parallel3d.data.sampler import GlobalBatchSampler
from parallel3d.errors import UserError

SMALL_DATA_BYTES = 256 << 20  # hashed in well under a second per rank: before step 1


class IdRangeCheck:
    """``check(position)``: every id of the global batch starting at sample ``position``
    is below ``vocab_size``, else a :class:`UserError` naming the shard and offset.
    ``windows``: :class:`~parallel3d.data.sampler.TokenWindows` or
    :class:`~parallel3d.data.packing.PackedWindows` (each says what stretch of the token
    stream a sample reads, ``span(i)``)."""

    def __init__(self, windows, sampler: GlobalBatchSampler, vocab_size: int,
                 what: str = "training split"):
        self.windows, self.sampler, self.vocab_size, self.what = windows, sampler, vocab_size, what

    def __call__(self, position: int) -> None:
        tokens = self.windows.tokens
        for i in self.sampler.global_indices_at(position):
            start, length = self.windows.span(i)  # the stretch of the stream sample i reads
            row = tokens[start: start + length]
            if len(row) and int(row.max()) >= self.vocab_size:
                raise UserError(self._message(start + int(np.argmax(row >= self.vocab_size)), row))

    def _message(self, pos: int, row: np.ndarray) -> str:
        tokens = self.windows.tokens
        value = int(tokens[pos: pos + 1][0])
        file, offset = tokens.locate(pos) if hasattr(tokens, "locate") else (None, pos)
        where = (f"data shard '{file}' holds id {value} at token {offset} (byte "
                 f"{offset * row.dtype.itemsize})" if file else
                 f"the {self.what} holds id {value} at token {pos}")
        return (f"{where}, outside the model's vocabulary of {self.vocab_size} (model.vocab_size): "
                "the shard is corrupt or was tokenized for another model; restore it or prepare "
                "the data again")


def _shards(dataset: PreparedDataset) -> list[tuple[str, str, int]]:
    """(file, sha256, bytes) of every file of the dataset (token shards, and the document
    starts and loss masks of format version 2), the same list on every rank."""
    return [(s["file"], s["sha256"], s["num_tokens"] * itemsize) for s, itemsize in all_shards(dataset.index)]


def dataset_bytes(dataset: PreparedDataset) -> int:
    return sum(size for _, _, size in _shards(dataset))


class ShardVerifier:
    """Hashes this rank's share of the shards in a background thread; :meth:`agree_now`
    (blocking) or :meth:`poll` (once per step, on every rank) turn the ranks' results into
    one verdict (module docstring). ``group``: a gloo group over every rank for
    :meth:`poll`; None for one process, or when only :meth:`agree_now` is used."""

    def __init__(self, dataset: PreparedDataset, rank: int, world_size: int, group=None):
        self.dir, self.group = dataset.dir, group
        self.shards = _shards(dataset)
        self.bad = -1  # the first of this rank's shards found changed, by its global index
        self.done = threading.Event()
        self.settled = False
        self._stop = threading.Event()
        self._flags: torch.Tensor | None = None
        self._work = None
        mine = list(range(rank, len(self.shards), world_size))
        self._thread = threading.Thread(target=self._hash, args=(mine,), daemon=True,
                                        name="p3d-verify-shards")
        self._thread.start()

    def _hash(self, mine: list[int]) -> None:
        for k in mine:
            name, want, _ = self.shards[k]
            try:
                got = file_sha256(self.dir / name, self._stop)
            except OSError:
                got = ""
            if got is None:  # closed
                return
            if got != want:
                self.bad = k
                break
        self.done.set()  # after self.bad: a reader that sees done sees the final bad

    def _raise(self, bad_plus_one: int) -> None:
        self.settled = True
        raise UserError(shard_mismatch_message(self.dir / self.shards[bad_plus_one - 1][0]))

    def _status(self) -> torch.Tensor:
        busy = not self.done.is_set()  # read before bad (see _hash)
        return torch.tensor([self.bad + 1, int(busy)], dtype=torch.int64)

    def agree_now(self, device: torch.device | None = None) -> None:
        """Wait for this rank's hashing, agree with every rank (over ``group``, else the
        world's default group with the flags on ``device``), raise on a mismatch."""
        self.done.wait()
        flags = self._status()
        if self.group is not None:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group)
        elif dist.is_initialized() and dist.get_world_size() > 1:
            on_device = flags.to(device or torch.device("cpu"))
            dist.all_reduce(on_device, op=dist.ReduceOp.MAX)
            flags = on_device.cpu()
        if flags[0]:
            self._raise(int(flags[0]))
        self.settled = True

    def poll(self) -> None:
        """Once per step on every rank: read the verdict of the round started at the
        previous step, raise on a mismatch, start the next round while any rank hashes."""
        if self.settled:
            return
        if self.group is None:
            flags = self._status()
            if flags[0]:
                self._raise(int(flags[0]))
            self.settled = not flags[1]
            return
        if self._work is not None:
            self._work.wait()
            self._work = None
            bad, busy = (int(v) for v in self._flags)
            if bad:
                self._raise(bad)
            if not busy:
                self.settled = True
                return
        self._flags = self._status()
        self._work = dist.all_reduce(self._flags, op=dist.ReduceOp.MAX, group=self.group, async_op=True)

    def close(self) -> None:
        """Stop hashing (the thread ends within one 16 MiB block)."""
        self._stop.set()
