"""Flat-buffer layout of the sharded optimizer: parameters packed into buckets.

A rank's parameters (whatever tensor and pipeline parallelism left on it) are packed, in
reverse registration order, into buckets of about ``bucket_numel`` elements. Reverse order
because the backward pass produces gradients roughly in that order: the first bucket fills
first, so its communication can start while earlier layers are still differentiating.

Each bucket is padded so that it splits into ``dp`` equal shards whose length is a
multiple of :data:`SHARD_ALIGN` elements::

    bucket b (numel N_b, divisible by dp * SHARD_ALIGN)
    | p7 | p6 | p5 ......... | pad |
    |  rank 0  |  rank 1  |  ...  |      shard length N_b / dp; a parameter may straddle
                                         a shard boundary (its halves live on two ranks)

Data-parallel rank r owns ``[r * N_b/dp, (r+1) * N_b/dp)`` of every bucket: its fp32
master weights, Adam moments (and, at stage 2, its gradients) for that range only. This
module is pure index arithmetic, no tensors and no process groups, so it is easy to test.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Every shard starts on a multiple of 16 elements (64 bytes in fp32, 32 in bf16), so the
# per-rank pieces handed to reduce-scatter and all-gather stay 16-byte aligned, which
# NCCL's vectorized copies want. Costs at most dp * 16 - 1 padding elements per bucket.
SHARD_ALIGN = 16


@dataclass(frozen=True)
class Segment:
    """Parameter ``index`` occupies ``[start, start + numel)`` of its bucket."""

    index: int
    start: int
    numel: int

    @property
    def end(self) -> int:
        return self.start + self.numel


@dataclass(frozen=True)
class Run:
    """A contiguous range ``[lo, hi)`` of a shard (shard coordinates) whose parameters
    share one property (weight decay on or off; counted in the norm or not)."""

    lo: int
    hi: int
    flag: bool


@dataclass
class Bucket:
    index: int
    offset: int  # where the bucket starts in the rank's whole flat parameter buffer
    numel: int  # padded length, divisible by dp * SHARD_ALIGN
    segments: list[Segment] = field(default_factory=list)
    dp: int = 1

    @property
    def data_numel(self) -> int:
        return self.segments[-1].end if self.segments else 0

    @property
    def padding(self) -> int:
        return self.numel - self.data_numel

    @property
    def shard_numel(self) -> int:
        return self.numel // self.dp

    def shard_range(self, dp_rank: int) -> tuple[int, int]:
        """``[lo, hi)`` of rank ``dp_rank``'s shard, in bucket coordinates."""
        return dp_rank * self.shard_numel, (dp_rank + 1) * self.shard_numel

    def shard_pieces(self, dp_rank: int) -> list[tuple[Segment, int, int]]:
        """The parts of parameters inside ``dp_rank``'s shard: ``(segment, lo, hi)`` with
        ``[lo, hi)`` in shard coordinates (0 = first element of the shard)."""
        s_lo, s_hi = self.shard_range(dp_rank)
        out = []
        for seg in self.segments:
            lo, hi = max(seg.start, s_lo), min(seg.end, s_hi)
            if lo < hi:
                out.append((seg, lo - s_lo, hi - s_lo))
        return out

    def shard_runs(self, dp_rank: int, flag_of) -> list[Run]:
        """Cover ``dp_rank``'s shard with maximal runs of equal ``flag_of(param_index)``.

        Padding joins whichever run touches it (its values are zero and stay zero), so a
        shard whose parameters all share the flag is a single run."""
        runs: list[Run] = []
        pieces = self.shard_pieces(dp_rank)
        for seg, lo, hi in pieces:
            flag = bool(flag_of(seg.index))
            if runs and runs[-1].flag == flag:
                runs[-1] = Run(runs[-1].lo, hi, flag)
            else:
                runs.append(Run(runs[-1].hi if runs else 0, hi, flag))
        if not runs:
            return [Run(0, self.shard_numel, False)]  # all padding
        last = runs[-1]
        runs[-1] = Run(last.lo, self.shard_numel, last.flag)
        return runs


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


class BucketLayout:
    """Packs parameters of the given element counts into dp-divisible buckets.

    ``numels[i]`` is the size of parameter i (registration order). Buckets are filled in
    reverse order of i; a bucket is closed before a parameter that would push it past
    ``bucket_numel`` (a parameter larger than that gets a bucket of its own). Parameters
    in ``alone`` always get a bucket of their own: a tied embedding, whose two holders
    (first and last pipeline stage, different layouts otherwise) must shard it alike.
    """

    def __init__(self, numels: list[int], bucket_numel: int, dp: int, alone=()):
        if dp < 1 or bucket_numel < 1:
            raise ValueError(f"dp ({dp}) and bucket_numel ({bucket_numel}) must be positive")
        self.dp = dp
        self.numels = list(numels)
        self.buckets: list[Bucket] = []
        self.location: dict[int, tuple[int, Segment]] = {}  # param index -> (bucket, seg)
        current: list[int] = []
        size = 0
        for i in reversed(range(len(numels))):
            if current and (size + numels[i] > bucket_numel or i in alone):
                self._close(current)
                current, size = [], 0
            current.append(i)
            size += numels[i]
            if i in alone:
                self._close(current)
                current, size = [], 0
        if current:
            self._close(current)

    def _close(self, indices: list[int]) -> None:
        offset = self.buckets[-1].offset + self.buckets[-1].numel if self.buckets else 0
        bucket = Bucket(index=len(self.buckets), offset=offset, numel=0, dp=self.dp)
        start = 0
        for i in indices:
            seg = Segment(i, start, self.numels[i])
            bucket.segments.append(seg)
            self.location[i] = (bucket.index, seg)
            start += self.numels[i]
        bucket.numel = _round_up(max(start, 1), self.dp * SHARD_ALIGN)
        self.buckets.append(bucket)

    @property
    def numel(self) -> int:
        """Length of the whole flat buffer (every bucket, padding included)."""
        return sum(b.numel for b in self.buckets)

    @property
    def shard_numel(self) -> int:
        """Elements one rank owns: the sum of its shard of every bucket."""
        return self.numel // self.dp

    @property
    def padding(self) -> int:
        return sum(b.padding for b in self.buckets)

    def shard_offsets(self) -> list[int]:
        """Where each bucket's shard starts in a rank's concatenated shard buffer."""
        out, at = [], 0
        for b in self.buckets:
            out.append(at)
            at += b.shard_numel
        return out
