"""Context-parallel point-to-point communication, given its cp group explicitly.

    ring_shift       async: send a tensor to cp rank r+1, receive one from r-1 (the ring
                     attention's K/V and dK/dV steps); ``wait()`` returns what came in

(The all-gather mode's collectives are issued by ``gathered.py`` itself, asynchronously,
around the blocks they overlap.)
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from parallel3d.distributed import check_device


class _Shift:
    """A ring step in flight: ``wait()`` waits for the send and the receive and returns
    the received tensor."""

    def __init__(self, works, received: torch.Tensor):
        self.works, self.received = works, received

    def wait(self) -> torch.Tensor:
        for w in self.works:
            w.wait()
        self.works = []
        return self.received


def ring_shift(x: torch.Tensor, group, tag: int = 0) -> _Shift:
    """Post the send of ``x`` to cp rank ``r+1`` and the receive of the same shape from
    ``r-1`` (mod cp), returning at once. NCCL gets both as one batch (separate
    isend/irecv around a ring could wait on each other); gloo's isend/irecv run on their
    own threads. ``tag`` keeps two kinds of message between the same pair apart (at
    cp 2 the next and the previous rank are one rank)."""
    p, r = dist.get_world_size(group), dist.get_rank(group)
    x = x.contiguous()
    check_device(x, group)
    received = torch.empty_like(x)
    nxt, prev = (r + 1) % p, (r - 1) % p
    if dist.get_backend(group) == "nccl":
        ops = [dist.P2POp(dist.isend, x, group=group, tag=tag, group_peer=nxt),
               dist.P2POp(dist.irecv, received, group=group, tag=tag, group_peer=prev)]
        works = dist.batch_isend_irecv(ops)
    else:
        works = [dist.isend(x, group=group, tag=tag, group_dst=nxt),
                 dist.irecv(received, group=group, tag=tag, group_src=prev)]
    return _Shift(works, received)
