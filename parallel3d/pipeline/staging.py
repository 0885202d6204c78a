"""Host buffers for pipeline sends and receives on a gloo group whose tensors live on a device.

gloo copies device tensors through the host for its collectives, but its ``send`` and
``recv`` hand the tensor's data pointer to the TCP transport, which reads and writes host
memory only: a CUDA activation sent as it is fails or hangs the first step
(``distributed.gloo_p2p_needs_host``). So :class:`HostStaging` copies each outgoing tensor
into a host buffer before the send is posted, receives into a host buffer, and copies that
onto the device once the receive was waited for.

Every message of a pipeline has one shape and dtype (``StageComm.shape``), so the buffers
are allocated once and reused: a buffer returns to the pool when its send was waited for
or when its received contents were copied out, so the pool holds at most the messages in
flight at once (two batches of sends and one of receives). On CUDA they are pinned, which
lets the copies run asynchronously:

* device -> host: every copy of a batch is issued ``non_blocking``, then one wait on the
  current stream before the sends are posted (gloo reads the buffer from its own thread
  as soon as the send is posted, and the stream also holds the compute that made the
  tensor, which the send needs finished anyway);
* host -> device: issued ``non_blocking`` after the receive was waited for, with an event
  recorded behind the copies; a buffer is handed out again only after its event completed
  (a later receive would otherwise overwrite what the copy still reads).
"""

from __future__ import annotations

import torch


class HostStaging:
    """A pool of host buffers of one ``shape`` and ``dtype`` for a pipeline on ``device``.

    ``allocated`` counts the buffers ever made (the tests check they are reused)."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device):
        self.shape, self.dtype, self.device = tuple(shape), dtype, torch.device(device)
        self.pinned = self.device.type == "cuda" and torch.cuda.is_available()
        self._free: list[tuple[torch.Tensor, object]] = []  # (buffer, event to wait or None)
        self.allocated = 0

    def take(self) -> torch.Tensor:
        """A host buffer no copy or transfer still uses."""
        if self._free:
            buf, ready = self._free.pop()
            if ready is not None:
                ready.synchronize()  # the host -> device copy out of it has finished
            return buf
        self.allocated += 1
        return torch.empty(self.shape, dtype=self.dtype, pin_memory=self.pinned)

    def give(self, buf: torch.Tensor, ready=None) -> None:
        """Return ``buf`` to the pool, usable once ``ready`` (an event, or None) completed."""
        self._free.append((buf, ready))

    def to_host(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Host copies of ``tensors`` (each of the pool's shape), complete on return."""
        bufs = [self.take().copy_(t, non_blocking=self.pinned) for t in tensors]
        if self.pinned and bufs:
            torch.cuda.current_stream(self.device).synchronize()
        return bufs

    def to_device(self, bufs: list[torch.Tensor]) -> list[torch.Tensor]:
        """New device tensors holding the received host ``bufs``, which go back to the pool
        (each reusable once the copies out of it finished)."""
        out = []
        for buf in bufs:
            t = torch.empty(self.shape, dtype=self.dtype, device=self.device)
            out.append(t.copy_(buf, non_blocking=self.pinned))
        ready = None
        if self.pinned and bufs:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.device))
        for buf in bufs:
            self.give(buf, ready)
        return out
