"""Where each rank is, and who is missing when a collective fails.

Every rank keeps a :class:`CommWatch`: the step and the operation it is in (a string set
by the trainer and the pipeline schedule before each communication phase -- an attribute
store, nothing on the wire) and the group that operation runs on. A daemon thread writes
that record, with the time, host and pid, to the rendezvous store every
``reliability.heartbeat_s`` seconds (key ``p3d/heartbeat/<rank>``).

A collective that outlives ``reliability.comm_timeout_s`` (the process groups' timeout),
or a peer that dies (gloo sees its sockets close), raises on the surviving ranks. The
worker catches that and prints :meth:`CommWatch.report`: the operation, the group and
its members, the rank(s) of that group that did not arrive -- a process gone (same
host), a heartbeat gone silent, or a heartbeat at another step or operation -- and every
rank's last heartbeat ("who was where"). Then the worker exits without touching the
broken process group, so every survivor is gone within the timeout plus a few seconds.

On NCCL no exception reaches Python in time: collectives are asynchronous, the host
blocks in a synchronisation, and NCCL's own watchdog aborts the process when a
collective outlives the group's timeout (``TORCH_NCCL_ASYNC_ERROR_HANDLING``), before any
report. There the heartbeat thread is the watchdog (``watchdog=True``): when this rank
has made no progress (no new operation entered) for ``comm_timeout_s``, it writes the
same report, dumps torch's NCCL flight recorder (the last collectives of every group,
``RUN_DIR/nccl_trace_rank<r>.pkl``, when recording is on) and exits with status 4; the
process groups are given a longer timeout (:func:`backend_timeout_s`) so that this
happens first. The same thread runs on gloo in the tests that check it.

Progress is not only a new operation entered: the pipeline schedule calls
:meth:`CommWatch.progress` after each forward, backward and weight pass, so a step with
many micro-batches is judged per pass, not as a whole. On CUDA the host runs ahead of the
device (with pp 1 it blocks only at the step's loss, in the closing all-reduce, while the
device still works through the micro-batches): there a pass records a CUDA event, and
the watchdog counts one as progress when the device has completed it (``Event.query``,
no synchronisation), so a long step the device is working through is never a hang, and
a collective stuck on the device still is (its events never complete).
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from collections import deque
from contextlib import contextmanager

import torch.distributed as dist

from parallel3d.config import AutoOnOff

_KEY = "p3d/heartbeat/{}"
_COMM_ERROR_WORDS = ("gloo", "nccl", "timed out", "timeout", "connection closed",
                     "connection reset", "broken pipe", "peer", "socket")


class CommFailure(RuntimeError):
    """A collective or point-to-point operation failed; the message is the full report."""


def is_comm_error(exc: BaseException) -> bool:
    """A failure of the communication layer, as opposed to a bug in our own code."""
    if isinstance(exc, getattr(dist, "DistError", ())):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(w in text for w in _COMM_ERROR_WORDS)


@contextmanager
def comm_failures_reported(watch: "CommWatch", passthrough: tuple = ()):
    """Turn a communication error raised inside into :class:`CommFailure` carrying
    ``watch.report``; other exceptions (and ``passthrough`` types) go through as they are."""
    try:
        yield
    except passthrough:
        raise
    except Exception as e:
        if dist.is_initialized() and is_comm_error(e):
            raise CommFailure(watch.report(e)) from e
        raise


def _own_client(store):
    """A connection of our own to the rendezvous TCPStore (torch's client is shared with
    the process group's own use and not meant for a second thread); other stores as is."""
    from datetime import timedelta

    base = store
    while isinstance(base, dist.PrefixStore):
        base = base.underlying_store
    if isinstance(base, dist.TCPStore):
        # clone(): a new connection under the same key prefixes (a process group built in
        # a per-attempt namespace keeps its heartbeats apart from an earlier attempt's)
        own = store.clone()
        own.set_timeout(timedelta(seconds=30))
        return own
    return store


def _process_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    try:  # a killed child its parent has not reaped yet is a zombie: gone all the same
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return False


def wants_watchdog(setting: AutoOnOff, backend: str) -> bool:
    """``reliability.watchdog``: on, off, or auto (on for NCCL, whose failures never reach
    Python as exceptions in time; gloo's collectives raise, and the worker reports)."""
    return setting == "on" or (setting == "auto" and backend != "gloo")


def backend_timeout_s(watchdog: bool, comm_timeout_s: float) -> float:
    """The process groups' own timeout: ``comm_timeout_s`` without the watchdog (the
    collective raises, the worker reports), longer with it, so that the watchdog reports
    before NCCL's own watchdog kills the process without a word."""
    return comm_timeout_s + max(60.0, 0.5 * comm_timeout_s) if watchdog else comm_timeout_s


def enable_flight_recorder(backend: str) -> None:
    """Ask torch's NCCL process groups to record their last collectives (the flight
    recorder: a ring buffer in host memory, negligible cost), read by the watchdog's
    dump. Must run before the process group is created; an explicit setting wins."""
    if backend == "nccl":
        os.environ.setdefault("TORCH_NCCL_TRACE_BUFFER_SIZE", "2000")


class CommWatch:
    """This rank's current step and operation, and its heartbeat in the store; with
    ``watchdog``, the report and exit of a rank stuck for ``timeout_s`` (see the module
    docstring). ``dump_dir``: where the watchdog writes the flight recorder's dump."""

    def __init__(self, topo, timeout_s: float, heartbeat_s: float = 5.0, store=None,
                 watchdog: bool = False, dump_dir: str | None = None):
        self.topo, self.timeout_s, self.heartbeat_s = topo, timeout_s, heartbeat_s
        self.store = store
        self.watchdog, self.dump_dir = watchdog, dump_dir
        self.exit_on_stall = True  # tests that read the reports keep the process
        self.step, self.op, self.axis = 0, "start-up", "world"
        self._compute = (self.op, self.axis)
        self.since = time.monotonic()
        # the watchdog does not judge start-up (building and loading a large model can
        # take longer than any collective may) nor phases without collectives
        self.paused = True
        # CUDA events of passes the host issued and the device has not yet been seen to
        # complete (bounded: the host cannot run more than a queue's depth ahead anyway)
        self._marks: deque = deque(maxlen=4096)
        self.host, self.pid = socket.gethostname(), os.getpid()
        self._stop = threading.Event()
        self._thread = None

    @classmethod
    def for_process_group(cls, topo, timeout_s: float, heartbeat_s: float,
                          watchdog: bool = False, dump_dir: str | None = None) -> "CommWatch":
        store = None
        if dist.is_initialized() and topo.world_size > 1:
            store = _own_client(dist.distributed_c10d._get_default_store())
        watch = cls(topo, timeout_s, heartbeat_s, store, watchdog, dump_dir)
        watch.start()
        return watch

    # -- the hot path: two attribute stores -----------------------------------------------
    def enter(self, op: str, axis: str) -> None:
        """Record that the next communication is ``op`` on this rank's ``axis`` group
        ("tp", "pp", "dp", "mp" or "world")."""
        self.op, self.axis, self.since, self.paused = op, axis, time.monotonic(), False

    def compute(self, op: str, axis: str) -> None:
        """Enter the phase that :meth:`resume` returns to after a nested operation."""
        self._compute = (op, axis)
        self.op, self.axis, self.since, self.paused = op, axis, time.monotonic(), False

    def resume(self) -> None:
        (self.op, self.axis), self.since = self._compute, time.monotonic()

    def progress(self, device=None) -> None:
        """A forward, backward or weight pass was issued on ``device``: progress of the
        current operation. On the host (CPU) it is done when this returns; on CUDA it is
        done when the event recorded here completes (the watchdog thread looks)."""
        if device is not None and getattr(device, "type", None) == "cuda":
            import torch

            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(device))
            self._marks.append(event)
        else:
            self.since = time.monotonic()

    def _device_progress(self) -> None:
        """Move ``since`` to now when the device completed a pass since the last look (the
        watchdog thread; ``query`` does not block)."""
        done = False
        while self._marks and self._marks[0].query():
            self._marks.popleft()
            done = True
        if done:
            self.since = time.monotonic()

    def pause(self, op: str) -> None:
        """A phase the watchdog does not time (a checkpoint written by this rank alone,
        the end of the run); the next :meth:`enter` or :meth:`compute` re-arms it."""
        self.op, self.since, self.paused = op, time.monotonic(), True

    # -- heartbeat ----------------------------------------------------------------------
    def beat(self) -> dict:
        return {"rank": self.topo.rank, "step": self.step, "op": self.op, "group": self.axis,
                "time": time.time(), "host": self.host, "pid": self.pid}

    def _publish(self) -> None:
        self.store.set(_KEY.format(self.topo.rank), json.dumps(self.beat()))

    def _loop(self) -> None:
        while True:
            if self.store is not None:
                try:
                    self._publish()
                except Exception:  # noqa: BLE001 - the store is gone: nothing left to tell
                    if not self.watchdog:
                        return
            if self.watchdog and self.stalled():
                self._report_and_exit()
                return
            if self._stop.wait(min(self.heartbeat_s, max(0.1, self.timeout_s / 10))):
                return

    def stalled(self) -> bool:
        """No progress for ``timeout_s``: the watchdog's trigger."""
        if self._marks:
            self._device_progress()
        return not self.paused and time.monotonic() - self.since > self.timeout_s

    def _report_and_exit(self) -> None:
        """The watchdog's end: the report on stderr, the flight recorder's dump, exit 4
        (the main thread is blocked in the stuck collective; the process group is not
        torn down: with a peer gone that can block too)."""
        import sys

        from parallel3d.errors import EXIT_COMM

        cause = TimeoutError(f"no progress for {self.timeout_s:g} s (watchdog)")
        report = self.report(cause, settle_s=min(5.0, self.heartbeat_s))
        print(f"parallel3d: error: {report}", file=sys.stderr, flush=True)
        if self.dump_dir is not None:  # the run directory keeps it past the terminal
            try:
                with open(os.path.join(self.dump_dir, f"failure_rank{self.topo.rank}.txt"), "w") as f:
                    f.write(report + "\n")
            except OSError:
                pass
        path = self.dump_flight_recorder()
        if path:
            print(f"parallel3d: NCCL flight recorder of rank {self.topo.rank}: {path}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        if self.exit_on_stall:
            os._exit(EXIT_COMM)

    def dump_flight_recorder(self) -> str | None:
        """torch's NCCL flight recorder (recent collectives of every NCCL group of this
        process, pickled) into ``dump_dir``; None when there is nothing to dump."""
        if self.dump_dir is None:
            return None
        try:
            from torch._C._distributed_c10d import _dump_nccl_trace
            data = _dump_nccl_trace()
        except Exception:  # noqa: BLE001 - no NCCL in this build, or recording is off
            return None
        path = os.path.join(self.dump_dir, f"nccl_trace_rank{self.topo.rank}.pkl")
        with open(path, "wb") as f:
            f.write(data)
        return path

    def start(self) -> None:
        if (self.store is not None or self.watchdog) and self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="p3d-heartbeat", daemon=True)
            self._thread.start()

    def close(self) -> None:
        """Stop the heartbeat; waits for a write in flight (a daemon thread inside the
        store's C++ client when the interpreter or the process group shuts down aborts)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)

    def heartbeats(self) -> dict[int, dict]:
        """Every rank's last heartbeat that the store still holds."""
        out: dict[int, dict] = {}
        if self.store is None:
            return out
        for rank in range(self.topo.world_size):
            key = _KEY.format(rank)
            try:
                if self.store.check([key]):
                    out[rank] = json.loads(self.store.get(key))
            except Exception:  # noqa: BLE001 - store host died with its rank: report the rest
                break
        return out

    # -- the report -----------------------------------------------------------------------
    def group_ranks(self, axis: str) -> list[int]:
        if axis == "world":
            return list(range(self.topo.world_size))
        return list(getattr(self.topo, f"{axis}_ranks"))

    def describe_group(self, axis: str) -> str:
        return f"{axis} group {self.group_ranks(axis)}"

    def _lost(self, beats: dict[int, dict], now: float) -> dict[int, str]:
        """Ranks that are surely gone: process gone (same host) or heartbeat silent."""
        out = {}
        for r in range(self.topo.world_size):
            hb = beats.get(r)
            if r == self.topo.rank or hb is None:
                continue
            if hb["host"] == self.host and _process_gone(hb["pid"]):
                out[r] = f"process {hb['pid']} is gone"
            elif now - hb["time"] > 2.5 * self.heartbeat_s:
                out[r] = f"heartbeat silent for {now - hb['time']:.0f} s"
        return out

    def _elsewhere(self, beats: dict[int, dict], ranks: list[int]) -> dict[int, str]:
        """Ranks of ``ranks`` alive but not at this rank's step and operation."""
        out = {}
        for r in ranks:
            hb = beats.get(r)
            if r == self.topo.rank:
                continue
            if hb is None:
                out[r] = "no heartbeat"
            elif (hb["step"], hb["op"]) != (self.step, self.op):
                out[r] = f"at step {hb['step']} in {hb['op']}"
        return out

    def report(self, exc: BaseException, settle_s: float | None = None) -> str:
        """The message for a failed operation: what, on which group, who did not arrive,
        and who was where. A peer that just died may still look alive for a moment (its
        sockets close before its process is gone): wait up to ``settle_s`` (default 2.5
        heartbeats + 1 s, at most 15 s) for a lost rank to show before naming a rank
        that is merely somewhere else."""
        waited = time.monotonic() - self.since
        # The heartbeat goes on while this rank reports, or the peers reporting at the
        # same time would take its silence for a death.
        if self.store is not None:
            try:
                self._publish()
            except Exception:  # noqa: BLE001
                pass
        settle_s = min(15.0, 2.5 * self.heartbeat_s + 1) if settle_s is None else settle_s
        deadline = time.monotonic() + settle_s
        while True:
            beats = self.heartbeats()
            missing = self._lost(beats, time.time())
            if missing or self.store is None or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        ranks = self.group_ranks(self.axis)
        if missing:
            who = "; ".join(f"rank {r} lost ({why})" for r, why in sorted(missing.items()))
        else:
            elsewhere = self._elsewhere(beats, ranks)
            who = "; ".join(f"rank {r} {why}" for r, why in sorted(elsewhere.items())) or "not known"
        cause = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        where = ", ".join(f"{r}: step {hb['step']} {hb['op']}" for r, hb in sorted(beats.items()))
        return (f"rank {self.topo.rank}: {self.op} on the {self.describe_group(self.axis)} "
                f"failed at step {self.step} after {waited:.0f} s in it "
                f"(reliability.comm_timeout_s {self.timeout_s:g}): {cause} | did not arrive: "
                f"{who} | who was where: {where or 'no heartbeats'}")
