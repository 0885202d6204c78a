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
            self.bar.update(disk_bytes)
            return
        now = time.perf_counter()
        if self.enabled and now - self._last >= self.every_s:
            self._last = now
            dt = now - self.t0
            print(f"prepare-data: {100 * self.done / max(1, self.total):.0f}% "
                  f"({self.done / 1e6:.1f} of {self.total / 1e6:.1f} MB), {self.done / 1e6 / dt:.2f} MB/s, "
                  f"{self.tokens / dt:,.0f} tokens/s", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


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

    @property
    def mb_per_s(self) -> float:
        return self.disk_bytes / 1e6 / self.seconds

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
                f"({self.workers} worker{'s' * (self.workers != 1)}) -> {self.out}{self._chat_summary()}")

    def _chat_summary(self) -> str:
        if not self.supervised and not self.dropped:
            return ""
        toks = sum(self.tokens.values())
        kept = f"; {self.supervised:,} of the {toks:,} tokens are trained on (assistant turns)"
        if not self.dropped:
            return kept + "; no conversation dropped"
        reasons = ", ".join(f"{n:,} {why}" for why, n in sorted(self.dropped.items()))
        return kept + f"; dropped {sum(self.dropped.values()):,} conversations ({reasons})"
