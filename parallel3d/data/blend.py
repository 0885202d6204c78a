"""``data.blend``: several prepared datasets mixed by weight, deterministically.

Each source is packed into windows on its own (:mod:`parallel3d.data.blend_windows`); the
blend then interleaves whole windows, so no window mixes two sources and the shares cannot
drift with document lengths (torchtitan PR 2385's lesson). Every window is ``seq_len``
token slots, so a source's share of windows is its share of the tokens read (under
``whole`` packing some slots are padding).

**The interleave** (:class:`BlendSchedule`). With weights ``w_k`` normalised to sum 1, the
``n``-th draw of source ``k`` gets the virtual time ``t = (n + 1/2) / w_k``; global
position ``p`` is the ``p``-th draw in the order of ``(t, k)`` (Sainte-Lague's
apportionment). After ``p`` positions every source has drawn ``p w_k`` windows to within
one, for any ``p``, and the draws of source ``k`` before position ``p`` are computed in
``O(K)`` operations without walking the positions (:meth:`BlendSchedule.counts_at`): a
resume at step 10^6 costs what one at step 1 does.

**Within a source**, draw ``d`` reads window ``perm_e[d mod N_k]`` with ``e = d // N_k``
the source's epoch and ``perm_e`` a permutation seeded by ``(train.seed, the source's
fingerprint, e)``. A source that runs out starts its next epoch on its own, counted
(:meth:`BlendSampler.epochs_at`) and logged by the loader.

**Positions** count samples exactly as :class:`~parallel3d.data.sampler.GlobalBatchSampler`
does: a step at position ``p`` covers ``[p, p + G)``, dp rank ``r`` takes the ``r``-th of
``dp`` slices. The global batch depends on the position only, so it is the same at every
layout, and ``state_dict()`` resumes exactly.

**A changed blend on resume** (weights changed, sources added or dropped) follows
:data:`CHANGED_BLEND_RULE`, printed when it applies.
"""

from __future__ import annotations

import hashlib
import json
import math

import numpy as np

from parallel3d.errors import UserError

CHANGED_BLEND_RULE = (
    "the blend differs from the checkpoint's: the run continues at the saved position; each source "
    "whose name and data are unchanged resumes its own stream after the windows it already gave "
    "(no window repeats before its epoch ends), a new or changed source starts at its first window, "
    "and from here on the interleave follows the new weights")


class BlendSchedule:
    """Which source each global position draws from (see the module docstring)."""

    def __init__(self, weights: list[float]):
        total = float(sum(weights))
        self.weights = [w / total for w in weights]

    def _time(self, k: int, n: int) -> float:
        return (n + 0.5) / self.weights[k]

    def _count_le(self, k: int, t: float) -> int:
        """How many draws of source ``k`` have virtual time <= ``t``."""
        n = max(0, math.floor(t * self.weights[k] - 0.5) + 1)
        while n > 0 and self._time(k, n - 1) > t:
            n -= 1
        while self._time(k, n) <= t:
            n += 1
        return n

    def _next(self, counts: list[int]) -> int:
        return min(range(len(counts)), key=lambda k: (self._time(k, counts[k]), k))

    def counts_at(self, position: int) -> list[int]:
        """Draws of each source among positions ``[0, position)``."""
        K = len(self.weights)
        # every draw with time <= t precedes every later one; sum_k floor(t w_k + 1/2) <= t + K/2
        t = max(0.0, float(position - K - 1))
        counts = [self._count_le(k, t) for k in range(K)] if t > 0 else [0] * K
        while sum(counts) < position:
            counts[self._next(counts)] += 1
        return counts

    def draws(self, position: int, n: int) -> list[tuple[int, int]]:
        """(source, draw number) of positions ``[position, position + n)``."""
        counts = self.counts_at(position)
        out = []
        for _ in range(n):
            k = self._next(counts)
            out.append((k, counts[k]))
            counts[k] += 1
        return out


def _seed_key(fingerprint: str) -> int:
    return int(hashlib.sha256(fingerprint.encode()).hexdigest()[:8], 16)


def blend_fingerprint(names: list[str], weights: list[float], fingerprints: list[str]) -> str:
    ident = [[n, float(w), f] for n, w, f in zip(names, weights, fingerprints)]
    return "blend-" + hashlib.sha256(json.dumps(ident).encode()).hexdigest()[:16]


class BlendSampler:
    """The sampler of a blend: :class:`~parallel3d.data.sampler.GlobalBatchSampler`'s
    interface (positions, dp slices, micro-batches, ``state_dict``), over the sample
    indices of :class:`~parallel3d.data.blend_windows.BlendedWindows` (source ``k``'s
    window ``j`` is ``offsets[k] + j``).

    ``start`` / ``base``: the position from which the current weights apply and each
    source's draws before it (zero for a run that never changed its blend)."""

    def __init__(self, names: list[str], weights: list[float], sizes: list[int], fingerprints: list[str],
                 global_batch: int, micro_batch: int, dp: int, dp_rank: int, seed: int, log=None):
        self.names, self.sizes, self.source_fingerprints = list(names), list(sizes), list(fingerprints)
        self.raw_weights = [float(w) for w in weights]
        self.schedule = BlendSchedule(self.raw_weights)
        self.offsets = np.cumsum([0] + self.sizes)[:-1].tolist()
        self.num_samples = int(sum(self.sizes))
        self.global_batch, self.micro_batch = global_batch, micro_batch
        self.dp, self.dp_rank, self.seed = dp, dp_rank, seed
        self.fingerprint = blend_fingerprint(self.names, self.raw_weights, self.source_fingerprints)
        self.log = log  # called with a line to print (rank 0's console), or None
        self.consumed = 0
        self.start, self.base = 0, [0] * len(self.sizes)
        self._keys = [_seed_key(f) for f in self.source_fingerprints]
        self._perms: dict[tuple[int, int], np.ndarray] = {}

    @property
    def micro_batches_per_step(self) -> int:
        return self.global_batch // (self.micro_batch * self.dp)

    def draws_at(self, position: int) -> list[int]:
        """Windows each source has given before ``position`` (all its epochs)."""
        rel = self.schedule.counts_at(max(0, position - self.start))
        return [b + c for b, c in zip(self.base, rel)]

    def epochs_at(self, position: int) -> list[int]:
        """Each source's epoch (0-based) at ``position``: its completed passes."""
        return [d // n for d, n in zip(self.draws_at(position), self.sizes)]

    def _window(self, k: int, draw: int) -> int:
        epoch, offset = divmod(draw, self.sizes[k])
        perm = self._perms.get((k, epoch))
        if perm is None:
            perm = np.random.default_rng([self.seed, self._keys[k], epoch]).permutation(self.sizes[k])
            # draws move forward (a step may straddle an epoch): keep the previous epoch's
            self._perms = {key: p for key, p in self._perms.items() if key[0] != k or key[1] == epoch - 1}
            self._perms[(k, epoch)] = perm
        return self.offsets[k] + int(perm[offset])

    def _samples(self, position: int, n: int) -> list[int]:
        if position < self.start:
            raise ValueError(f"position {position} precedes the blend's start {self.start}")
        return [self._window(k, self.base[k] + d)
                for k, d in self.schedule.draws(position - self.start, n)]

    def indices_at(self, position: int) -> list[list[int]]:
        """This rank's micro-batches of the global batch starting at ``position``."""
        per_rank = self.global_batch // self.dp
        idx = self._samples(position + self.dp_rank * per_rank, per_rank)
        m = self.micro_batch
        return [idx[i: i + m] for i in range(0, per_rank, m)]

    def global_indices_at(self, position: int) -> list[int]:
        return self._samples(position, self.global_batch)

    def step_indices(self, step: int) -> list[list[int]]:
        return self.indices_at(step * self.global_batch)

    def next_step(self) -> list[list[int]]:
        out = self.indices_at(self.consumed)
        self.consumed += self.global_batch
        return out

    def on_advance(self, before: int, after: int) -> None:
        """The loader moved the position from ``before`` to ``after``: log every source
        that started a new epoch in between."""
        if self.log is None:
            return
        for name, size, e0, e1 in zip(self.names, self.sizes, self.epochs_at(before), self.epochs_at(after)):
            if e1 > e0:
                self.log(f"data.blend: source '{name}' read all its {size:,} windows and starts epoch {e1 + 1} "
                         f"(before sample position {after:,})")

    def figures(self, position: int) -> dict:
        """Each source's completed epochs at ``position`` (``epochs/<name>``), for a record."""
        return {f"epochs/{n}": e for n, e in zip(self.names, self.epochs_at(position))}

    def source_of(self, index: int) -> int:
        """The source a sample index belongs to."""
        return int(np.searchsorted(self.offsets, index, side="right")) - 1

    # -- state -------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """JSON: the position, and the blend it means something for (names, data, weights,
        where those weights started); each source's draws and epochs, for people."""
        draws = self.draws_at(self.consumed)
        sources = [{"name": n, "dataset": f, "weight": w, "windows": s, "base": b, "draws": d,
                    "epoch": d // s}
                   for n, f, w, s, b, d in zip(self.names, self.source_fingerprints, self.raw_weights,
                                               self.sizes, self.base, draws)]
        return {"consumed_samples": self.consumed, "epoch": self.consumed // self.num_samples,
                "seed": self.seed, "num_samples": self.num_samples, "dataset": self.fingerprint,
                "blend": {"start": self.start, "sources": sources}}

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state``: exactly, when it is this blend's; else by
        :data:`CHANGED_BLEND_RULE`. The seed may not change."""
        if state.get("seed") != self.seed:
            raise UserError(f"cannot resume the sampler: the saved seed is {state.get('seed')!r}, this "
                            f"run's is {self.seed!r} (resuming needs the same train.seed)")
        consumed = state.get("consumed_samples")
        if not isinstance(consumed, int) or consumed < 0:
            raise UserError(f"sampler state has a bad consumed_samples {consumed!r}")
        saved = state.get("blend")
        if state.get("dataset") == self.fingerprint and saved is not None:
            self.start = int(saved["start"])
            self.base = [int(s["base"]) for s in saved["sources"]]
        else:
            self.start, self.base = consumed, self._carried_draws(saved, consumed)
            if self.log is not None:
                self.log(f"data.blend: {CHANGED_BLEND_RULE}: " + ", ".join(
                    f"{n} from window {b:,}" for n, b in zip(self.names, self.base)))
        self.consumed = consumed

    def _carried_draws(self, saved: dict | None, consumed: int) -> list[int]:
        """Each of this blend's sources' draws before ``consumed`` under the saved blend
        (recomputed from its weights, so a position the checkpointer moved back is
        honoured), or 0 for a source it did not have with the same name and data."""
        if not saved:
            return [0] * len(self.names)  # a single-dataset run: every source starts afresh
        old = saved["sources"]
        schedule = BlendSchedule([s["weight"] for s in old])
        rel = schedule.counts_at(max(0, consumed - int(saved["start"])))
        had = {(s["name"], s["dataset"]): int(s["base"]) + c for s, c in zip(old, rel)}
        return [had.get((n, f), 0) for n, f in zip(self.names, self.source_fingerprints)]
