"""The training loop.

It sees a model, a loss function, an optimizer, a micro-batch schedule and a topology; it
never branches on which kinds of parallelism are on. One step::

    micro_batches, wait = loader.next()                 # this dp rank's share, prefetched
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

from parallel3d.config import JobConfig
from parallel3d.distributed import all_reduce
from parallel3d.models.llama import Llama
from parallel3d.models.llama.parallelize import parallelize_llama
from parallel3d.topology import Topology
from parallel3d.train.data import build_train_data
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

        self.data = build_train_data(cfg, topo, self.device, self.model_cfg.vocab_size)
        # Every rank builds the full model from the same seed, then keeps its part, so
        # any layout starts from exactly the weights of the unsplit model.
        torch.manual_seed(cfg.train.seed)
        model = Llama(self.model_cfg)
        self.model, self.loss_fn = parallelize_llama(model, topo, cfg.parallel)
        self.model.to(self.device)
        self.optimizer = DataParallelOptimizer(list(self.model.parameters()), cfg.train, topo)
        self.schedule = MicroBatchLoop(self.model, self.loss_fn, _autocast_for(cfg, self.device))
        self.sampler = self.data.sampler  # its state_dict() is the data position to checkpoint
        self.step = 0
        is_logger = log and topo.rank == 0
        self.metrics = MetricsLogger(Path(cfg.run.dir), cfg.to_dict()) if is_logger else None

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
        micro_batches, data_wait = self.data.loader.next()  # built ahead, in the background
        loss = self.schedule.run(micro_batches)
        grad_norm = self.optimizer.step(lr)
        loss = all_reduce(loss, self.topo.dp_group) / self.topo.dp
        self._sync()
        dt = time.perf_counter() - t0
        self.step += 1
        tokens = cfg.global_batch * cfg.seq_len
        return {"step": self.step, "loss": float(loss), "lr": lr, "grad_norm": grad_norm,
                "tokens_per_s": tokens / dt, "step_time_s": dt, "data_wait_s": data_wait}

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean loss over every token of ``eval.batches`` global batches of the validation
        split (the same sequences at every evaluation).

        The forward here is the plain model's: a pipelined model must route this through
        its schedule's forward-only path instead.
        """
        n_batches, autocast = self.cfg.eval.batches, _autocast_for(self.cfg, self.device)
        total = torch.zeros((), dtype=torch.float32)
        for b in range(n_batches):
            micro_batches = self.data.val_micro_batches(b)
            for inputs, targets in micro_batches:
                with autocast():
                    logits = self.model(inputs)
                total += self.loss_fn(logits, targets).float().cpu() / (len(micro_batches) * n_batches)
        return float(all_reduce(total, self.topo.dp_group) / self.topo.dp)

    def fit(self) -> list[dict]:
        history = []
        while self.step < self.cfg.train.steps:
            record = self.train_step()
            interval = self.cfg.eval.interval
            if interval and record["step"] % interval == 0:
                record["val_loss"] = self.evaluate()
            history.append(record)
            if self.metrics is not None:
                self.metrics.log(record, console=record["step"] % self.cfg.train.log_interval == 0
                                 or record["step"] == self.cfg.train.steps)
        self.data.loader.close()
        if self.metrics is not None:
            self.metrics.close()
        return history
