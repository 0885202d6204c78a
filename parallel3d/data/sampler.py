"""Training samples and the deterministic, resumable, data-parallel sampler.

Samples are the non-overlapping windows ``tokens[i*S : i*S + S + 1]`` of a split's token
stream (inputs ``[:-1]``, targets ``[1:]``); a window may cross documents (they are
separated by EOS) and shards (the stream reads across them).

:class:`GlobalBatchSampler` walks a seeded permutation of the windows, ``global_batch``
samples per step, and gives each data-parallel rank its contiguous slice cut into
micro-batches, so any dp degree sees exactly the same global batch. Its position is the
number of samples consumed; ``state_dict()`` saves it with what it depends on, and a
sampler loaded from it continues at exactly the next sample.
"""

from __future__ import annotations

import numpy as np
import torch

from parallel3d.errors import UserError


class TokenWindows:
    """Sample ``i`` is ``tokens[i*S : i*S + S + 1]``: inputs ``[:-1]``, targets ``[1:]``.

    ``tokens`` is anything sliceable with a length: a NumPy array or a
    :class:`~parallel3d.data.format.TokenStream`."""

    def __init__(self, tokens, seq_len: int, what: str = "corpus"):
        self.tokens = tokens
        self.seq_len = seq_len
        self.num_samples = max(0, (len(tokens) - 1) // seq_len)
        if self.num_samples < 1:
            raise UserError(f"{what} of {len(tokens)} tokens is shorter than train.seq_len {seq_len} + 1")

    def span(self, i: int) -> tuple[int, int]:
        """(start, length) of the stretch of the token stream sample ``i`` reads."""
        return i * self.seq_len, self.seq_len + 1

    def rows(self, indices: list[int]) -> np.ndarray:
        """(len(indices), S + 1) int64 token ids."""
        S = self.seq_len
        return np.stack([np.asarray(self.tokens[i * S: i * S + S + 1], dtype=np.int64) for i in indices])

    def batch(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), each (len(indices), S) int64."""
        t = torch.from_numpy(self.rows(indices))
        return t[:, :-1], t[:, 1:]


class GlobalBatchSampler:
    """Deterministic, shuffled, data-parallel-sharded sample indices.

    Global position ``p`` (samples consumed since the start) maps to sample
    ``perm_e[p mod N]`` with ``e = p // N`` and ``perm_e`` a permutation seeded by
    ``(seed, e)``. A step starting at position ``p`` covers ``[p, p + G)``; data-parallel
    rank ``r`` takes the ``r``-th of ``dp`` contiguous slices and cuts it into
    micro-batches. ``consumed`` is the position of the next step; :meth:`next_step`
    returns that step's indices and advances it by ``G``.
    """

    def __init__(self, num_samples: int, global_batch: int, micro_batch: int,
                 dp: int, dp_rank: int, seed: int, fingerprint: str = ""):
        self.num_samples = num_samples
        self.global_batch = global_batch
        self.micro_batch = micro_batch
        self.dp, self.dp_rank, self.seed = dp, dp_rank, seed
        self.fingerprint = fingerprint  # names the data: resuming on other data is refused
        self.consumed = 0
        self._perms: dict[int, np.ndarray] = {}

    @property
    def micro_batches_per_step(self) -> int:
        return self.global_batch // (self.micro_batch * self.dp)

    def _sample_at(self, pos: int) -> int:
        epoch, offset = divmod(pos, self.num_samples)
        perm = self._perms.get(epoch)
        if perm is None:
            perm = np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)
            # Positions move forward (a step may straddle two epochs): keep the last two.
            self._perms = {e: p for e, p in self._perms.items() if e == epoch - 1}
            self._perms[epoch] = perm
        return int(perm[offset])

    def indices_at(self, position: int) -> list[list[int]]:
        """This rank's micro-batches of the global batch starting at ``position``."""
        per_rank = self.global_batch // self.dp
        start = position + self.dp_rank * per_rank
        idx = [self._sample_at(start + i) for i in range(per_rank)]
        m = self.micro_batch
        return [idx[i: i + m] for i in range(0, per_rank, m)]

    def global_indices_at(self, position: int) -> list[int]:
        """Every sample of the global batch starting at ``position``, all dp ranks' (what
        each rank reads to count the batch's supervised targets)."""
        return [self._sample_at(position + i) for i in range(self.global_batch)]

    def step_indices(self, step: int) -> list[list[int]]:
        """This rank's sample indices for ``step`` counted from position 0."""
        return self.indices_at(step * self.global_batch)

    def next_step(self) -> list[list[int]]:
        out = self.indices_at(self.consumed)
        self.consumed += self.global_batch
        return out

    def state_dict(self) -> dict:
        """JSON-serializable: the position and what it means something for."""
        return {"consumed_samples": self.consumed, "epoch": self.consumed // self.num_samples,
                "seed": self.seed, "num_samples": self.num_samples, "dataset": self.fingerprint}

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state``. The global batch and the dp layout may differ from the
        saving run (the position counts samples); the data and the seed may not."""
        for key, mine in (("seed", self.seed), ("num_samples", self.num_samples),
                          ("dataset", self.fingerprint)):
            if state.get(key) != mine:
                raise UserError(
                    f"cannot resume the sampler: the saved {key} is {state.get(key)!r}, this run's is "
                    f"{mine!r} (resuming needs the same data, train.seq_len and train.seed)")
        consumed = state["consumed_samples"]
        if not isinstance(consumed, int) or consumed < 0:
            raise UserError(f"sampler state has a bad consumed_samples {consumed!r}")
        self.consumed = consumed
