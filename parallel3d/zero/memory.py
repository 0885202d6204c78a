"""Memory accounting: what a rank actually holds, read from the tensors' storage.

:func:`memory_report` counts each storage once (by device and address), in the first
kind that claims it, in this order: parameters, gradients, optimizer state. A flat buffer
that parameters or gradients are views of is counted whole (padding included); fp32
master weights that are the parameters themselves count as parameters only.

:class:`AllocationMeter` measures activation memory on any device, CPU included: a
dispatch mode that sees every tensor an operator creates and follows its storage until
it is freed, giving the live and peak bytes allocated while it is active.
"""

from __future__ import annotations

import json
import weakref
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


def _storage_key(t: torch.Tensor) -> tuple[str, int]:
    s = t.untyped_storage()
    return str(t.device), s.data_ptr()


def _optimizer_tensors(optimizer) -> dict[str, list[torch.Tensor]]:
    if optimizer is None:
        return {"grads": [], "optimizer_state": []}
    if hasattr(optimizer, "memory_tensors"):
        return optimizer.memory_tensors()
    inner = getattr(optimizer, "inner", optimizer)  # DataParallelOptimizer wraps torch's AdamW
    state = [v for s in inner.state.values() for v in s.values() if torch.is_tensor(v)]
    params = [p for g in inner.param_groups for p in g["params"]]
    return {"grads": [p.grad for p in params if p.grad is not None], "optimizer_state": state}


def memory_report(model: torch.nn.Module, optimizer=None) -> dict[str, int]:
    """Bytes held by this rank: ``params``, ``grads`` (``.grad`` and the optimizer's flat
    gradient buffers), ``optimizer_state`` (master weights, moments, step counters) and
    ``total``. Each storage counted once."""
    seen: set[tuple[str, int]] = set()

    def count(tensors) -> int:
        total = 0
        for t in tensors:
            key = _storage_key(t)
            if key not in seen:
                seen.add(key)
                total += t.untyped_storage().nbytes()
        return total

    held = _optimizer_tensors(optimizer)
    params = list(model.parameters())
    out = {  # (a ZeRO-3 optimizer holds the parameters' shards; their full storage is freed)
        "params": count(params + held.get("params", [])),
        "grads": count([p.grad for p in params if p.grad is not None] + held["grads"]),
        "optimizer_state": count(held["optimizer_state"]),
    }
    out["total"] = sum(out.values())
    return out


def log_memory(model: torch.nn.Module, optimizer, topo, run_dir: Path | None, zero_stage: int) -> None:
    """Every rank's :func:`memory_report` with its coordinates, gathered to rank 0 (a
    collective: every rank calls), written to ``run_dir/memory.json`` where ``run_dir`` is
    given (the logging rank), which prints its own line."""
    report = {**memory_report(model, optimizer), **topo.coords()}
    reports = [report]
    if dist.is_initialized() and topo.world_size > 1:  # to rank 0 only
        reports = [None] * topo.world_size if topo.rank == 0 else None
        dist.gather_object(report, reports, dst=0)
    if run_dir is not None:
        (run_dir / "memory.json").write_text(json.dumps(reports, indent=1))
        mib = {k: report[k] / 2**20 for k in ("params", "grads", "optimizer_state")}
        print(f"memory rank 0 (MiB): params {mib['params']:.1f}  grads {mib['grads']:.1f}  "
              f"optimizer state {mib['optimizer_state']:.1f}  "
              f"(zero={zero_stage}, all ranks in memory.json)", flush=True)


class AllocationMeter(TorchDispatchMode):
    """Live and peak bytes of the tensors created by operators while active::

        with AllocationMeter() as meter:
            loss = model(x).sum()
            held = meter.live          # what the forward pass left allocated
            loss.backward()
        meter.peak                     # the high-water mark over forward and backward

    Tensors that existed before (parameters) are not counted; a storage is counted from
    the first operator that returns it until its last view is freed.
    """

    def __init__(self):
        super().__init__()
        self.live = 0
        self.peak = 0
        self._tracked: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        # an output sharing storage with an input is a view or in-place result: no new bytes
        inputs = {id(t.untyped_storage()) for t in tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor) and not t.is_meta}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and not t.is_meta:
                storage = t.untyped_storage()
                if id(storage) not in inputs:
                    self._track(storage)
        return out

    def _track(self, storage) -> None:
        key = id(storage)
        if key in self._tracked or storage.nbytes() == 0:
            return
        self._tracked.add(key)
        nbytes = storage.nbytes()
        self.live += nbytes
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._release, key, nbytes)

    def _release(self, key: int, nbytes: int) -> None:
        self._tracked.discard(key)
        self.live -= nbytes
