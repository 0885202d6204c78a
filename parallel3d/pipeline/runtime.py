"""Running a pipeline plan on this rank: the object the trainer calls each step.

    schedule = build_schedule(model, loss_fn, topo, parallel_cfg, activation_shape, ...)
    loss = schedule.run(micro_batches)      # forwards and backwards of one optimizer step

``run`` walks the rank's plan (``schedules.plan``): before each step it posts, in one batch,
the sends and receives ``schedules.batches`` gives it (``p2p.StageComm``), then runs the
step's actions, waiting for the batch just before the first action that reads a tensor
it receives (or after the step). Gradients accumulate in ``.grad`` across micro-batches.
A tensor between two chunks of this rank (the turn of zb-v's V) is handed over directly.

Schedules that split the backward (zb-h1, zb-v) run each B under
``kernels.deferred.deferring``: autograd computes the input gradients and the layers
record their weight gradients, which the plan's W of that (chunk, micro-batch) computes
later. They accumulate through autograd as an undivided backward's would (ZeRO's hooks
count them, so a bucket is reduced once the step's last W has filled it). A layer that
does not record its weight gradient (``tensor_parallel/split_backward.py``) computes it
in B, which changes when, not what. The first chunk's backward, whose input gradient
nobody waits for, runs undivided in its B (``actions.undivided_backwards``): the split
would cost time there and buy none; the trace shows one B span (``with_weight``) and no
W span for it. Only the last stage computes the loss; each micro-batch's loss is divided
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

from parallel3d.data.batch import running
from parallel3d.distributed import all_reduce

from parallel3d.kernels.deferred import DeferredWeightGrads, deferring

from .actions import Batch, inputs_of, outputs_of, undivided_backwards
from .p2p import StageComm
from .partition import rank_chunks
from .schedules import SPLIT_BACKWARD, Action, Message, batches, owners, plan
from .timeline import BUSY, Timeline


def _parts(mb) -> tuple[torch.Tensor, torch.Tensor, dict, float | None]:
    """(inputs, targets, keyword arguments of every chunk, loss divisor) of a micro-batch."""
    if isinstance(mb, (tuple, list)):
        return mb[0], mb[1], {}, None
    return mb.inputs, mb.targets, mb.chunk_kwargs(), mb.loss_divisor


def _micro_batch_loss(loss_fn, out, targets, divisor: float | None, n_micro: int,
                      sources: torch.Tensor | None = None) -> torch.Tensor:
    """One micro-batch's share of the step's loss: its mean over the number of
    micro-batches, or (masked data) its sum over the divisor the batch carries. ``sources``
    (a data.blend's rows): a loss function keeping per-source sums (``per_source``) gets them."""
    if sources is not None and getattr(loss_fn, "per_source", None) is not None:
        if divisor is None:
            return loss_fn(out, targets, sources=sources) / n_micro
        return loss_fn(out, targets, divisor, sources=sources)
    if divisor is None:
        return loss_fn(out, targets) / n_micro
    return loss_fn(out, targets, divisor)


_ENGINE = torch.autograd.Variable._execution_engine


def _drop_values(out: torch.Tensor) -> None:
    """Free a chunk's output once it is handed on (Megatron's ``deallocate_output_tensor``):
    the next chunk (or the send, until it completes) holds the values, and the backward
    needs only ``out``'s place in the graph. Its storage goes with the last holder; if
    autograd saved the output for its own backward, that copy keeps it, so nothing it
    reads changes."""
    if out._base is None and out.numel() > 1:
        out.data = torch.empty((0,), dtype=out.dtype, device=out.device)


def _backward_from(out: torch.Tensor, grad: torch.Tensor | None) -> None:
    """``torch.autograd.backward(out, grad)`` for an ``out`` whose values were dropped
    (its shape is no longer the gradient's): the engine checks the gradient against the
    graph's record of the output instead."""
    if grad is None:
        torch.autograd.backward(out)  # the loss, a scalar kept whole
    else:
        _ENGINE.run_backward((out,), (grad,), False, False, (), True, True)


@dataclass
class _StepState:
    """What one step holds between actions, keyed by (kind, chunk, micro-batch)."""

    micro_batches: list
    inbox: dict = field(default_factory=dict)  # received activations and gradients
    outbox: dict = field(default_factory=dict)  # outputs waiting for the next exchange
    stash: dict = field(default_factory=dict)  # (chunk, mb) -> (input, output): alive activations
    deferred: dict = field(default_factory=dict)  # (chunk, mb) -> the work its W will run
    alive: set = field(default_factory=set)  # (chunk, mb) forwarded and not yet finished
    whole: frozenset = frozenset()  # (chunk, mb) whose backward runs undivided in its B
    loss: torch.Tensor | None = None  # sum of this step's micro-batch losses (last stage)


class PipelineSchedule:
    """Executes schedule ``name`` over this rank's ``chunks`` (global chunk ids from
    ``partition.rank_chunks``). ``peak_alive`` is the most (chunk, micro-batch) pairs whose
    activations were alive at once in the last step (forwarded and not yet backwarded;
    with a split backward, not yet through their W)."""

    def __init__(self, chunks: list[nn.Module], loss_fn, topo, *, name: str, virtual_stages: int,
                 activation_shape: tuple[int, ...], activation_dtype: torch.dtype,
                 device: torch.device, autocast=contextlib.nullcontext,
                 timeline: Timeline | None = None, watch=None):
        self.topo, self.name, self.v = topo, name, virtual_stages
        self.pp, self.n_chunks = topo.pp, topo.pp * virtual_stages
        self.owners = owners(name, topo.pp, virtual_stages)
        self.split = name in SPLIT_BACKWARD
        ids = rank_chunks(topo.pp_rank, topo.pp, virtual_stages, name)
        assert len(ids) == len(chunks), (ids, len(chunks))
        self.chunks = dict(zip(ids, chunks))
        self.loss_fn, self.autocast, self.device = loss_fn, autocast, device
        self.comm = StageComm(topo.pp_group, topo.pp_ranks, activation_shape, activation_dtype,
                              device) if topo.pp > 1 else None
        self.timeline = timeline or Timeline(device)
        self.peak_alive = 0
        self.steps_run = 0
        self.watch = watch  # a reliability.CommWatch told of each send/recv, if given

    @contextlib.contextmanager
    def _comm(self, label: str, axis: str = "pp"):
        """Tell the watch (if any) that the enclosed code waits on communication
        ``label`` over ``axis``, and that computing resumes after it. An exception leaves
        the watch on ``label``, where the step failed."""
        if self.watch is None:
            yield
            return
        self.watch.enter(label, axis)
        yield
        self.watch.resume()

    def run(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]],
            reduce_loss: bool = True) -> torch.Tensor:
        """Forward and backward every micro-batch; returns the step's mean loss (a detached
        fp32 scalar, the same on every rank of the pipeline).

        With ``reduce_loss=False`` it returns this rank's part instead (the last chunk's
        loss, 0 on the other ranks) and leaves the step window open: the caller sums the
        loss in its own closing collective (the trainer's one all-reduce per step) and
        closes the window after it (``timeline.close_window``)."""
        m, rank = len(micro_batches), self.topo.pp_rank
        steps = plan(self.name, self.pp, self.v, m, rank)
        posts = batches(self.name, self.pp, self.v, m, rank)
        # No synchronisation opens the window: every rank left the previous step's closing
        # collective together, so the windows start within a collective's skew of each
        # other without another round trip.
        self.timeline.start_step(self.steps_run + 1)  # numbered from 1, as in metrics.jsonl
        st = _StepState(micro_batches, loss=torch.zeros((), dtype=torch.float32, device=self.device),
                        whole=undivided_backwards(steps) if self.split else frozenset())
        self.peak_alive = 0
        for step, batch in zip(steps, posts):
            self._run_step(step, self._post(batch, st), st)
        self._run_step((), self._post(posts[-1], st), st)  # the last step's sends
        assert not (st.stash or st.inbox or st.outbox or st.deferred), "plan left work undone"
        if self.comm is not None:
            with self._comm("pipeline send/recv [last sends]"), \
                    self.timeline.span("wait", "wait", lane="comm", ops="last sends"):
                self.comm.flush()
        self.timeline.end_work()
        self.steps_run += 1
        if not reduce_loss:
            return st.loss
        with self.timeline.span("pp collectives", "comm", lane="comm"), \
                self._comm("loss sum over the pipeline"):
            loss = all_reduce(st.loss, self.topo.pp_group)  # only the last chunk's rank is non-zero
        self.timeline.close_window()
        return loss

    def _run_step(self, step, pending, st: _StepState) -> None:
        """The step's actions; the posted batch is waited for just before the first one
        that reads what it receives (a W never does), else after the last."""
        for action in step:
            if pending is not None and any((msg.kind, msg.chunk, msg.mb) not in st.inbox
                                           for msg in inputs_of(action, self.owners)):
                pending = self._receive(pending, st)
            with running(st.micro_batches[action.mb]):  # its token keys (LoRA's dropout)
                self._ACTIONS[action.op](self, action, st)
            if self.watch is not None:  # each pass is progress: a long step is not a hang
                self.watch.progress(self.device)
        if pending is not None:
            self._receive(pending, st)

    @torch.no_grad()
    def forward_only(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """The mean loss over ``micro_batches`` without a backward pass (validation): a
        detached fp32 scalar, the same on every rank of the pipeline.

        Every rank walks the (micro-batch, global chunk) pairs in lexicographic order and
        runs the chunks it holds: receive the activation from the previous chunk's rank
        (or keep its own, when it holds that chunk too), forward, send to the next chunk's
        rank. Each message goes from a pair to a later one in that common order, so the
        earliest unfinished pair can always proceed (no deadlock, whatever the placement
        of the chunks); sends are waited for after the next receive, as in :meth:`run`.
        Nothing is kept for a backward pass."""
        total = torch.zeros((), dtype=torch.float32, device=self.device)
        last, me = self.n_chunks - 1, self.topo.pp_rank
        for mb, batch in enumerate(micro_batches):
            inputs, targets, side, divisor = _parts(batch)
            x = inputs
            for c in (c for c in range(self.n_chunks) if self.owners[c] == me):
                if c > 0 and self.owners[c - 1] != me:
                    msg = Message("act", c - 1, mb, src=self.owners[c - 1], dst=me)
                    with self._comm(f"pipeline send/recv [eval recv act{c - 1}.{mb}]"):
                        (x,) = self.comm.exchange([], [msg])
                with self.autocast():
                    out = self.chunks[c](x, **side)
                if c == last:
                    total += _micro_batch_loss(self.loss_fn, out, targets, divisor,
                                               len(micro_batches)).float()
                elif self.owners[c + 1] != me:
                    msg = Message("act", c, mb, src=me, dst=self.owners[c + 1])
                    with self._comm(f"pipeline send/recv [eval send act{c}.{mb}]"):
                        self.comm.exchange([(msg, out)], [])
                x = out  # the next chunk's input, if this rank holds it too
        if self.comm is not None:
            with self._comm("pipeline send/recv [eval last sends]"):
                self.comm.flush()
        with self._comm("eval loss sum over the pipeline"):
            return all_reduce(total, self.topo.pp_group)  # only the last chunk's rank is non-zero

    # -- the actions --------------------------------------------------------------------------
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
                out = _micro_batch_loss(self.loss_fn, out, targets, divisor, len(st.micro_batches),
                                        getattr(st.micro_batches[a.mb], "sources", None))
                st.loss += out.detach().float()
        for msg in outputs_of(a, self.owners):
            (st.inbox if msg.local else st.outbox)[("act", a.chunk, a.mb)] = out.detach()
        if not last:
            _drop_values(out)
        st.stash[(a.chunk, a.mb)] = (x, out)
        st.alive.add((a.chunk, a.mb))
        self.peak_alive = max(self.peak_alive, len(st.alive))

    def _backward(self, a: Action, st: _StepState) -> None:
        """The input gradient; with a split backward the weight gradients are recorded
        for this (chunk, micro-batch)'s W, unless the backward runs undivided here
        (``actions.undivided_backwards``: the first chunk's)."""
        x, out = st.stash.pop((a.chunk, a.mb))
        grad = None if a.chunk == self.n_chunks - 1 else st.inbox.pop(("grad", a.chunk + 1, a.mb))
        whole = (a.chunk, a.mb) in st.whole
        work = DeferredWeightGrads() if self.split and not whole else None
        with self.timeline.span(f"B{a.chunk}.{a.mb}", "backward", chunk=a.chunk, mb=a.mb,
                                **({"with_weight": True} if whole else {})):
            with deferring(work):
                _backward_from(out, grad)
        if work is None:
            st.alive.discard((a.chunk, a.mb))
        else:
            st.deferred[(a.chunk, a.mb)] = work
        for msg in outputs_of(a, self.owners):
            (st.inbox if msg.local else st.outbox)[("grad", a.chunk, a.mb)] = x.grad

    def _weight(self, a: Action, st: _StepState) -> None:
        """The weight gradients this (chunk, micro-batch)'s B recorded (none when its B
        ran undivided)."""
        if (a.chunk, a.mb) in st.whole:
            return
        work = st.deferred.pop((a.chunk, a.mb))
        with self.timeline.span(f"W{a.chunk}.{a.mb}", "weight", chunk=a.chunk, mb=a.mb):
            work.run()
        st.alive.discard((a.chunk, a.mb))

    _ACTIONS = {"F": _forward, "B": _backward, "W": _weight}

    # -- communication ----------------------------------------------------------------------
    def _post(self, batch: Batch, st: _StepState):
        """Post ``batch``, its sends taken from the outbox; None when it is empty."""
        sends, recvs = batch
        if not sends and not recvs:
            return None
        payload = [(msg, st.outbox.pop((msg.kind, msg.chunk, msg.mb))) for msg in sends]
        label = " ".join([f"send {m.kind}{m.chunk}.{m.mb}" for m in sends]
                         + [f"recv {m.kind}{m.chunk}.{m.mb}" for m in recvs])
        return self.comm.post(payload, recvs), recvs, label

    def _receive(self, pending, st: _StepState) -> None:
        """Wait for a posted batch and put what it received in the inbox; returns None
        (the caller's pending batch is then done)."""
        posted, recvs, label = pending
        with self._comm(f"pipeline send/recv [{label}]"), \
                self.timeline.span("wait", "wait", lane="comm", ops=label):
            received = posted.wait()
        for msg, tensor in zip(recvs, received):
            st.inbox[(msg.kind, msg.chunk, msg.mb)] = tensor
        return None

    # -- metrics ----------------------------------------------------------------------------
    def step_metrics(self) -> dict:
        """``bubble_fraction``: idle share of the last step's window, mean over all ranks
        (the same value on every rank), and the shares of forward, backward (B) and
        weight-gradient (W) spans beside it, by one all-reduce of their own. The trainer
        does not call this: the bubble rides its one collective per step with the other
        per-rank figures."""
        shares = self.timeline.last_shares
        figures = torch.tensor([self.timeline.last_bubble or 0.0] + [shares.get(c, 0.0) for c in BUSY],
                               dtype=torch.float64, device=self.device)
        all_reduce(figures, self.topo.world_group)
        means = (figures / self.topo.world_size).tolist()
        return {"bubble_fraction": means[0],
                **{f"{cat}_fraction": share for cat, share in zip(BUSY, means[1:])}}


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
