"""Every cp rank in one process: each mode's own code, the communication done in memory.
For checks on one device (``benchmarks/_acceptance_cp.py``: one GPU hosts no two NCCL
ranks, and gloo's send / receive read host memory only) and for tests.

- all-gather: :func:`gathered.gathered_attention` of each rank's head-tail queries over
  the whole sequence's K/V in global order (what the all-gather delivers); the K/V's
  gradient sums over the ranks, each rank's rows its own (what the reduce-scatter does).
- ring: :func:`ring.ring_forward` and :func:`ring.ring_backward` of every rank, each on a
  thread of its own (a rank waits for its predecessor's message, as over the wire),
  ``shift`` a mailbox per receiving rank and message kind: the tensor cp rank ``r-1``
  sent, in order, as ``comm.ring_shift`` delivers it. The same spans, merges and dK/dV
  accumulators that travel round the ring as training runs; no autograd in between
  (the autograd Function only calls these two).

Inputs: the whole sequence's q (B, H, S, D), k / v (B, Hkv, S, D), upstream gradient
(B, H, S, D), and optionally each token's document start (B, S) (global positions).
Returns the whole sequence's out, dq, dk, dv in global order (each rank's rows put back).
"""

from __future__ import annotations

import queue
import threading
from concurrent.futures import ThreadPoolExecutor

import torch

from .documents import DocumentStarts
from .gathered import gathered_attention
from .ring import ring_backward, ring_forward
from .sharding import shard_sequence, unshard_sequence

WAIT_S = 600  # a rank waiting longer on a message: another rank failed


class _Mailboxes:
    """The ring's messages between threads: one FIFO per (receiving rank, tag)."""

    def __init__(self, cp: int):
        self.cp, self._boxes, self._lock = cp, {}, threading.Lock()

    def _box(self, rank: int, tag: int) -> queue.Queue:
        with self._lock:
            return self._boxes.setdefault((rank, tag), queue.Queue())

    def shift_of(self, rank: int):
        """``shift(x, tag)`` for cp rank ``rank`` (``ring.ring_forward``'s)."""
        def shift(x: torch.Tensor, tag: int):
            self._box((rank + 1) % self.cp, tag).put(x.clone())  # the sender may reuse x
            return _Received(self._box(rank, tag))
        return shift


class _Received:
    def __init__(self, box: queue.Queue):
        self._box, self._value = box, None

    def wait(self) -> torch.Tensor:
        if self._value is None:
            self._value = self._box.get(timeout=WAIT_S)
        return self._value


def _docs(starts, cp: int, r: int):
    return None if starts is None else DocumentStarts.of(shard_sequence(starts, cp, r, dim=1))


def allgather_ranks(q, k, v, d_out, cp: int, starts=None, scale=None):
    """The all-gather mode of every rank (module docstring): out, dq, dk, dv."""
    kv = torch.stack([k, v]).detach().requires_grad_()  # (2, B, Hkv, S, D): the gathered K/V
    outs, dqs = [], []
    for r in range(cp):
        q_r = shard_sequence(q, cp, r, dim=2).detach().requires_grad_()
        out = gathered_attention(q_r, kv, cp, r, _docs(starts, cp, r), scale)
        out.backward(shard_sequence(d_out, cp, r, dim=2))  # KV's gradient sums over the ranks
        outs.append(out.detach())
        dqs.append(q_r.grad)
    return [unshard_sequence(outs, dim=2), unshard_sequence(dqs, dim=2), kv.grad[0], kv.grad[1]]


def ring_ranks(q, k, v, d_out, cp: int, starts=None, scale=None):
    """The ring mode of every rank, one thread each (module docstring): out, dq, dk, dv."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    boxes = _Mailboxes(cp)

    def rank(r: int):
        q_r, k_r, v_r, d_r = (shard_sequence(x, cp, r, dim=2) for x in (q, k, v, d_out))
        docs, shift = _docs(starts, cp, r), boxes.shift_of(r)
        o, lse = ring_forward(q_r, k_r, v_r, docs, scale, cp, r, shift)
        return (o, *ring_backward(q_r, k_r, v_r, o, lse, d_r, docs, scale, cp, r, shift))

    with ThreadPoolExecutor(max_workers=cp) as pool:
        per_rank = [f.result() for f in [pool.submit(rank, r) for r in range(cp)]]
    return [unshard_sequence(list(xs), dim=2) for xs in zip(*per_rank)]
