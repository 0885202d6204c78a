"""bench_cp_speed.py's statistics over alternating rounds: a distribution-free interval
for the median of the per-round ratios, and saved runs taken together."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path


def median_interval(ratios: list[float], level: float = 0.95) -> tuple[float, float, float]:
    """A distribution-free interval for the median of the per-round ratios: the order
    statistics ``(k, n+1-k)`` with the largest ``k`` whose coverage
    ``1 - 2 P(Binomial(n, 1/2) < k)`` is at least ``level``; (low, high, coverage)."""
    n, r = len(ratios), sorted(ratios)
    best = (r[0], r[-1], 1 - 2 / 2 ** n)
    for k in range(1, (n + 1) // 2 + 1):
        cover = 1 - 2 * sum(math.comb(n, i) for i in range(k)) / 2 ** n
        if cover >= level:
            best = (r[k - 1], r[n - k], cover)
    return best


def confidence(raw: list[float], ref: list[float]) -> str:
    ratios = [a / b for a, b in zip(raw, ref)]
    lo, hi, cover = median_interval(ratios)
    return (f"median {statistics.median(ratios):.2f}, {cover:.0%} interval of the median [{lo:.2f}, {hi:.2f}], "
            f"under 1.0 in {sum(x < 1.0 for x in ratios)} of {len(ratios)} rounds")


def combined(paths: list[str]) -> tuple[dict, int]:
    """Saved runs (``--json``) as one: every side's rounds concatenated; the losses and
    errors of the first (every run checks its own)."""
    runs = [json.loads(Path(p).read_text()) for p in paths]
    res = {k: runs[0][k] for k in ("losses", "errors")}
    for what in ("attention", "step"):
        res[what] = {side: [t for run in runs for t in run[what][side]] for side in runs[0][what]}
    return res, len(res["step"]["ulysses"])
