"""Background prefetch: the next steps' batches are built while this step computes.

:class:`PrefetchLoader` asks the sampler for the indices of the steps ahead, reads their
token windows (memory-mapped shards) into tensors, pins them when the device is CUDA, and
queues up to ``depth`` steps in a daemon thread. ``next()`` hands the trainer one step's
micro-batches on the device together with the seconds it blocked for them (the step's
``data_wait_s``: zero when the data was ready in time). ``depth=0`` builds each step's
batch in ``next()`` instead; then the wait is the whole time spent building it. Every
wait, step and build time goes to a :class:`~parallel3d.data.stalls.StallMonitor`
(``self.stalls``), whose data-bound line ``log`` prints.

What the trainer has consumed, not what the thread has read ahead, is the sampler's
position: ``state_dict()`` resumes at the first step the trainer has not been given.

Two optional hooks (:mod:`parallel3d.data.checks` provides them): ``check(position)``
runs in the builder before a step's batch is built and may raise (a step whose ids are
out of range), and ``before_step()`` runs at the top of every ``next()`` on the
trainer's thread (the background checksum verification's verdict). An error from either
reaches the trainer at ``next()`` of the step concerned, before its forward.
"""

from __future__ import annotations

import queue
import threading
import time
import weakref

import torch

from parallel3d.data.batch import MicroBatch, stream_token_keys
from parallel3d.data.sampler import GlobalBatchSampler, TokenWindows
from parallel3d.data.stalls import MAX_PREFETCH, StallMonitor

_DONE = object()


def step_micro_batches(windows, sampler: GlobalBatchSampler, position: int, token_keys: bool = False) -> list:
    """This rank's micro-batches of the global batch at ``position``: ``(inputs, targets)``
    pairs from :class:`TokenWindows`; from :class:`PackedWindows`, micro-batches carrying
    positions and the loss divisor, the supervised targets of the whole global batch
    (counted by every rank from the sampler, no collective) over dp. ``token_keys``:
    :class:`MicroBatch` es carrying each token's place in the token stream (this rank's
    samples are the stream's ``position + dp_rank * global_batch / dp`` on, in order; a cp
    shard's tokens are its chunks of the window)."""
    if not hasattr(windows, "supervised"):  # TokenWindows (a cp shard forwards the attribute)
        out = [windows.batch(idx) for idx in sampler.indices_at(position)]
    else:
        divisor = max(1, windows.supervised(sampler.global_indices_at(position))) / sampler.dp
        out = [windows.micro_batch(idx, divisor) for idx in sampler.indices_at(position)]
    if not token_keys:
        return out
    first = position + sampler.dp_rank * (sampler.global_batch // sampler.dp)
    keyed = []
    for mb in out:
        mb = mb if isinstance(mb, MicroBatch) else MicroBatch(mb[0], mb[1])
        rows, seq = mb.inputs.shape
        shard = getattr(windows, "shard_tokens", None)  # context parallelism: the window's chunks
        keys = stream_token_keys(first, rows, seq * (windows.cp if shard is not None else 1))
        mb.token_keys = shard(keys) if shard is not None else keys
        keyed.append(mb)
        first += rows
    return keyed


def _to(mb, device):
    if isinstance(mb, MicroBatch):
        return mb.to(device, non_blocking=True)
    return tuple(t.to(device, non_blocking=True) for t in mb)


def _build_step(windows: TokenWindows, sampler: GlobalBatchSampler, position: int, pin: bool,
                check=None, monitor: StallMonitor | None = None, token_keys: bool = False):
    t0 = time.perf_counter()
    if check is not None:
        check(position)
    out = step_micro_batches(windows, sampler, position, token_keys)
    if pin:
        out = [mb.pin_memory() if isinstance(mb, MicroBatch) else tuple(t.pin_memory() for t in mb)
               for mb in out]
    if monitor is not None:
        monitor.built(time.perf_counter() - t0)
    return out


def _produce(windows, sampler, start: int, pin: bool, q: queue.Queue, stop: threading.Event, check,
             monitor=None, token_keys: bool = False):
    # A plain function (not a method) so that the thread holds no reference to the loader:
    # a loader nobody closes is still collected, and its finalizer stops this thread.
    position = start
    try:
        while not stop.is_set():
            item = (position, _build_step(windows, sampler, position, pin, check, monitor, token_keys))
            while not stop.is_set():
                try:
                    q.put(item, timeout=0.2)
                    break
                except queue.Full:
                    continue
            position += sampler.global_batch
    except BaseException as e:  # noqa: BLE001 - handed to the trainer's thread
        while not stop.is_set():
            try:
                q.put((_DONE, e), timeout=0.2)
                break
            except queue.Full:
                continue


def _stop_thread(thread: threading.Thread | None, stop: threading.Event) -> None:
    stop.set()
    if thread is not None:
        thread.join(timeout=5)


class PrefetchLoader:
    def __init__(self, windows: TokenWindows, sampler: GlobalBatchSampler,
                 device: torch.device, depth: int = 2, check=None, before_step=None, log=None,
                 token_keys: bool = False):
        self.windows, self.sampler, self.device, self.depth = windows, sampler, device, depth
        self.token_keys = token_keys  # micro-batches carry their tokens' stream keys (LoRA's dropout)
        self.check, self.before_step = check, before_step  # see the module docstring
        # waits against steps (parallel3d/data/stalls.py); ``log`` prints its data-bound line
        self.stalls, self.log = StallMonitor(depth), log
        self._last_end: float | None = None
        self._pin = device.type == "cuda"
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._finalizer = None

    def _start(self) -> None:
        self._stop = threading.Event()
        self._queue: queue.Queue = queue.Queue(maxsize=self.depth)
        self._thread = threading.Thread(
            target=_produce, name="p3d-prefetch", daemon=True,
            args=(self.windows, self.sampler, self.sampler.consumed, self._pin, self._queue, self._stop,
                  self.check, self.stalls, self.token_keys))
        self._thread.start()
        self._finalizer = weakref.finalize(self, _stop_thread, self._thread, self._stop)

    def next(self) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], float]:
        """This rank's micro-batches of the next step, on the device, and the seconds
        this call waited for them."""
        t0 = time.perf_counter()
        if self.before_step is not None:
            self.before_step()
        if self.depth <= 0:
            batches = _build_step(self.windows, self.sampler, self.sampler.consumed, self._pin, self.check,
                                  self.stalls, self.token_keys)
        else:
            if self._thread is None:
                self._start()
            position, batches = self._queue.get()
            if position is _DONE:
                self.close()
                raise batches
            assert position == self.sampler.consumed, (position, self.sampler.consumed)
        before = self.sampler.consumed
        self.sampler.consumed += self.sampler.global_batch
        on_advance = getattr(self.sampler, "on_advance", None)  # a blend logs its sources' epochs
        if on_advance is not None:
            on_advance(before, self.sampler.consumed)
        end = time.perf_counter()
        wait = end - t0
        line = self.stalls.step(wait, None if self._last_end is None else end - self._last_end)
        self._last_end = end
        if line is not None:
            self._deepen(line)
        return [_to(mb, self.device) for mb in batches], wait

    def _deepen(self, line: str) -> None:
        """The run is data-bound: when a deeper queue hides the measured builds, build
        that many steps ahead from now on (``data.prefetch`` sized from the measured cost
        of a batch, up to MAX_PREFETCH), and say it."""
        want = self.stalls.wanted_depth(self.stalls.figures())
        if self.depth > 0 and want is not None and self.depth < want:
            new = min(want, MAX_PREFETCH)
            if new > self.depth:
                line = line.split(": raise data.prefetch")[0] + (
                    f": building {new} steps ahead instead of data.prefetch {self.depth} (set it to {new})")
                self.depth = self.stalls.depth = new
                if self._thread is not None:
                    self._queue.maxsize = new  # the producer's next put sees the room
        if self.log is not None:
            self.log(line)

    def state_dict(self) -> dict:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.close()  # what was read ahead belongs to the old position
        self._last_end = None
        self.sampler.load_state_dict(state)

    def close(self) -> None:
        if self._finalizer is not None:
            self._finalizer()  # stops and joins the thread, once
        self._thread, self._finalizer = None, None
