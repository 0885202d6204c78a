"""Running a pipeline plan on this rank: the object the trainer calls each step.

    schedule = build_schedule(model, loss_fn, topo, parallel_cfg, activation_shape, ...)
    loss = schedule.run(micro_batches)      # forwards and backwards of one optimizer step

``run`` walks the rank's plan (``schedules.plan``): before each step it exchanges, in one
batch, the outputs of the previous step and the inputs of this one (``p2p.StageComm``);
then it runs the step's forwards and backwards. Gradients accumulate in ``.grad`` across
micro-batches. Only the last stage computes the loss; each micro-batch's loss is divided
by the number of micro-batches before its backward, exactly as without a pipeline, and
the step's loss is summed over the pipeline group so every rank returns it.

A micro-batch is an ``(inputs, targets)`` pair, or an object with ``inputs``, ``targets``,
``positions`` and ``loss_divisor`` (``parallel3d.data.batch.MicroBatch``: chat data and
packed documents). Its ``positions`` go to every chunk this rank runs, not only the
first: each stage needs the document boundaries of the micro-batch it is working on. With
a ``loss_divisor`` the last stage calls ``loss_fn(out, targets, loss_divisor)`` (the sum
of the supervised tokens' losses over the divisor) instead of dividing the mean by the
number of micro-batches.

With ``pp = 1`` the plan is forward, backward per micro-batch with no communication,
which is the plain gradient-accumulation loop.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
from torch import nn

from parallel3d.distributed import all_reduce

from .p2p import StageComm
from .partition import rank_chunks
from .schedules import Action, Message, exchanges, plan
from .timeline import Timeline


def _parts(mb) -> tuple[torch.Tensor, torch.Tensor, dict, float | None]:
    """(inputs, targets, keyword arguments of every chunk, loss divisor) of a micro-batch."""
    if isinstance(mb, (tuple, list)):
        return mb[0], mb[1], {}, None
    return mb.inputs, mb.targets, mb.chunk_kwargs(), mb.loss_divisor


def _micro_batch_loss(loss_fn, out, targets, divisor: float | None, n_micro: int) -> torch.Tensor:
    """One micro-batch's share of the step's loss: its mean over the number of
    micro-batches, or (masked data) its sum over the divisor the batch carries."""
    if divisor is None:
        return loss_fn(out, targets) / n_micro
    return loss_fn(out, targets, divisor)


@dataclass
class _StepState:
    """What one step holds between actions, keyed by (kind, chunk, micro-batch)."""

    micro_batches: list
    inbox: dict = field(default_factory=dict)  # received activations and gradients
    outbox: dict = field(default_factory=dict)  # outputs waiting for the next exchange
    stash: dict = field(default_factory=dict)  # (chunk, mb) -> (input, output): alive activations
    loss: torch.Tensor | None = None  # sum of this step's micro-batch losses (last stage)


class PipelineSchedule:
    """Executes schedule ``name`` over this rank's ``chunks`` (global chunk ids from
    ``partition.rank_chunks``). ``peak_alive`` is the most (chunk, micro-batch) pairs whose
    activations were alive at once in the last step (forwarded, not yet backwarded)."""

    def __init__(self, chunks: list[nn.Module], loss_fn, topo, *, name: str, virtual_stages: int,
                 activation_shape: tuple[int, ...], activation_dtype: torch.dtype,
                 device: torch.device, autocast=contextlib.nullcontext,
                 timeline: Timeline | None = None, watch=None):
        self.topo, self.name, self.v = topo, name, virtual_stages
        self.pp, self.n_chunks = topo.pp, topo.pp * virtual_stages
        ids = rank_chunks(topo.pp_rank, topo.pp, virtual_stages)
        assert len(ids) == len(chunks), (ids, len(chunks))
        self.chunks = dict(zip(ids, chunks))
        self.loss_fn, self.autocast, self.device = loss_fn, autocast, device
        self.comm = StageComm(topo.pp_group, topo.pp_ranks, activation_shape, activation_dtype,
                              device) if topo.pp > 1 else None
        self.timeline = timeline or Timeline(device)
        self.peak_alive = 0
        self.steps_run = 0
        self.watch = watch  # a reliability.CommWatch told of each send/recv, if given

    def run(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]],
            reduce_loss: bool = True) -> torch.Tensor:
        """Forward and backward every micro-batch; returns the step's mean loss (a detached
        fp32 scalar, the same on every rank of the pipeline).

        With ``reduce_loss=False`` it returns this rank's part instead (the last stage's
        loss, 0 on the others) and leaves the step window open: the caller sums the loss
        in its own closing collective (the trainer's one all-reduce per step) and closes
        the window after it (``timeline.close_window``)."""
        steps = plan(self.name, self.pp, self.v, len(micro_batches), self.topo.pp_rank)
        batches = exchanges(steps, self.pp, self.n_chunks)
        # No synchronisation opens the window: every rank left the previous step's closing
        # collective together, so the windows start within a collective's skew of each
        # other without another round trip.
        self.timeline.start_step(self.steps_run + 1)  # numbered from 1, as in metrics.jsonl
        st = _StepState(micro_batches, loss=torch.zeros((), dtype=torch.float32, device=self.device))
        self.peak_alive = 0
        self._exchange(batches[0], st)
        for step, batch in zip(steps, batches[1:]):
            for action in step:
                if action.op == "F":
                    self._forward(action, st)
                else:
                    self._backward(action, st)
            self._exchange(batch, st)
        assert not st.stash and not st.inbox and not st.outbox, "plan left work undone"
        if self.comm is not None:
            if self.watch is not None:
                self.watch.enter("pipeline send/recv [last sends]", "pp")
            with self.timeline.span("wait", "wait", lane="comm", ops="last sends"):
                self.comm.flush()
        self.timeline.end_work()
        self.steps_run += 1
        if not reduce_loss:
            return st.loss
        with self.timeline.span("pp collectives", "comm", lane="comm"):
            if self.watch is not None:
                self.watch.enter("loss sum over the pipeline", "pp")
            loss = all_reduce(st.loss, self.topo.pp_group)  # only the last stage's is non-zero
        self.timeline.close_window()
        return loss

    @torch.no_grad()
    def forward_only(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """The mean loss over ``micro_batches`` without a backward pass (validation): a
        detached fp32 scalar, the same on every rank of the pipeline.

        Every rank walks the (micro-batch, global chunk) pairs in lexicographic order and
        runs the chunks it holds: receive the activation from the previous chunk's rank,
        forward, send to the next chunk's rank. Each message goes from a pair to a later
        one in that common order, so the earliest unfinished pair can always proceed (no
        deadlock, whatever the virtual stages); sends are waited for after the next
        receive, as in :meth:`run`. Nothing is kept for a backward pass."""
        total = torch.zeros((), dtype=torch.float32, device=self.device)
        last = self.n_chunks - 1
        for mb, batch in enumerate(micro_batches):
            inputs, targets, side, divisor = _parts(batch)
            for c in range(self.n_chunks):
                if c not in self.chunks:
                    continue
                if c == 0:
                    x = inputs
                else:
                    msg = Message("act", c - 1, mb, src=(c - 1) % self.pp, dst=c % self.pp)
                    if self.watch is not None:
                        self.watch.enter(f"pipeline send/recv [eval recv act{c - 1}.{mb}]", "pp")
                    (x,) = self.comm.exchange([], [msg])
                with self.autocast():
                    out = self.chunks[c](x, **side)
                if c == last:
                    total += _micro_batch_loss(self.loss_fn, out, targets, divisor,
                                               len(micro_batches)).float()
                else:
                    msg = Message("act", c, mb, src=c % self.pp, dst=(c + 1) % self.pp)
                    if self.watch is not None:
                        self.watch.enter(f"pipeline send/recv [eval send act{c}.{mb}]", "pp")
                    self.comm.exchange([(msg, out)], [])
        if self.comm is not None:
            if self.watch is not None:
                self.watch.enter("pipeline send/recv [eval last sends]", "pp")
            self.comm.flush()
            if self.watch is not None:
                self.watch.enter("eval loss sum over the pipeline", "pp")
        return all_reduce(total, self.topo.pp_group)  # only the last stage's is non-zero

    # -- the two actions --------------------------------------------------------------------
    def _forward(self, a: Action, st: _StepState) -> None:
        inputs, targets, side, divisor = _parts(st.micro_batches[a.mb])
        if a.chunk == 0:
            x = inputs  # (mb, S) tokens
        else:
            x = st.inbox.pop(("act", a.chunk - 1, a.mb)).requires_grad_()  # (mb, S, dim)
        last = a.chunk == self.n_chunks - 1
        with self.timeline.span(f"F{a.chunk}.{a.mb}", "forward", chunk=a.chunk, mb=a.mb):
            with self.autocast():
                out = self.chunks[a.chunk](x, **side)  # side: positions (and spans), for every chunk
            if last:
                # The mean over micro-batches, as the unsplit model: each loss / m (or,
                # masked, each sum / the global batch's supervised tokens over dp).
                out = _micro_batch_loss(self.loss_fn, out, targets, divisor, len(st.micro_batches))
                st.loss += out.detach().float()
        if not last:
            st.outbox[("act", a.chunk, a.mb)] = out.detach()
        st.stash[(a.chunk, a.mb)] = (x, out)
        self.peak_alive = max(self.peak_alive, len(st.stash))

    def _backward(self, a: Action, st: _StepState) -> None:
        x, out = st.stash.pop((a.chunk, a.mb))
        grad = None if a.chunk == self.n_chunks - 1 else st.inbox.pop(("grad", a.chunk + 1, a.mb))
        with self.timeline.span(f"B{a.chunk}.{a.mb}", "backward", chunk=a.chunk, mb=a.mb):
            torch.autograd.backward(out, grad_tensors=grad)
        if a.chunk > 0:
            st.outbox[("grad", a.chunk, a.mb)] = x.grad

    # -- communication ----------------------------------------------------------------------
    def _exchange(self, batch: tuple[list[Message], list[Message]], st: _StepState) -> None:
        sends, recvs = batch
        if not sends and not recvs:
            return
        payload = [(msg, st.outbox.pop((msg.kind, msg.chunk, msg.mb))) for msg in sends]
        label = " ".join([f"send {m.kind}{m.chunk}.{m.mb}" for m in sends]
                         + [f"recv {m.kind}{m.chunk}.{m.mb}" for m in recvs])
        if self.watch is not None:
            self.watch.enter(f"pipeline send/recv [{label}]", "pp")
        with self.timeline.span("wait", "wait", lane="comm", ops=label):
            received = self.comm.exchange(payload, recvs)
        if self.watch is not None:
            self.watch.resume()
        for msg, tensor in zip(recvs, received):
            st.inbox[(msg.kind, msg.chunk, msg.mb)] = tensor

    # -- metrics ----------------------------------------------------------------------------
    def step_metrics(self) -> dict:
        """``bubble_fraction``: idle share of the last step's window, mean over all ranks
        (the same value on every rank), by its own all-reduce. The trainer does not call
        this: the bubble rides its one collective per step with the other per-rank figures."""
        bubble = torch.tensor([self.timeline.last_bubble or 0.0], dtype=torch.float64, device=self.device)
        all_reduce(bubble, self.topo.world_group)
        return {"bubble_fraction": float(bubble) / self.topo.world_size}


def build_schedule(model: nn.Module, loss_fn, topo, parallel_cfg, *, activation_shape: tuple[int, ...],
                   device: torch.device, autocast=contextlib.nullcontext,
                   timeline: Timeline | None = None, watch=None) -> PipelineSchedule:
    """The schedule for this rank's ``model``: its ``pipeline_chunks`` when the model was
    cut into stages (``parallelize``), else the model as the single chunk (pp = 1).
    Activations cross between stages in the parameters' dtype."""
    chunks = list(getattr(model, "pipeline_chunks", None) or [model])
    dtype = next(model.parameters()).dtype
    return PipelineSchedule(chunks, loss_fn, topo, name=parallel_cfg.schedule,
                            virtual_stages=parallel_cfg.virtual_stages,
                            activation_shape=activation_shape, activation_dtype=dtype,
                            device=device, autocast=autocast, timeline=timeline, watch=watch)
