"""Point-to-point exchange between neighbouring pipeline stages.

Everything that crosses between stages is one tensor of a shape fixed by the config
(``activation_shape`` in ``models/llama/parallelize.py``: ``(micro_batch, seq_len, dim)``)
and the activation dtype, for activations and their gradients alike, so receive buffers
are allocated up front and no rank ever tells another what shape comes next.

Why this cannot deadlock
------------------------
A rank's communication is a sequence of batches (``schedules.exchanges``); each batch is
one ``batch_isend_irecv`` that posts every send and receive before the rank waits on any
of them (on gloo that is a series of ``isend``/``irecv``, on NCCL one grouped launch).
So a batch never blocks on the order of its own operations, only on the peer reaching the
batch that holds the matching operation. Deadlock would need a cycle of ranks each waiting
on a batch the next has not reached; the plans are built so that every batch's partner
operations sit in a batch the peer reaches without first needing anything from us:

* 1F1B: after a forward, "send activation to next + receive gradient from next" meets the
  next stage's "send gradient to previous + receive activation from previous" of the same
  step of the pipeline, posted at the same time; warm-up sends meet receives the next
  stage posts before its own first forward.
* interleaved: the steady state runs a forward and a backward between two exchanges (one
  batch carries both outputs and both next inputs). With one exchange per action the
  ring (last stage -> first stage for the next chunk) closes a cycle and deadlocks.
* zb-v: every message is sent and received in the batch right after the slot of a common
  clock that produced it (``actions.slot_exchanges``), so every batch ``t`` meets the
  neighbours' batch ``t``.

A batch is posted before its step and waited for just before the first action that reads
what it receives (a W, or a forward on the V's turn, runs while the batch is in flight),
or after the step (``runtime.py``).

Two ranks exchange messages in both directions at once, and with ``pp = 2`` in the
interleaved ring both activations and gradients travel from rank 0 to rank 1. NCCL and
gloo (one tag) match the messages between a pair in posting order, so the k-th message
rank a sends to rank b must be the k-th that b expects. ``simulate.simulate`` plays every
plan under exactly these rules (rendezvous sends, ordered matching) and fails on a
deadlock or a mismatch; the tests run it over all schedules for pp up to 8.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from parallel3d.distributed import check_p2p_device, gloo_p2p_needs_host

from .schedules import Message
from .staging import HostStaging


class StageComm:
    """Batched sends and receives between this rank and its pipeline neighbours.

    ``pp_ranks[i]`` is the global rank of pipeline rank ``i`` (same tp/dp coordinates);
    messages name pipeline ranks, the group translates them. On a gloo group with tensors
    on a device, every message goes through reused host buffers (``staging.py``).
    """

    def __init__(self, pp_group, pp_ranks: list[int], shape: tuple[int, ...],
                 dtype: torch.dtype, device: torch.device):
        self.group, self.pp_ranks = pp_group, pp_ranks
        self.shape, self.dtype, self.device = tuple(shape), dtype, device
        self._sending: list = []  # (work, tensor) of the previous batch's sends
        staged = gloo_p2p_needs_host(dist.get_backend(pp_group), device)
        self.staging = HostStaging(self.shape, dtype, device) if staged else None

    def post(self, sends: list[tuple[Message, torch.Tensor]], recvs: list[Message]) -> "Posted":
        """Post every send and receive of one batch; :meth:`Posted.wait` waits for the
        receives and returns the received tensors in the order of ``recvs``.

        The sends are waited for one batch later (after the next batch's receives), so a
        rank goes on computing while its output travels instead of waiting for the
        receiver to reach its receive. Waiting later never makes an operation start later
        than in the wait-for-everything model the simulator checks, so that model's
        proof of deadlock freedom carries over; at most one batch of sent tensors stays
        alive. Post a batch only after the previous one was waited for."""
        for msg, tensor in sends:
            # The fixed shape is the contract with the receiver: check it here, where a
            # wrong shape is an internal bug, rather than let the peer read garbage.
            assert tuple(tensor.shape) == self.shape and tensor.dtype == self.dtype, \
                (msg, tuple(tensor.shape), tensor.dtype, self.shape, self.dtype)
        outgoing = [tensor.contiguous() for _, tensor in sends]
        if self.staging is not None:
            outgoing = self.staging.to_host(outgoing)
            bufs = [self.staging.take() for _ in recvs]
        else:
            bufs = [torch.empty(self.shape, dtype=self.dtype, device=self.device) for _ in recvs]
        ops = [dist.P2POp(dist.isend, t, self.pp_ranks[msg.dst], self.group)
               for (msg, _), t in zip(sends, outgoing)]
        ops += [dist.P2POp(dist.irecv, buf, self.pp_ranks[msg.src], self.group)
                for msg, buf in zip(recvs, bufs)]
        for op in ops:
            check_p2p_device(op.tensor, self.group)
        works = dist.batch_isend_irecv(ops) if ops else []
        # gloo gives a handle per operation: each staged send's buffer returns on its wait
        assert self.staging is None or len(works) == len(ops), (len(works), len(ops))
        if len(works) == len(ops):  # one handle per operation (gloo): sends listed first
            receiving, sending = works[len(outgoing):], works[:len(outgoing)]
        else:  # one handle for the coalesced batch (NCCL), whose wait only orders streams
            receiving, sending = works, []
        return Posted(self, receiving, list(zip(sending, outgoing)), bufs)

    def exchange(self, sends: list[tuple[Message, torch.Tensor]],
                 recvs: list[Message]) -> list[torch.Tensor]:
        """:meth:`post` and wait at once."""
        return self.post(sends, recvs).wait()

    def flush(self) -> None:
        """Wait for the sends still in flight (the runtime calls it at the end of a step)."""
        for work, tensor in self._sending:
            work.wait()
            if self.staging is not None:
                self.staging.give(tensor)
        self._sending = []


class Posted:
    """A batch in flight (:meth:`StageComm.post`)."""

    def __init__(self, comm: StageComm, receiving: list, sending: list, bufs: list[torch.Tensor]):
        self.comm, self.receiving, self.sending, self.bufs = comm, receiving, sending, bufs

    def wait(self) -> list[torch.Tensor]:
        for work in self.receiving:
            work.wait()
        self.comm.flush()  # the previous batch's sends
        self.comm._sending = self.sending  # keeps each tensor alive until sent
        if self.comm.staging is not None:
            return self.comm.staging.to_device(self.bufs)
        return self.bufs
