"""What ``prepare-data`` shows: progress while it runs and the summary at the end."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from pathlib import Path


class Progress:
    """A tqdm bar when stderr is a terminal and tqdm is installed, else a line every
    ``every_s`` seconds; ``enabled=False`` prints nothing."""

    def __init__(self, total_bytes: int, enabled: bool = True, every_s: float = 10.0):
        self.total, self.done, self.tokens = total_bytes, 0, 0
        self.resumed = 0  # input bytes an interrupted run had finished (not timed here)
        self.enabled, self.every_s = enabled, every_s
        self.t0 = self._last = time.perf_counter()
        self.bar = None
        if enabled and sys.stderr.isatty():
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total_bytes, unit="B", unit_scale=True, desc="prepare-data",
                                file=sys.stderr)
            except ImportError:
                pass

    def update(self, disk_bytes: int, tokens: int) -> None:
        self.done += disk_bytes
        self.tokens += tokens
        if self.bar is not None:
            if self.bar.n < self.done - disk_bytes:  # a resumed run starts where it was
                self.bar.update(self.done - disk_bytes - self.bar.n)
            self.bar.update(disk_bytes)
            return
        now = time.perf_counter()
        if self.enabled and now - self._last >= self.every_s:
            self._last = now
            print(self.line(now), file=sys.stderr, flush=True)

    def line(self, now: float) -> str:
        """``prepare-data: 42% (840.0 of 2000.0 MB), 6.10 MB/s, 1,900,000 tokens/s, 3m10s left``:
        the rate of this run's own bytes (a resumed run's earlier ones left out)."""
        dt = max(now - self.t0, 1e-9)
        rate = (self.done - self.resumed) / dt
        left = (self.total - self.done) / rate if rate > 0 else float("inf")
        eta = "?" if left == float("inf") else _duration(left)
        return (f"prepare-data: {100 * self.done / max(1, self.total):.0f}% "
                f"({self.done / 1e6:.1f} of {self.total / 1e6:.1f} MB), {rate / 1e6:.2f} MB/s, "
                f"{self.tokens / dt:,.0f} tokens/s, {eta} left")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _duration(s: float) -> str:
    s = int(round(s))
    return f"{s // 3600}h{s // 60 % 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


@dataclass
class PrepareReport:
    out: Path
    num_files: int
    disk_bytes: int  # input bytes on disk (compressed size for .gz)
    text_bytes: int  # UTF-8 bytes of the documents
    seconds: float
    workers: int
    docs: dict[str, int] = field(default_factory=dict)  # per split
    tokens: dict[str, int] = field(default_factory=dict)
    shards: dict[str, int] = field(default_factory=dict)
    dropped: dict[str, int] = field(default_factory=dict)  # chat: conversations left out, by reason
    supervised: int = 0  # chat: tokens trained on (both splits)
    resumed_bytes: int = 0  # input an interrupted run had finished (its shards kept)

    @property
    def mb_per_s(self) -> float:
        """This run's own input bytes per second (a resumed run's earlier ones left out)."""
        return (self.disk_bytes - self.resumed_bytes) / 1e6 / self.seconds

    @property
    def tokens_per_s(self) -> float:
        return sum(self.tokens.values()) / self.seconds

    def summary(self) -> str:
        docs, toks = sum(self.docs.values()), sum(self.tokens.values())
        shards = sum(self.shards.values())
        return (f"prepared {docs:,} documents ({self.docs['train']:,} train, {self.docs['val']:,} val), "
                f"{toks:,} tokens in {shards} shard{'s' * (shards != 1)} from {self.num_files} "
                f"file{'s' * (self.num_files != 1)}, {self.disk_bytes / 1e6:.1f} MB on disk "
                f"({self.text_bytes / 1e6:.1f} MB of text) in {self.seconds:.1f} s: "
                f"{self.mb_per_s:.2f} MB/s, {self.tokens_per_s:,.0f} tokens/s "
                f"({self.workers} worker{'s' * (self.workers != 1)}) -> {self.out}{self._chat_summary()}"
                + (f"; resumed after {self.resumed_bytes / 1e6:.1f} MB" if self.resumed_bytes else ""))

    def _chat_summary(self) -> str:
        if not self.supervised and not self.dropped:
            return ""
        toks = sum(self.tokens.values())
        kept = f"; {self.supervised:,} of the {toks:,} tokens are trained on (assistant turns)"
        if not self.dropped:
            return kept + "; no conversation dropped"
        reasons = ", ".join(f"{n:,} {why}" for why, n in sorted(self.dropped.items()))
        return kept + f"; dropped {sum(self.dropped.values()):,} conversations ({reasons})"
