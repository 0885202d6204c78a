"""How training gets its data: the dataset, the windows, the sampler and the loader.

``data.path`` names a dataset made by ``parallel3d prepare-data``; without it the
embedded stdlib corpus is prepared (once per node: local rank 0 builds the cache, the
others wait at a barrier) into the same format. Either way training reads one format
(:mod:`parallel3d.data.format`) through one sampler and one loader.

The validation split is read by a second sampler whose positions are fixed
(``[0, eval.batches * G)`` of its own permutation), so every evaluation sees the same
sequences and its losses are comparable across steps.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from parallel3d.config import DataConfig, JobConfig
from parallel3d.data.format import PreparedDataset, open_dataset
from parallel3d.data.loader import PrefetchLoader
from parallel3d.data.sampler import GlobalBatchSampler, TokenWindows
from parallel3d.data.stdlib import EOS, prepare_stdlib
from parallel3d.data.tokenizer import check_same_tokenizer
from parallel3d.distributed import local_rank
from parallel3d.errors import UserError
from parallel3d.topology import Topology

__all__ = ["EOS", "GlobalBatchSampler", "PrefetchLoader", "TokenWindows", "TrainData",
           "build_train_data", "open_training_dataset", "prepare_corpus"]


def prepare_corpus(cfg: DataConfig) -> PreparedDataset:
    """The dataset ``cfg`` names: ``data.path`` opened, or the stdlib corpus prepared."""
    if cfg.path:
        return open_dataset(cfg.path)
    return prepare_stdlib(cfg)


def open_training_dataset(cfg: DataConfig) -> PreparedDataset:
    """:func:`prepare_corpus` with one writer per node: local rank 0 first, then the rest."""
    dataset = prepare_corpus(cfg) if local_rank() == 0 else None
    if dist.is_initialized():
        dist.barrier()
    return dataset or prepare_corpus(cfg)


@dataclass
class TrainData:
    dataset: PreparedDataset
    windows: TokenWindows
    sampler: GlobalBatchSampler
    loader: PrefetchLoader
    val_windows: TokenWindows | None
    val_sampler: GlobalBatchSampler | None
    device: torch.device

    def val_micro_batches(self, batch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's micro-batches of validation batch ``batch`` (0-based), on the device."""
        idx = self.val_sampler.indices_at(batch * self.val_sampler.global_batch)
        return [tuple(t.to(self.device) for t in self.val_windows.batch(i)) for i in idx]


def build_train_data(cfg: JobConfig, topo: Topology, device: torch.device,
                     model_vocab: int) -> TrainData:
    dataset = open_training_dataset(cfg.data)
    if dataset.vocab_size > model_vocab:
        raise UserError(f"the dataset's vocabulary ({dataset.vocab_size}) exceeds model.vocab_size "
                        f"{model_vocab}: raise model.vocab_size, or lower data.vocab_size (stdlib) "
                        "or prepare the data with a smaller tokenizer")
    if cfg.model.hf_checkpoint:  # fine-tuning: the ids must mean the model's tokens
        check_same_tokenizer(dataset, cfg.model.hf_checkpoint)
    train = cfg.train
    windows = TokenWindows(dataset.split("train"), train.seq_len, what="the training split")
    sampler = GlobalBatchSampler(windows.num_samples, train.global_batch, train.micro_batch,
                                 topo.dp, topo.dp_rank, train.seed, dataset.fingerprint)
    loader = PrefetchLoader(windows, sampler, device, depth=cfg.data.prefetch)
    val_windows = val_sampler = None
    if cfg.eval.interval > 0:
        val_tokens = dataset.split("val")
        need = cfg.eval.batches * train.global_batch
        have = max(0, (len(val_tokens) - 1) // train.seq_len)
        if have < need:
            raise UserError(
                f"the validation split holds {have} sequences of train.seq_len {train.seq_len}, fewer "
                f"than eval.batches {cfg.eval.batches} * train.global_batch {train.global_batch} = {need}: "
                "lower eval.batches, or hold out more (data.val_fraction, prepare-data --val-fraction)")
        val_windows = TokenWindows(val_tokens, train.seq_len, what="the validation split")
        val_sampler = GlobalBatchSampler(val_windows.num_samples, train.global_batch, train.micro_batch,
                                         topo.dp, topo.dp_rank, train.seed, dataset.fingerprint)
    return TrainData(dataset, windows, sampler, loader, val_windows, val_sampler, device)
