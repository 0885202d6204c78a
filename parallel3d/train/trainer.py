"""The training loop.

It sees a model, a loss function, an optimizer, a micro-batch schedule and a topology; it
never branches on which kinds of parallelism are on. One step::

    micro_batches = sampler.step_indices(step)          # this dp rank's share
    loss = schedule.run(micro_batches)                  # forward + backward, grads summed
    grad_norm = optimizer.step(lr)                      # dp sync, global clip, AdamW

The schedule is the pipeline schedule (``parallel3d.pipeline``); with ``pp = 1`` it is the
plain loop, forward and backward of each micro-batch in turn.

The loss of a step is the mean over every token of the global batch: each micro-batch's
mean is divided by the number of micro-batches, and the data-parallel ranks average.
"""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path

import torch
import torch.distributed as dist

from parallel3d.checkpoint import Checkpointer
from parallel3d.config import JobConfig
from parallel3d.distributed import all_reduce, local_rank
from parallel3d.errors import UserError
from parallel3d.models.llama import Llama
from parallel3d.models.llama.parallelize import activation_shape, apply_recompute, parallelize_llama
from parallel3d.pipeline import build_schedule
from parallel3d.pipeline.timeline import write_trace
from parallel3d.topology import Topology
from parallel3d.train.data import GlobalBatchSampler, TokenWindows, prepare_corpus
from parallel3d.train.metrics import MetricsLogger
from parallel3d.train.optim import build_optimizer, lr_at
from parallel3d.train.setup import check_job, resolve_model_config


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
        apply_recompute(self.model, cfg.train.recompute)
        self.model.to(self.device)
        # Weights from the checkpoint being resumed (or model.hf_checkpoint) before the
        # optimizer exists, so that any master copy it takes starts from them.
        self.checkpointer = Checkpointer(cfg, topo, self.model_cfg)
        self.checkpointer.load_weights(self.model)
        self.optimizer = build_optimizer(self.model.parameters(), cfg.train, cfg.parallel, topo,
                                         model=self.model)
        self.schedule = build_schedule(
            self.model, self.loss_fn, topo, cfg.parallel, device=self.device,
            activation_shape=activation_shape(self.model_cfg, cfg.train.micro_batch,
                                              cfg.train.seq_len, topo.tp,
                                              cfg.parallel.sequence_parallel),
            autocast=_autocast_for(cfg, self.device), record_steps=cfg.run.trace_steps)
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
        # The loss all-reduce goes before the step: the sharded optimizer ends its step by
        # issuing asynchronous all-gathers on the dp group, which it would queue behind.
        loss = all_reduce(loss, self.topo.dp_group) / self.topo.dp
        with self.schedule.timeline.span("optimizer", "optimizer"):
            grad_norm = self.optimizer.step(lr)
        self._sync()
        dt = time.perf_counter() - t0
        self.step += 1
        tokens = cfg.global_batch * cfg.seq_len
        record = {"step": self.step, "loss": float(loss), "lr": lr, "grad_norm": grad_norm,
                  "tokens_per_s": tokens / dt, "step_time_s": dt, **self.schedule.step_metrics()}
        if self.step == min(self.cfg.run.trace_steps, self.cfg.train.steps):
            write_trace(self.schedule.timeline, Path(self.cfg.run.dir) / "trace.json", self.topo)
        return record

    def _log_memory(self) -> None:
        """Per-rank bytes of parameters, gradients and optimizer state (from storage) to
        ``RUN_DIR/memory.json``; rank 0 prints its own line."""
        from parallel3d.zero.memory import memory_report

        report = {**memory_report(self.model, self.optimizer), **self.topo.coords()}
        reports = [report]
        if dist.is_initialized() and self.topo.world_size > 1:
            reports = [None] * self.topo.world_size
            dist.all_gather_object(reports, report)
        if self.metrics is not None:
            (Path(self.cfg.run.dir) / "memory.json").write_text(json.dumps(reports, indent=1))
            mib = {k: report[k] / 2**20 for k in ("params", "grads", "optimizer_state")}
            print(f"memory rank 0 (MiB): params {mib['params']:.1f}  grads {mib['grads']:.1f}  "
                  f"optimizer state {mib['optimizer_state']:.1f}  "
                  f"(zero={self.cfg.parallel.zero}, all ranks in memory.json)", flush=True)

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
            if self.step == 1:  # every buffer exists after the first step
                self._log_memory()
            self.checkpointer.maybe_save(self)
        if self.step >= self.cfg.train.steps:
            self.checkpointer.finish(self)
        else:
            self.checkpointer.writer.wait()
        if self.metrics is not None:
            self.metrics.close()
        return history
