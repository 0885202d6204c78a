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

``data.blend`` reads several prepared datasets instead (:mod:`parallel3d.data.blend`):
each source is opened and checked as ``data.path`` would be, packed on its own, and the
blend's sampler interleaves their windows by weight. Its validation is per source: each
source's validation split has its own fixed sampler (:meth:`TrainData.source_val_micro_batches`),
and the blend's own held-out loss reads the sources' validation splits by the same weights.

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
from parallel3d.data.blend import BlendSampler
from parallel3d.data.blend_windows import BlendedWindows, check_blend, check_same_tokens
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


def prepare_corpus(cfg: DataConfig) -> PreparedDataset | None:
    """The dataset ``cfg`` names: ``data.path`` opened, or the stdlib corpus prepared;
    None for ``data.blend`` (its sources are prepared datasets: nothing to build)."""
    if cfg.blend:
        return None
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
    # data.blend: each source's validation (windows, sampler, id check), by name
    val_sources: dict | None = None

    def val_micro_batches(self, batch: int) -> list:
        """This rank's micro-batches of validation batch ``batch`` (0-based), on the device."""
        position = batch * self.val_sampler.global_batch
        if self.val_check is not None:
            self.val_check(position)
        return [mb.to(self.device) if isinstance(mb, MicroBatch) else tuple(t.to(self.device) for t in mb)
                for mb in step_micro_batches(self.val_windows, self.val_sampler, position)]

    @property
    def source_names(self) -> list[str]:
        """The blend's source names (empty for one dataset)."""
        return list(self.val_sources or getattr(self.windows, "names", []))

    def source_val_micro_batches(self, name: str, batch: int) -> list:
        """This rank's micro-batches of validation batch ``batch`` of blend source ``name``."""
        windows, sampler, check = self.val_sources[name]
        position = batch * sampler.global_batch
        check(position)
        return [mb.to(self.device) for mb in step_micro_batches(windows, sampler, position)]


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


def make_windows(dataset: PreparedDataset, split: str, seq_len: int, packing: str, what: str,
                 packed: bool = False):
    """The samples of ``split``: :class:`TokenWindows` for plain text under "concat" (the
    path of every earlier version), else (or when ``packed``: a blend's sources)
    :class:`PackedWindows`."""
    tokens = dataset.split(split)
    if packing == "concat" and not dataset.has_loss_mask and not packed:
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
        elif cfg.data.path or cfg.data.blend:
            fix = (f"set --model.vocab_size={dataset.vocab_size}, or prepare the data with a tokenizer "
                   f"of at most {model_vocab} tokens")
        else:
            fix = f"set --model.vocab_size={dataset.vocab_size} or --data.vocab_size={model_vocab}"
        raise UserError(f"the dataset's vocabulary ({dataset.vocab_size}) exceeds model.vocab_size "
                        f"{model_vocab}: {fix}")
    if cfg.model.hf_checkpoint:  # fine-tuning: the ids must mean the model's tokens
        check_same_tokenizer(dataset, cfg.model.hf_checkpoint)
    return packing_of(cfg.data, dataset)


def validation_windows(cfg: JobConfig, dataset: PreparedDataset, packing: str, packed: bool = False):
    """The validation split's windows (not yet cut for a cp rank), None when evaluation is
    off; raises :func:`validation_too_small` when it holds fewer than eval.batches global
    batches."""
    if cfg.eval.interval <= 0:
        return None
    train = cfg.train
    need = cfg.eval.batches * train.global_batch
    windows, have = None, max(0, (len(dataset.split("val")) - 1) // train.seq_len)
    if have:
        windows = make_windows(dataset, "val", train.seq_len, packing, "the validation split", packed)
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
    if cfg.data.blend:
        blend = open_blend(cfg, model_vocab)
        return DataFacts(sum(len(d.split("train")) for d in blend.datasets),
                         sum(len(d.split("val")) for d in blend.datasets), blend.train.num_samples)
    dataset = dataset or prepare_corpus(cfg.data)
    packing = check_dataset(cfg, dataset, model_vocab)
    windows = make_windows(dataset, "train", cfg.train.seq_len, packing, "the training split")
    validation_windows(cfg, dataset, packing)
    return DataFacts(len(dataset.split("train")), len(dataset.split("val")), windows.num_samples)


@dataclass
class OpenedBlend:
    """A checked ``data.blend``: its sources' datasets, the packing, the training windows
    (:class:`BlendedWindows`) and each source's validation windows (None: no evaluation)."""

    names: list[str]
    weights: list[float]
    datasets: list[PreparedDataset]
    packing: str
    train: BlendedWindows
    val: list | None


def _blend_packing(cfg: DataConfig, datasets: list[PreparedDataset], names: list[str]) -> str:
    """One packing for every source: ``data.packing``, or for "auto" "whole" when any
    source is chat data (a loss mask), else "concat"."""
    packing = cfg.packing
    if packing == "auto":
        packing = "whole" if any(d.has_loss_mask for d in datasets) else "concat"
    for name, d in zip(names, datasets):
        if packing != "concat" and not d.has_documents:
            raise UserError(f"data.blend '{name}': data.packing '{packing}' needs the document starts that "
                            f"prepare-data records since format version 2; '{d.dir}' is older: prepare it again")
    return packing


def open_blend(cfg: JobConfig, model_vocab: int) -> OpenedBlend:
    """Open and check every source of ``data.blend`` as ``data.path`` is checked (each
    error names its source), and build their windows."""
    blend = cfg.data.blend
    check_blend(blend)
    names, datasets = [b.name for b in blend], []
    for b in blend:
        try:
            datasets.append(open_dataset(b.path))
            check_dataset(cfg, datasets[-1], model_vocab)
        except UserError as e:
            raise UserError(f"data.blend '{b.name}': {e}") from None
    check_same_tokens(names, datasets)
    packing = _blend_packing(cfg.data, datasets, names)
    seq_len, train, val = cfg.train.seq_len, [], [] if cfg.eval.interval > 0 else None
    for name, d in zip(names, datasets):
        try:
            train.append(make_windows(d, "train", seq_len, packing, "the training split", packed=True))
            if val is not None:
                val.append(validation_windows(cfg, d, packing, packed=True))
        except UserError as e:
            raise UserError(f"data.blend '{name}': {e}") from None
    return OpenedBlend(names, [b.weight for b in blend], datasets, packing, BlendedWindows(names, train), val)


def _blend_sampler(blend: OpenedBlend, windows, cfg: JobConfig, topo: Topology, log=None) -> BlendSampler:
    sizes = [int(n) for n in windows.offsets[1:] - windows.offsets[:-1]]
    return BlendSampler(blend.names, blend.weights, sizes, [d.fingerprint for d in blend.datasets],
                        cfg.train.global_batch, cfg.train.micro_batch, topo.dp, topo.dp_rank, cfg.train.seed,
                        log=log)


def _print_rank0(topo: Topology):
    return (lambda line: print(f"parallel3d: {line}", flush=True)) if topo.rank == 0 else None


def _wants_token_keys(cfg: JobConfig) -> bool:
    """Whether training batches carry their tokens' stream keys: LoRA's dropout draws its
    masks from them (``lora/dropout.py``)."""
    return cfg.lora.rank > 0 and cfg.lora.dropout > 0


def build_blend_data(cfg: JobConfig, topo: Topology, device: torch.device, model_vocab: int) -> TrainData:
    """:func:`build_train_data` for ``data.blend``."""
    blend = open_blend(cfg, model_vocab)
    train = cfg.train
    windows = _for_rank(blend.train, topo)
    sampler = _blend_sampler(blend, blend.train, cfg, topo, _print_rank0(topo))
    verifiers = [start_verifier(d, topo, device) for d in blend.datasets]

    def poll() -> None:
        for v in verifiers:
            v.poll()

    loader = PrefetchLoader(windows, sampler, device, depth=cfg.data.prefetch,
                            check=IdRangeCheck(blend.train, sampler, model_vocab), before_step=poll,
                            log=_print_rank0(topo), token_keys=_wants_token_keys(cfg))
    val_windows = val_sampler = val_check = val_sources = None
    if blend.val is not None:
        mixed = BlendedWindows(blend.names, blend.val)
        val_windows, val_sampler = _for_rank(mixed, topo), _blend_sampler(blend, mixed, cfg, topo)
        val_check = IdRangeCheck(mixed, val_sampler, model_vocab, "validation split")
        val_sources = {}
        for name, d, w in zip(blend.names, blend.datasets, blend.val):
            s = GlobalBatchSampler(w.num_samples, train.global_batch, train.micro_batch, topo.dp, topo.dp_rank,
                                   train.seed, d.fingerprint)
            val_sources[name] = (_for_rank(w, topo), s, IdRangeCheck(w, s, model_vocab, f"'{name}' validation split"))
    data = TrainData(blend.datasets[0], windows, sampler, loader, val_windows, val_sampler, device, verifiers[0],
                     val_check, val_sources)
    for v in verifiers:
        weakref.finalize(data, v.close)
    return data


def build_train_data(cfg: JobConfig, topo: Topology, device: torch.device,
                     model_vocab: int) -> TrainData:
    if cfg.data.blend:
        return build_blend_data(cfg, topo, device, model_vocab)
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
                            before_step=verifier.poll, log=_print_rank0(topo), token_keys=_wants_token_keys(cfg))
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
