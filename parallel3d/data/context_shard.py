"""Each context-parallel rank's part of every micro-batch.

The cp ranks of one data-parallel rank read the same sequences (the sampler knows only dp);
:class:`ContextShardWindows` wraps the training or validation windows so that every
micro-batch they build keeps only this rank's head-tail chunks of each sequence
(``context_parallel.shard_sequence``: chunks ``cp_rank`` and ``2cp-1-cp_rank`` of ``2cp``),
with their positions (the global ones for plain windows, which RoPE and the causal order
read; the per-document ones of packed windows, from which the attention derives each
token's document, ``context_parallel.document_keys``).

Losses: a plain micro-batch's loss is the mean over this rank's tokens, and every cp rank
holds as many, so averaging over dp x cp (the gradients' replicas) gives the mean over the
sequence. A packed micro-batch's loss is its supervised tokens' sum over a divisor, the
global batch's supervised targets over the replicas: dp, times cp here.
"""

from __future__ import annotations

from parallel3d.context_parallel.sharding import shard_positions, shard_sequence
from parallel3d.data.batch import MicroBatch


class ContextShardWindows:
    """``windows`` (``TokenWindows`` or ``PackedWindows``) whose micro-batches hold cp rank
    ``cp_rank``'s tokens: (B, S/cp) inputs, targets and positions. Everything else (the
    token stream, spans, supervised counts) is the wrapped windows'."""

    def __init__(self, windows, cp: int, cp_rank: int):
        self.windows, self.cp, self.cp_rank = windows, cp, cp_rank

    def __getattr__(self, name):
        return getattr(self.windows, name)

    def shard_tokens(self, x):
        """This cp rank's chunks of ``x`` (B, S, ...): the tokens it holds."""
        return shard_sequence(x, self.cp, self.cp_rank, dim=1)

    def _positions(self, inputs, positions):
        if positions is not None:
            return self.shard_tokens(positions)
        batch, seq = inputs.shape
        return shard_positions(seq, self.cp, self.cp_rank).expand(batch, -1).contiguous()

    def batch(self, idx) -> MicroBatch:
        inputs, targets = self.windows.batch(idx)
        return MicroBatch(self.shard_tokens(inputs), self.shard_tokens(targets), self._positions(inputs, None))

    def micro_batch(self, idx, divisor: float) -> MicroBatch:
        mb = self.windows.micro_batch(idx, divisor)
        # the replicas of a gradient are dp x cp: the divisor (global supervised / dp) / cp
        return MicroBatch(self.shard_tokens(mb.inputs), self.shard_tokens(mb.targets),
                          self._positions(mb.inputs, mb.positions), mb.loss_divisor / self.cp,
                          sources=mb.sources)
