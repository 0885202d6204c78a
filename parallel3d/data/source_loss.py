"""Per-source losses of a ``data.blend`` (issue 34 point 4): the pieces below the trainer.

A window holds one source's tokens, so each row of a micro-batch has one source
(``MicroBatch.sources``, (B,)). The last pipeline stage's loss function computes per-token
losses (B, S) before summing them (``vocab_parallel_cross_entropy``); from those:

    sums[k]   = sum over rows b with sources[b] = k of sum_s loss[b, s]     (ignored targets add 0)
    tokens[k] = supervised targets of source k in the whole global batch   (host, no collective)
    loss/<k>  = (sums[k] summed over the world: dp x cp ranks, tp rank 0, last stage) / tokens[k]

Since the step's loss is ``sum_k sums[k] / sum_k tokens[k]`` (the loss divisor is the
global batch's supervised targets over dp), the per-source losses weighted by their token
counts give the step loss exactly (:func:`weighted_step_loss`).

:class:`SourceLossSums` accumulates ``sums`` over a step's micro-batches on the device;
its :meth:`~SourceLossSums.step_part` (the sums and the supervised tokens, (2K,)) goes into
the trainer's one all-reduce of the step.
"""

from __future__ import annotations

import torch


def source_loss_sums(token_loss: torch.Tensor, sources: torch.Tensor, n_sources: int) -> torch.Tensor:
    """(n_sources,) fp64: the summed per-token losses of each source's rows.
    ``token_loss`` (B, S) with 0 at ignored targets; ``sources`` (B,) int64."""
    per_row = token_loss.detach().double().sum(dim=1)  # (B,)
    out = torch.zeros(n_sources, dtype=torch.float64, device=token_loss.device)
    return out.index_add_(0, sources.to(token_loss.device), per_row)


class SourceLossSums:
    """A step's per-source loss sums, accumulated over its micro-batches."""

    def __init__(self, n_sources: int, device: torch.device):
        self.n_sources, self.device = n_sources, device
        self.sums = torch.zeros(n_sources, dtype=torch.float64, device=device)

    def add(self, token_loss: torch.Tensor, sources: torch.Tensor) -> None:
        self.sums += source_loss_sums(token_loss, sources, self.n_sources)

    def take(self) -> torch.Tensor:
        """The step's sums (this rank's part); the accumulator starts again at zero."""
        out, self.sums = self.sums, torch.zeros_like(self.sums)
        return out

    def step_part(self, micro_batches, counts: bool, ignore_index: int) -> torch.Tensor:
        """This rank's part of the step's per-source figures for the step's one all-reduce:
        (2K,) fp64, the K sources' summed token losses then their supervised tokens (targets
        other than ``ignore_index``). ``counts``: whether this rank holds the loss (the last
        stage's tp rank 0: the other tp ranks hold the same loss); zeros elsewhere."""
        sums = self.take()
        tokens = torch.zeros(self.n_sources, dtype=torch.float64, device=self.device)
        if counts:
            for mb in micro_batches:
                rows = (mb.targets != ignore_index).sum(dim=1).to(device=self.device, dtype=torch.float64)
                tokens.index_add_(0, mb.sources.to(self.device), rows)
        else:
            sums.zero_()
        return torch.cat([sums, tokens])


def source_tokens(windows, indices) -> list[int]:
    """Supervised targets of each blend source among samples ``indices`` (the whole global
    batch: every rank counts it alike, no collective). ``windows``: BlendedWindows."""
    counts = [0] * len(windows.names)
    for i in indices:
        k, j = windows.locate(i)
        counts[k] += windows.sources[k].supervised([j])
    return counts


def source_figures(names: list[str], sums: list[float], tokens: list[int], prefix: str = "loss") -> dict:
    """``{"loss/<name>": mean loss of its tokens, "tokens/<name>": count}``; a source with
    no token in the batch gets no loss entry (its count, 0, is there)."""
    out = {}
    for name, s, n in zip(names, sums, tokens):
        if n:
            out[f"{prefix}/{name}"] = s / n
        if prefix == "loss":
            out[f"tokens/{name}"] = n
    return out


def weighted_step_loss(figures: dict, names: list[str]) -> float:
    """The step loss from the per-source figures: sum_k tokens_k loss_k / sum_k tokens_k."""
    total = sum(figures[f"tokens/{n}"] for n in names)
    return sum(figures[f"tokens/{n}"] * figures.get(f"loss/{n}", 0.0) for n in names) / total
