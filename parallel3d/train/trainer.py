"""The training loop.

It sees a model, a loss function, an optimizer, a micro-batch schedule and a topology; it
never branches on which kinds of parallelism are on. One step::

    micro_batches, _ = loader.next()                # this dp rank's share, prefetched
    optimizer.begin_step(len(micro_batches))        # zero grads; buckets reduce as they fill
    loss_part = schedule.run(micro_batches, reduce_loss=False)  # forward + backward
    norm_share = optimizer.reduce_gradients()       # dp sync, tp partial sums; share of |g|^2
    norm, loss = _step_sums(norm_share, loss_part)  # the step's one world all-reduce
    optimizer.apply(lr, norm, skip=not finite(loss))  # global clip, AdamW

The schedule is the pipeline schedule (``parallel3d.pipeline``); with ``pp = 1`` it is the
plain loop, forward and backward of each micro-batch in turn.

The model is built on the meta device and only this rank's shards are allocated, on the
training device and in the storage dtype (bf16 under ``train.dtype = bf16``), then filled
by the layout-independent counter-based initialisation or read from the checkpoint being
resumed or ``model.hf_checkpoint`` (this rank's slices only): no rank ever holds the full
model.

A step whose loss or gradient norm is not finite changes no weight (the optimizer skips
it, on every rank alike); ``reliability.on_nonfinite`` then either goes on ("skip": the
batch is consumed, the step number and the learning-rate schedule advance, the step is
counted in ``skipped_steps``) or stops (:class:`~parallel3d.reliability.TrainingStopped`,
after calling ``on_stop(trainer)`` -- the checkpoint hook -- when one is set).

The loss of a step is the mean over the global batch's supervised tokens (plain text: each
micro-batch's mean / micro-batches, dp ranks averaged; masked data: ``loss_divisor``).
"""

from __future__ import annotations

import math
import sys
import time
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

from parallel3d.checkpoint import Checkpointer
from parallel3d.config import JobConfig
from parallel3d.data.batch import IGNORE_INDEX
from parallel3d.data.source_loss import SourceLossSums, source_figures
from parallel3d.distributed import all_reduce, all_reduce_sum_max
from parallel3d.lora import apply_lora, start_adapters_
from parallel3d.models import model_family
from parallel3d.observe.stats import StepObserver
from parallel3d.pipeline import build_schedule
from parallel3d.pipeline.timeline import Timeline, write_trace
from parallel3d.reliability import CommWatch, StepGuard, TrainingStopped
from parallel3d.tensor_parallel.gemm_backends import prepare_linear_backends
from parallel3d.tensor_parallel.init import materialize_
from parallel3d.topology import Topology
from parallel3d.train.data import build_train_data
from parallel3d.train.moe import MoESteps
from parallel3d.train.optim import autocast_for, build_optimizer, lr_at, storage_dtype
from parallel3d.train.records import StepRecords
from parallel3d.train.setup import check_job, check_paths, resolve_model_config
from parallel3d.zero.memory import log_memory


class Trainer:
    """``step_hooks``: callables ``hook(trainer)`` run inside every step, after its forward
    and backward and before its collectives (tests use one to slow a rank down)."""

    def __init__(self, cfg: JobConfig, topo: Topology, device: torch.device | None = None,
                 log: bool = True, watch: CommWatch | None = None, on_stop="checkpoint"):
        """``on_stop``: called as ``on_stop(trainer)`` before a "stop" exit on a non-finite
        step; "checkpoint" (the default) saves through the checkpointer when this run
        writes checkpoints, None does nothing."""
        self.cfg, self.topo = cfg, topo
        rel = cfg.reliability
        # Where this rank is (step, operation, group), for the report of a failed collective.
        self.watch = watch or CommWatch(topo, rel.comm_timeout_s, rel.heartbeat_s)
        self.device = device or torch.device("cpu")
        self.model_cfg = resolve_model_config(cfg.model)
        check_job(cfg, self.model_cfg, topo.world_size)
        check_paths(cfg)  # the directories it writes, as the launching process checks them

        self.data = build_train_data(cfg, topo, self.device, self.model_cfg.vocab_size)
        self.sampler = self.data.sampler  # its state_dict() is the data position to checkpoint
        self.checkpointer = Checkpointer(cfg, topo, self.model_cfg)
        self.dtype = storage_dtype(cfg.train, self.device)
        family = model_family(cfg.model.family)  # models/<family>/: its model and its parallelize
        self._build_model(family)  # model, loss_fn, timeline, moe, optimizer: this rank's weights filled
        self.schedule = build_schedule(
            self.model, self.loss_fn, topo, cfg.parallel, device=self.device,
            activation_shape=family.activation_shape(self.model_cfg, cfg.train.micro_batch, cfg.train.seq_len,
                                              topo.tp, cfg.parallel.sequence_parallel, topo.cp),
            autocast=autocast_for(cfg.train, self.device), timeline=self.timeline, watch=self.watch)
        # data.blend: each source's loss sums and supervised tokens per step (loss/<name>)
        self.source_names = self.data.source_names
        self.source_sums = SourceLossSums(len(self.source_names), self.device) if self.source_names else None
        if self.source_sums is not None and hasattr(self.loss_fn, "per_source"):
            self.loss_fn.per_source = self.source_sums
        self.observer = StepObserver(cfg.observability, topo, self.device, self.model_cfg,
                                     global_batch=cfg.train.global_batch, seq_len=cfg.train.seq_len)
        self.step_hooks: list = []
        # the innermost group with collectives inside forward/backward (tp, pp sends, ZeRO 2)
        self._compute_axis = next((a for a in ("tp", "pp", "dp") if getattr(topo, a) > 1), "world")
        self.guard = StepGuard(rel.on_nonfinite, rel.spike_factor, rel.spike_window, self._warn)
        # Optimizer, data position and RNG of the checkpoint being resumed; its step.
        self.step = self.checkpointer.load_training_state(self)
        # Every rank loaded before any collective bound by comm_timeout_s (and before the
        # first step arms the watchdog): the slowest rank's load is nobody's hang.
        self.checkpointer.wait_for_every_rank()
        if on_stop == "checkpoint":
            on_stop = self.checkpointer.save_now if self.checkpointer.enabled else None
        self.on_stop = on_stop
        resumed = self.checkpointer.resumed_from is not None
        # each step's record until it is complete, and rank 0's writers (metrics.jsonl, sinks)
        self.records = StepRecords(cfg, self.observer, self.timeline, log and topo.rank == 0,
                                   self.step if resumed else None)
        self.metrics = self.records.metrics
        self._memory_logged = False

    def _build_model(self, family) -> None:
        """This rank's part of the model on meta; the optimizer allocates its shards once in
        the storage dtype, filled by the seeded init or read slice by slice; fp32 masters last."""
        cfg, topo = self.cfg, self.topo
        self.model, self.loss_fn = family.build_meta(self.model_cfg, topo, cfg.parallel)
        apply_lora(self.model, cfg, topo)  # [lora]: adapters on the targets, the rest frozen (rank 0: no change)
        family.apply_recompute(self.model, cfg.train.recompute)
        # linear_backend "auto" on CUDA: rank 0 times Triton against cuBLAS per GEMM shape
        # and every rank adopts its table (collective; nothing to do on CPU or at tp 1);
        # before anything is allocated, so that its temporaries do not add to the peak.
        prepare_linear_backends(self.model, cfg.parallel, cfg.train, topo.tp, self.device)
        self.timeline = Timeline(self.device, cfg.run.trace_steps)
        self.moe = MoESteps.of(self.model, self.model_cfg, topo, cfg.parallel, self.timeline, cfg.train, self.device)
        self.optimizer = build_optimizer(self.model.parameters(), cfg.train, cfg.parallel, topo,
                                         model=self.model, timeline=self.timeline,
                                         device=self.device, dtype=self.dtype)
        materialize_(self.model, self.device, self.dtype)  # what the optimizer does not hold (LoRA: the frozen weights)

        def fill(write) -> None:  # ZeRO 3: bucket by bucket, each bucket's adapters with it
            def both(ps):
                write(ps)
                if not self.checkpointer.adapters_loaded:  # a resumed run has its checkpoint's
                    start_adapters_(self.model, cfg.lora, cfg.train.seed, only=ps)  # seeded, or a PEFT folder
            self.optimizer.fill_params(both)
        if not self.checkpointer.has_weights_to_load():
            fill(lambda params: family.initialize_(self.model, cfg.train.seed, only=params))
        else:
            self.checkpointer.load_weights(self.model, fill)
        self.optimizer.take_masters()

    def train_step(self) -> dict:
        """One optimizer step; returns its record (the same on every rank).

        The record's per-rank figures (breakdown, bubble, per-rank times and memory,
        stragglers) arrive with the next step's collective: they are added to this same
        dict then, or by :meth:`finish_records` after the last step."""
        cfg = self.cfg.train
        if self.step == 0 and dist.is_initialized() and self.topo.world_size > 1:
            dist.barrier()  # start the first step together: its time is not setup's skew
        # No device-wide synchronisation: the host waits for the loss (the closing collective)
        # and an event after the update (wait_for_issued_work); the parameter all-gathers
        # apply() issues on their own stream run under the next step's forward.
        t0, cpu0 = time.perf_counter(), time.process_time()
        timeline = self.timeline
        timeline.begin_step(self.step + 1)
        lr = lr_at(self.step, cfg)
        self.watch.step = self.step + 1
        # no collective, not judged (a first batch on a loaded host took seconds); peers: "waiting for data"
        self.watch.pause("waiting for data")
        with timeline.span("data", "data"):  # the wait for batches built in the background
            micro_batches, _ = self.data.loader.next()
        self.watch.compute("forward/backward", self._compute_axis)
        self.optimizer.begin_step(len(micro_batches))  # buckets reduce as the last backward fills them
        cpu1 = time.process_time()
        if self.moe is not None:
            self.moe.begin_step(len(micro_batches))
        loss_part = self.schedule.run(micro_batches, reduce_loss=False)
        cpu_fwd_bwd = time.process_time() - cpu1
        for hook in self.step_hooks:
            hook(self)
        # MoE: the step's expert counts summed over the replicas, the selection biases moved
        moe_parts = self.moe.finish_step() if self.moe is not None else None
        source_part = None if self.source_sums is None else self.source_sums.step_part(
            micro_batches, self.topo.is_last_stage and self.topo.tp_rank == 0, IGNORE_INDEX)
        with timeline.span("optimizer", "optimizer"):
            self.watch.enter("gradient sync", "dp")
            norm_share = self.optimizer.reduce_gradients()
            grad_norm, loss = self._step_sums(norm_share, loss_part, moe_parts, source_part)
            self.optimizer.apply(lr, grad_norm, skip=not math.isfinite(loss))
            self.wait_for_issued_work()  # the step's time includes its optimizer
        dt = time.perf_counter() - t0
        self.step += 1
        return self._record(loss, float(grad_norm), lr, dt, (time.process_time() - cpu0, cpu_fwd_bwd),
                            moe_parts, source_part)

    def _record(self, loss: float, grad_norm: float, lr: float, dt: float, cpu: tuple, moe_parts,
                source_part) -> dict:
        """The finished step's record; its per-rank row held until the next collective."""
        cfg, timeline = self.cfg.train, self.timeline
        record = {"step": self.step, "loss": loss, "lr": lr, "grad_norm": grad_norm,
                  "tokens_per_s": cfg.global_batch * cfg.seq_len / dt, "step_time_s": dt,
                  **self.observer.throughput(dt)}
        self.records.hold(record, self.observer.row(dt, timeline.step_spans(), timeline.last_bubble or 0.0, cpu))
        if moe_parts is not None:
            record.update(self.moe.record(moe_parts, dt))
        if source_part is not None:
            k = len(self.source_names)
            sums, tokens = source_part[:k].tolist(), [int(round(t)) for t in source_part[k:].tolist()]
            record.update(source_figures(self.source_names, sums, tokens))
        record.update(self._check_numbers(loss, grad_norm))
        if self.step == min(self.cfg.run.trace_steps, self.cfg.train.steps):
            write_trace(self.timeline, Path(self.cfg.run.dir) / "trace.json", self.topo)
        return record

    def wait_for_issued_work(self) -> None:
        """Return when the device has done the work this step issued on the current stream
        (the optimizer's update, the last issued).

        On CUDA ``apply()`` only queues its kernels: a step time taken when it returns
        leaves the update out (tokens/s and MFU too high, and the autopilot fitted to
        them), and the next step's time takes it in only partly, where the host blocks at
        the loss. An event recorded after ``apply()`` and waited for here ends the step
        after its own work, without a device-wide synchronize (other streams, such as the
        parameter all-gathers ZeRO issues for the next forward, go on). The cost: the host
        queues the next step's first kernels after the update, not during it (launch
        latency, microseconds). On CPU the update ran inside ``apply()``: nothing to wait."""
        if self.device.type == "cuda":
            done = torch.cuda.Event()
            done.record(torch.cuda.current_stream(self.device))
            done.synchronize()

    def _step_sums(self, norm_share: torch.Tensor, loss_part: torch.Tensor,
                   extra: dict | None = None, sources: torch.Tensor | None = None) -> tuple[torch.Tensor, float]:
        """The step's one collective: over the world, the sum of this rank's share of the
        squared gradient norm, of its share of the loss (the last stage's loss on its first
        tp rank; the dp x cp ranks' losses average: each cp rank's is the mean over its
        equal share of the tokens) and of the previous step's per-rank
        figures, with the maxima and minima of those figures (a payload of fixed size,
        :meth:`StepObserver.payload`). Returns (global norm, loss) and completes the
        previous step's record.

        Sums are taken in fp64 and rounded to fp32 before the square root and the division
        by dp x cp, which for two contributors is exactly the fp32 sum. ``extra``: the
        MoE step's parts (:meth:`MoESteps.finish_step`), summed or maxed with the rest and
        replaced by their world-reduced values in place."""
        topo, timeline = self.topo, self.timeline
        # the tp ranks of the last stage hold the same loss: the first one counts it
        loss_share = loss_part if topo.tp_rank == 0 else torch.zeros_like(loss_part)
        head = torch.stack([norm_share.reshape(()), loss_share.reshape(())]).double().to(self.device)
        previous = self.records.pending
        figures, maxes = self.observer.payload(previous[1] if previous else None)
        extra_sums = [extra[k].reshape(1).to(head) for k in ("aux_loss", "dropped")] if extra else []
        extra_max = [extra[k].reshape(1).to(head) for k in ("imbalance", "all_to_all_s")] if extra else []
        src = [] if sources is None else [sources.to(head)]
        sums = torch.cat([head, *src, *extra_sums, figures])
        maxes = torch.cat([*extra_max, maxes])
        self.watch.enter("step all-reduce (gradient norm, loss, per-rank metrics)", "world")
        with timeline.span("step sums", "comm", lane="comm"):
            all_reduce_sum_max(sums, maxes, topo.world_group)
        timeline.close_window(closing="step sums")
        head = sums[:2].float()
        if sources is not None:  # world sums: every supervised token of the global batch
            sources.copy_(sums[2:2 + sources.numel()])
            sums = torch.cat([sums[:2], sums[2 + sources.numel():]])
        if extra:
            extra.update(aux_loss=sums[2], dropped=sums[3], imbalance=maxes[0], all_to_all_s=maxes[1])
            sums, maxes = sums[2 + len(extra_sums):], maxes[len(extra_max):]
        else:
            sums = sums[2:]
        if previous is not None:
            self.records.complete(self.observer.summary(sums, maxes))
        return head[0].sqrt(), float(head[1] / topo.dp_cp)  # each dp x cp replica's share

    def finish_records(self) -> None:
        """Complete the last step's record by a collective of its own (every rank calls
        it: at the end of a run, before a checkpoint)."""
        self.records.finish()

    def completed_records(self) -> list[dict]:
        """Records completed since the last call (no collective)."""
        return self.records.take()

    def evaluate(self) -> float:
        """Mean loss over every token of ``eval.batches`` global batches of the validation
        split (the same sequences at every evaluation).

        The forward runs through the pipeline schedule's forward-only pass (the whole
        model as one chunk when pp = 1), so any layout evaluates the same sequences.
        """
        return self._val_loss(self.data.val_micro_batches)

    def evaluate_sources(self) -> dict:
        """``val_loss/<name>``: each data.blend source's held-out loss, as :meth:`evaluate`
        over that source's validation split (nothing for one dataset)."""
        return {f"val_loss/{name}": self._val_loss(partial(self.data.source_val_micro_batches, name))
                for name in self.source_names}

    @torch.no_grad()
    def _val_loss(self, micro_batches_of) -> float:
        # (no finish_param_gather: the forward waits for, or under ZeRO 3 gathers, each
        # module's buckets itself); on the device: the dp group may be NCCL's (CUDA only)
        n = self.cfg.eval.batches
        total = torch.zeros((), dtype=torch.float32, device=self.device)
        for b in range(n):
            total += self.schedule.forward_only(micro_batches_of(b)) / n
        return float(all_reduce(total, self.topo.dp_cp_group) / self.topo.dp_cp)

    def finish_param_gather(self) -> None:
        """Wait for the optimizer's post-step parameter all-gathers still in flight (ZeRO
        1/2 overlap them with the next forward; ZeRO 3 gathers every bucket): before
        anything reads the weights outside a forward (a checkpoint, the caller after the
        last step)."""
        finish = getattr(self.optimizer, "finish_param_gather", None)
        if finish is not None:
            finish()

    def _check_numbers(self, loss: float, grad_norm: float) -> dict:
        """Skip or stop on a non-finite step, flag a loss spike (``reliability.StepGuard``)."""
        g = self.cfg.train.global_batch
        start = (self.step - 1) * g
        batch = (f"; batch = global sample positions [{start}, {start + g}), epoch "
                 f"{start // self.data.windows.num_samples}")
        on_stop = None if self.on_stop is None else (lambda: self.on_stop(self))
        return self.guard.check(self.step, loss, grad_norm, on_stop, batch)

    def _warn(self, message: str) -> None:
        if self.topo.rank == 0:
            print(f"parallel3d: warning: {message}", file=sys.stderr, flush=True)

    def fit(self, stop_at: int | None = None) -> list[dict]:
        """Train to ``train.steps`` (or stop after step ``stop_at``, as a run that is
        interrupted and resumed later); returns the records of the steps run.

        Rank 0 prints each step's line (or moves the progress bar) as the step ends, and
        writes its record to metrics.jsonl and the sinks once the record is complete (one
        step later; before a checkpoint and at the end all pending records are
        completed, so metrics.jsonl holds every step a checkpoint covers)."""
        end = self.cfg.train.steps if stop_at is None else min(stop_at, self.cfg.train.steps)
        history = self.run_steps(end)
        self.close()
        return history

    def run_steps(self, end: int) -> list[dict]:
        """Train up to step ``end`` and return the records of the steps run; the run stays
        open (:meth:`close` ends it), so a caller can act between steps (the autopilot)."""
        history, records = [], self.records
        records.open_bar()
        while self.step < end:
            try:
                record = self.train_step()
            except TrainingStopped:
                records.report(records.take())  # what finished before the stop
                raise
            interval = self.cfg.eval.interval
            if interval and record["step"] % interval == 0:
                record["val_loss"] = self.evaluate()
                record.update(self.evaluate_sources())
            history.append(record)
            records.show(record)
            if not self._memory_logged:  # every buffer exists after this trainer's first step
                self._memory_logged = True
                log_memory(self.model, self.optimizer, self.topo,
                           Path(self.cfg.run.dir) if self.metrics is not None else None, self.cfg.parallel.zero)
            if self.checkpointer.due(self):
                records.finish()  # metrics.jsonl holds every step the checkpoint covers
            records.report(records.take())
            if self.checkpointer.due(self):
                self.watch.pause("checkpoint save")  # its own gloo group raises on a hang
                self.checkpointer.maybe_save(self)
        return history

    def flush_records(self) -> None:
        """Complete the last step's record and write every completed one (collective)."""
        self.records.flush()

    def log_event(self, event: dict) -> None:
        """A record that is not a step (the autopilot's decisions) into metrics.jsonl."""
        self.records.log_event(event)

    def close(self, finished: bool | None = None) -> None:
        """End the run: the last records, the final checkpoint and export when the run reached
        ``train.steps`` (else wait for a background save), the data loader, metrics and watch."""
        self.flush_records()
        if self.cfg.parallel.zero != 3:  # a caller may read the weights after (ZeRO 3: it asks, or OOM)
            self.finish_param_gather()
        self.watch.pause("end of the run")
        if finished is None:
            finished = self.step >= self.cfg.train.steps
        if finished:
            self.checkpointer.finish(self)
        else:
            self.checkpointer.writer.wait()
        self.release(close_watch=True)

    def release(self, close_watch: bool = False) -> None:
        """Let go of what this trainer holds open (the data loader's thread, the metrics
        files, the progress bar) without the end-of-run work; the process groups stay."""
        self.data.loader.close()
        self.records.close()
        if close_watch:
            self.watch.close()
