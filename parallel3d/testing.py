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

``start_method="forkserver"`` (what the test suite uses) forks the workers from one
server process per interpreter that has imported torch and the trainer once
(:data:`FORKSERVER_PRELOAD`): a worker starts in ~0.1 s instead of the 2-3 s of CPU a
spawned interpreter spends importing torch, and it exits without tearing the interpreter
down (8 spawned workers took 7-9 s to close on 2 loaded cores). Either way a worker
starts with this process's environment, working directory and ``sys.path`` as they are
when the pool starts, plus ``env``. ``"spawn"`` (the default) starts each from scratch.
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


# What the forkserver imports once for every worker it forks (none of it starts a thread
# that a forked child would need). Its environment is read at import as it was when the
# server started: Triton (imported by the kernels) reads TRITON_INTERPRET then, so a pool
# that sets it must spawn. torch._dynamo (with sympy, ~800 modules, ~1 s of CPU): every
# worker that builds a model imports it, since nn.init on the meta device runs torch._refs,
# whose decorator imports the compiler.
FORKSERVER_PRELOAD = ("torch", "torch.distributed", "parallel3d.train.trainer", "torch._dynamo")


def _worker(rank: int, world_size: int, store_path: str, tasks, results, env: dict) -> None:
    # env: the starting process's environment plus the pool's own (a forked worker would
    # otherwise keep the forkserver's, frozen when the first pool started)
    os.environ.clear()
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
    def __init__(self, world_size: int, timeout: float = 300.0, env: dict | None = None,
                 start_method: str = "spawn"):
        if start_method not in ("spawn", "forkserver"):
            raise ValueError(f"start_method {start_method!r}: use 'spawn' or 'forkserver'")
        if start_method == "forkserver" and "TRITON_INTERPRET" in (env or {}):
            raise ValueError("TRITON_INTERPRET is read when triton is imported, which the forkserver "
                             "has done already: use start_method='spawn'")
        self.world_size = world_size
        self.timeout = timeout
        self.env = dict(env or {})
        self.start_method = start_method
        self._procs: list = []

    def _start(self) -> None:
        ctx = mp.get_context(self.start_method)
        if self.start_method == "forkserver":
            ctx.set_forkserver_preload(list(FORKSERVER_PRELOAD))  # used when the server starts
        env = {**os.environ, **self.env}
        self._dir = tempfile.TemporaryDirectory(prefix="p3d-pool-")
        store = os.path.join(self._dir.name, "store")
        self._tasks = [ctx.Queue() for _ in range(self.world_size)]
        self._results = ctx.Queue()
        self._procs = [
            ctx.Process(target=_worker, daemon=True,
                        args=(r, self.world_size, store, self._tasks[r], self._results, env))
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
