"""The training loop.

It sees a model, a loss function, an optimizer, a micro-batch schedule and a topology; it
never branches on which kinds of parallelism are on. One step::

    micro_batches = sampler.step_indices(step)          # this dp rank's share
    loss = schedule.run(micro_batches)                  # forward + backward, grads summed
    grad_norm = optimizer.step(lr)                      # dp sync, global clip, AdamW

The loss of a step is the mean over every token of the global batch: each micro-batch's
mean is divided by the number of micro-batches, and the data-parallel ranks average.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import torch
import torch.distributed as dist

from parallel3d.checkpoint import Checkpointer
from parallel3d.config import JobConfig
from parallel3d.distributed import all_reduce, local_rank
from parallel3d.errors import UserError
from parallel3d.models.llama import Llama
from parallel3d.models.llama.parallelize import parallelize_llama
from parallel3d.tensor_parallel import sync_tensor_parallel_grads
from parallel3d.topology import Topology
from parallel3d.train.data import GlobalBatchSampler, TokenWindows, prepare_corpus
from parallel3d.train.metrics import MetricsLogger
from parallel3d.train.optim import DataParallelOptimizer, lr_at
from parallel3d.train.setup import check_job, resolve_model_config


class MicroBatchLoop:
    """The schedule without pipeline parallelism: forward and backward each micro-batch
    in turn, gradients accumulating in ``.grad``. Returns the step's mean loss on this
    rank (a detached scalar)."""

    def __init__(self, model, loss_fn, autocast):
        self.model, self.loss_fn, self.autocast = model, loss_fn, autocast

    def run(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        n = len(micro_batches)
        total = torch.zeros((), dtype=torch.float32)
        for inputs, targets in micro_batches:
            with self.autocast():
                logits = self.model(inputs)
            loss = self.loss_fn(logits, targets) / n
            loss.backward()
            total += loss.detach().float().cpu()
        return total


def _autocast_for(cfg: JobConfig, device: torch.device):
    wants_bf16 = cfg.train.dtype == "bf16" or (cfg.train.dtype == "auto" and device.type == "cuda")
    if not wants_bf16:
        return contextlib.nullcontext
    return lambda: torch.autocast(device.type, dtype=torch.bfloat16)


class Trainer:
    def __init__(self, cfg: JobConfig, topo: Topology, device: torch.device | None = None,
                 log: bool = True):
        self.cfg, self.topo = cfg, topo
        self.device = device or torch.device("cpu")
        self.model_cfg = resolve_model_config(cfg.model)
        check_job(cfg, self.model_cfg, topo.world_size)

        self.windows = TokenWindows(self._corpus_tokens(), cfg.train.seq_len)
        # Every rank builds the full model from the same seed, then keeps its part, so
        # any layout starts from exactly the weights of the unsplit model.
        torch.manual_seed(cfg.train.seed)
        model = Llama(self.model_cfg)
        self.model, self.loss_fn = parallelize_llama(model, topo, cfg.parallel)
        self.model.to(self.device)
        # Weights from the checkpoint being resumed (or model.hf_checkpoint) before the
        # optimizer exists, so that any master copy it takes starts from them.
        self.checkpointer = Checkpointer(cfg, topo, self.model_cfg)
        self.checkpointer.load_weights(self.model)
        self.optimizer = DataParallelOptimizer(list(self.model.parameters()), cfg.train, topo)
        self.schedule = MicroBatchLoop(self.model, self.loss_fn, _autocast_for(cfg, self.device))
        self.sampler = GlobalBatchSampler(
            self.windows.num_samples, cfg.train.global_batch, cfg.train.micro_batch,
            topo.dp, topo.dp_rank, cfg.train.seed)
        self.step = 0
        self.step = self.checkpointer.load_training_state(self)
        is_logger = log and topo.rank == 0
        resumed = self.checkpointer.resumed_from is not None
        self.metrics = (MetricsLogger(Path(cfg.run.dir), cfg.to_dict(),
                                      resume_step=self.step if resumed else None)
                        if is_logger else None)

    def _corpus_tokens(self):
        # One process per node writes the cache; the others wait for it.
        corpus = prepare_corpus(self.cfg.data) if local_rank() == 0 else None
        if dist.is_initialized():
            dist.barrier()
        corpus = corpus or prepare_corpus(self.cfg.data)
        vocab = corpus.meta["vocab_size"]
        if vocab > self.model_cfg.vocab_size:
            raise UserError(f"the tokenizer's vocabulary ({vocab}) exceeds model.vocab_size "
                            f"{self.model_cfg.vocab_size}: raise model.vocab_size or lower data.vocab_size")
        return corpus.tokens()

    def _micro_batches(self, step: int):
        out = []
        for idx in self.sampler.step_indices(step):
            x, y = self.windows.batch(idx)
            out.append((x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)))
        return out

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def train_step(self) -> dict:
        """One optimizer step; returns its metrics (the same on every rank)."""
        cfg = self.cfg.train
        self._sync()
        t0 = time.perf_counter()
        lr = lr_at(self.step, cfg)
        self.optimizer.zero_grad()
        loss = self.schedule.run(self._micro_batches(self.step))
        # Parameters held by several tp ranks with partial gradients (norms under sequence
        # parallelism, replicated kv-heads): sum them; a no-op for any other layout.
        sync_tensor_parallel_grads(self.model.parameters(), self.topo)
        grad_norm = self.optimizer.step(lr)
        loss = all_reduce(loss, self.topo.dp_group) / self.topo.dp
        self._sync()
        dt = time.perf_counter() - t0
        self.step += 1
        tokens = cfg.global_batch * cfg.seq_len
        return {"step": self.step, "loss": float(loss), "lr": lr, "grad_norm": grad_norm,
                "tokens_per_s": tokens / dt, "step_time_s": dt}

    def fit(self, stop_at: int | None = None) -> list[dict]:
        """Train to ``train.steps`` (or stop after step ``stop_at``, as a run that is
        interrupted and resumed later); returns the records of the steps run."""
        history = []
        end = self.cfg.train.steps if stop_at is None else min(stop_at, self.cfg.train.steps)
        while self.step < end:
            record = self.train_step()
            history.append(record)
            if self.metrics is not None:
                self.metrics.log(record, console=record["step"] % self.cfg.train.log_interval == 0
                                 or record["step"] == self.cfg.train.steps)
            self.checkpointer.maybe_save(self)
        if self.step >= self.cfg.train.steps:
            self.checkpointer.finish(self)
        else:
            self.checkpointer.writer.wait()
        if self.metrics is not None:
            self.metrics.close()
        return history
