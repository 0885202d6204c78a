"""Run functions on N gloo processes on CPU: the harness of every distributed test.

Starting processes and a process group costs seconds, so a :class:`ProcessGroupPool`
starts its N workers once (per test module, through a fixture) and then runs many
functions on them::

    pool = ProcessGroupPool(8)
    results = pool.run(check_topology, 2, 2, 2)   # check_topology(2, 2, 2) on every rank
    pool.close()

The function must be picklable (defined at module level); it runs with
``torch.distributed`` initialized (gloo, world of N) and returns a picklable value; the
call returns the list of values by rank. An exception on any rank, or a run longer than
``timeout`` seconds (a hang), kills the pool and raises with the rank's traceback; the
next ``run`` starts a fresh pool.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import tempfile
import time
import traceback
from datetime import timedelta


class DistributedTestError(RuntimeError):
    pass


def _worker(rank: int, world_size: int, store_path: str, tasks, results, env: dict) -> None:
    os.environ.update(env)
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
                       "LOCAL_WORLD_SIZE": str(world_size)})
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=120))
    while True:
        task = tasks.get()
        if task is None:
            break
        fn, args, kwargs = task
        try:
            results.put((rank, True, fn(*args, **kwargs)))
        except BaseException:  # noqa: BLE001 - reported to the test, which re-raises
            results.put((rank, False, traceback.format_exc()))
    dist.destroy_process_group()


class ProcessGroupPool:
    def __init__(self, world_size: int, timeout: float = 300.0, env: dict | None = None):
        self.world_size = world_size
        self.timeout = timeout
        self.env = dict(env or {})
        self._procs: list = []

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        self._dir = tempfile.TemporaryDirectory(prefix="p3d-pool-")
        store = os.path.join(self._dir.name, "store")
        self._tasks = [ctx.Queue() for _ in range(self.world_size)]
        self._results = ctx.Queue()
        self._procs = [
            ctx.Process(target=_worker, daemon=True,
                        args=(r, self.world_size, store, self._tasks[r], self._results, self.env))
            for r in range(self.world_size)
        ]
        for p in self._procs:
            p.start()

    def run(self, fn, *args, timeout: float | None = None, stop_when=None, **kwargs) -> list:
        """``fn(*args, **kwargs)`` on every rank; their results in rank order.
        ``stop_when()``, if given, is polled while waiting: once true, the pool is killed
        and :class:`DistributedTestError` raised (a test of ranks that never return)."""
        if not self._procs:
            self._start()
        for q in self._tasks:
            q.put((fn, args, kwargs))
        deadline = time.monotonic() + (timeout or self.timeout)
        out: dict[int, object] = {}
        while len(out) < self.world_size:
            try:
                rank, ok, value = self._results.get(timeout=0.5)
            except queue.Empty:
                if stop_when is not None and stop_when():
                    self.close(kill=True)
                    raise DistributedTestError(f"{fn.__name__} on {self.world_size} ranks: stopped") from None
                dead = [i for i, p in enumerate(self._procs) if not p.is_alive()]
                if dead or time.monotonic() > deadline:
                    self.close(kill=True)
                    why = f"ranks {dead} died" if dead else f"timed out after {timeout or self.timeout:.0f} s"
                    raise DistributedTestError(f"{fn.__name__} on {self.world_size} ranks: {why}") from None
                continue
            if not ok:
                self.close(kill=True)
                raise DistributedTestError(f"{fn.__name__} failed on rank {rank}:\n{value}")
            out[rank] = value
        return [out[r] for r in range(self.world_size)]

    def close(self, kill: bool = False) -> None:
        if not self._procs:
            return
        if not kill:
            for q in self._tasks:
                q.put(None)
            for p in self._procs:
                p.join(timeout=10)
        for p in self._procs:
            if p.is_alive():
                p.kill()
                p.join()
        self._procs = []
        self._dir.cleanup()
