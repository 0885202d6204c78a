"""How training gets its data: the dataset, the windows, the sampler and the loader.

``data.path`` names a dataset made by ``parallel3d prepare-data``; without it the
embedded stdlib corpus is prepared (once per node: local rank 0 builds the cache, the
others wait at a barrier) into the same format. Either way training reads one format
(:mod:`parallel3d.data.format`) through one sampler and one loader.

``data.packing`` picks the windows (:mod:`parallel3d.data.packing`): plain text under
"concat" reads :class:`TokenWindows` (pairs of inputs and targets, as always); chat data
(a loss mask) and packing by document read :class:`PackedWindows`.

The validation split is read by a second sampler whose positions are fixed
(``[0, eval.batches * G)`` of its own permutation), so every evaluation sees the same
sequences and its losses are comparable across steps.

Every batch's ids are checked against the model's vocabulary before it is built, and the
shards' sha256 are verified (before training for small data, else in the background):
:mod:`parallel3d.data.checks`.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from parallel3d.config import DataConfig, JobConfig
from parallel3d.data.context_shard import ContextShardWindows
from parallel3d.data.checks import SMALL_DATA_BYTES, IdRangeCheck, ShardVerifier, dataset_bytes
from parallel3d.data.format import PreparedDataset, open_dataset
from parallel3d.data.batch import MicroBatch
from parallel3d.data.loader import PrefetchLoader, step_micro_batches
from parallel3d.data.packing import PackedWindows
from parallel3d.data.sampler import GlobalBatchSampler, TokenWindows
from parallel3d.data.stdlib import EOS, prepare_stdlib
from parallel3d.data.tokenizer import check_same_tokenizer
from parallel3d.distributed import local_rank
from parallel3d.errors import UserError
from parallel3d.topology import Topology

__all__ = ["EOS", "GlobalBatchSampler", "PrefetchLoader", "TokenWindows", "TrainData",
           "DataFacts", "build_train_data", "check_data", "check_dataset", "open_training_dataset",
           "prepare_corpus"]


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
    verifier: ShardVerifier | None = None
    val_check: Callable[[int], None] | None = None

    def val_micro_batches(self, batch: int) -> list:
        """This rank's micro-batches of validation batch ``batch`` (0-based), on the device."""
        position = batch * self.val_sampler.global_batch
        if self.val_check is not None:
            self.val_check(position)
        return [mb.to(self.device) if isinstance(mb, MicroBatch) else tuple(t.to(self.device) for t in mb)
                for mb in step_micro_batches(self.val_windows, self.val_sampler, position)]


def packing_of(cfg: DataConfig, dataset: PreparedDataset) -> str:
    """``data.packing`` resolved for ``dataset`` ("auto": whole for chat data, else concat)."""
    packing = cfg.packing
    if packing == "auto":
        packing = "whole" if dataset.has_loss_mask else "concat"
    if packing != "concat" and not dataset.has_documents:
        raise UserError(f"data.packing '{packing}' needs the document starts that prepare-data "
                        f"records since format version 2; '{dataset.dir}' is older: prepare it again "
                        "(or use data.packing=concat)")
    return packing


def make_windows(dataset: PreparedDataset, split: str, seq_len: int, packing: str, what: str):
    """The samples of ``split``: :class:`TokenWindows` for plain text under "concat" (the
    path of every earlier version), else :class:`PackedWindows`."""
    tokens = dataset.split(split)
    if packing == "concat" and not dataset.has_loss_mask:
        return TokenWindows(tokens, seq_len, what=what)
    starts = dataset.document_starts(split) if dataset.has_documents else None
    mask = dataset.loss_mask(split) if dataset.has_loss_mask else None
    return PackedWindows(tokens, seq_len, starts=starts, mask=mask, separate=packing != "concat",
                         whole=packing == "whole", pad_id=dataset.eos_id, what=what)


def _for_rank(windows, topo: Topology):
    """The windows as this rank reads them: at cp > 1, its head-tail chunks of each
    sequence (:class:`ContextShardWindows`)."""
    return ContextShardWindows(windows, topo.cp, topo.cp_rank) if topo.cp > 1 else windows


def start_verifier(dataset: PreparedDataset, topo: Topology, device: torch.device) -> ShardVerifier:
    """Hash the shards (this rank's share); small data is agreed on before training
    starts, larger data is polled at each step by the loader."""
    small = dataset_bytes(dataset) <= SMALL_DATA_BYTES
    group = None
    if not small and dist.is_initialized() and topo.world_size > 1:
        group = dist.new_group(backend="gloo")  # CPU flags, apart from the training groups
    verifier = ShardVerifier(dataset, topo.rank, topo.world_size, group)
    if small:
        verifier.agree_now(device)
    return verifier


def check_dataset(cfg: JobConfig, dataset: PreparedDataset, model_vocab: int) -> str:
    """What the run checks of an opened dataset before it builds anything (the vocabulary
    against the model, the tokenizer against an HF model's, the packing against the
    format); returns the packing. The dry run calls it too."""
    if dataset.vocab_size > model_vocab:
        if cfg.model.hf_checkpoint:
            fix = f"prepare the data again with the model's tokenizer (--tokenizer {cfg.model.hf_checkpoint})"
        elif cfg.data.path:
            fix = (f"set --model.vocab_size={dataset.vocab_size}, or prepare the data with a tokenizer "
                   f"of at most {model_vocab} tokens")
        else:
            fix = f"set --model.vocab_size={dataset.vocab_size} or --data.vocab_size={model_vocab}"
        raise UserError(f"the dataset's vocabulary ({dataset.vocab_size}) exceeds model.vocab_size "
                        f"{model_vocab}: {fix}")
    if cfg.model.hf_checkpoint:  # fine-tuning: the ids must mean the model's tokens
        check_same_tokenizer(dataset, cfg.model.hf_checkpoint)
    return packing_of(cfg.data, dataset)


def validation_windows(cfg: JobConfig, dataset: PreparedDataset, packing: str):
    """The validation split's windows (not yet cut for a cp rank), None when evaluation is
    off; raises :func:`validation_too_small` when it holds fewer than eval.batches global
    batches."""
    if cfg.eval.interval <= 0:
        return None
    train = cfg.train
    need = cfg.eval.batches * train.global_batch
    windows, have = None, max(0, (len(dataset.split("val")) - 1) // train.seq_len)
    if have:
        windows = make_windows(dataset, "val", train.seq_len, packing, "the validation split")
        have = windows.num_samples
    if have < need:
        raise validation_too_small(cfg, dataset, have, need)
    return windows


def _round_up(x: float) -> float:
    """``x`` rounded up to two significant digits."""
    digits = 1 - math.floor(math.log10(x))
    return math.ceil(x * 10**digits) / 10**digits


def validation_too_small(cfg: JobConfig, dataset: PreparedDataset, have: int, need: int) -> UserError:
    """The error of a validation split too small for one evaluation, with the changes that
    make it big enough: fewer batches (when one global batch fits), no evaluation, or a
    larger held-out share computed from the split's own numbers: sequences grow with the
    documents held out, which are whole and of unequal sizes, so 15% more and one document
    more than the proportion asks."""
    train, ev = cfg.train, cfg.eval
    fixes = []
    if have >= train.global_batch:
        fixes.append(f"--eval.batches={have // train.global_batch}")
    fixes.append("--eval.interval=0 (no held-out loss)")
    val, total = len(dataset.split("val")), len(dataset.split("train")) + len(dataset.split("val"))
    held = val / total
    # the share of documents held out now (prepare-data records it), scaled to the need;
    # with none held out, the documents' share ~ the tokens' share
    fraction = dataset.index.get("source", {}).get("val_fraction") or 0
    wanted = fraction * need / have if have and fraction else (need * train.seq_len + 1) / total
    wanted *= 1.15
    docs = sum(v.get("num_docs", 0) for v in dataset.index.get("splits", {}).values())
    if docs:  # whole documents (floor(n f) of them): one more than the share asks, and more than now
        held_docs = dataset.index["splits"].get("val", {}).get("num_docs", 0)
        wanted = max(held_docs + 1, math.ceil(wanted * docs) + 1) / docs
    share = _round_up(min(0.99, wanted))
    if share < 0.5:
        fixes.append(f"prepare the data again with --val-fraction {share}" if cfg.data.path
                     else f"--data.val_fraction={share}")
    return UserError(
        f"the validation split holds {have} sequences of train.seq_len {train.seq_len} ({held:.1%} of the "
        f"dataset's tokens), fewer than eval.batches {ev.batches} * train.global_batch {train.global_batch} "
        f"= {need}: {', or '.join(fixes)}")


@dataclass(frozen=True)
class DataFacts:
    """What the banner and the summary say of the data: tokens and samples of each split."""

    train_tokens: int
    val_tokens: int
    train_samples: int

    def epochs(self, cfg: JobConfig) -> float:
        """Passes over the training split the run makes: train.steps * train.global_batch
        samples over the split's samples (with packing "concat", global_batch * seq_len *
        steps / its tokens)."""
        return cfg.train.steps * cfg.train.global_batch / self.train_samples


def check_data(cfg: JobConfig, model_vocab: int, dataset: PreparedDataset | None = None) -> DataFacts:
    """Every check :func:`build_train_data` makes before the first step, without a loader,
    a verifier or a process group: the dry run's and the launching process's data check."""
    dataset = dataset or prepare_corpus(cfg.data)
    packing = check_dataset(cfg, dataset, model_vocab)
    windows = make_windows(dataset, "train", cfg.train.seq_len, packing, "the training split")
    validation_windows(cfg, dataset, packing)
    return DataFacts(len(dataset.split("train")), len(dataset.split("val")), windows.num_samples)


def build_train_data(cfg: JobConfig, topo: Topology, device: torch.device,
                     model_vocab: int) -> TrainData:
    dataset = open_training_dataset(cfg.data)
    packing = check_dataset(cfg, dataset, model_vocab)
    train = cfg.train
    windows = _for_rank(make_windows(dataset, "train", train.seq_len, packing, "the training split"), topo)
    val = validation_windows(cfg, dataset, packing)
    sampler = GlobalBatchSampler(windows.num_samples, train.global_batch, train.micro_batch,
                                 topo.dp, topo.dp_rank, train.seed, dataset.fingerprint)
    verifier = start_verifier(dataset, topo, device)
    loader = PrefetchLoader(windows, sampler, device, depth=cfg.data.prefetch,
                            check=IdRangeCheck(windows, sampler, model_vocab),
                            before_step=verifier.poll)
    val_windows = val_sampler = None
    if val is not None:
        val_windows = _for_rank(val, topo)
        val_sampler = GlobalBatchSampler(val_windows.num_samples, train.global_batch, train.micro_batch,
                                         topo.dp, topo.dp_rank, train.seed, dataset.fingerprint)
    data = TrainData(dataset, windows, sampler, loader, val_windows, val_sampler, device, verifier,
                     IdRangeCheck(val_windows, val_sampler, model_vocab, "validation split")
                     if val_windows is not None else None)
    weakref.finalize(data, verifier.close)  # no hashing left behind a finished run
    return data
