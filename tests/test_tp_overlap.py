"""Tensor-parallel communication on the GPU path's terms, checked on gloo ranks:

* the input-gradient reduction of column-parallel layers sharing an input is issued
  before their wgrad GEMMs and waited for after them (and gloo moves it on its own
  thread meanwhile);
* comm.py makes no full copy where none is needed: the row-parallel partial sum and the
  embedding are reduced where they lie, a sequence gather / reduce-scatter copies nothing
  at micro_batch 1 or 2 (token shards, the collectives' own layout);
* the collectives go through the torch-version fallback alias, never
  ``dist.all_gather_single`` by name, and pyproject's torch floor is the tested version;
* a weight carrying an fp32 ``main_grad`` gets its gradient there, summed over
  micro-batches, and no ``.grad`` (the layer side of gradient-accumulation fusion).

Numerical parity with tp = 1 of the same layers is tests/test_tensor_parallel.py's.
"""

from __future__ import annotations

import importlib
import re
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from parallel3d.tensor_parallel import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
                                        gather_from_sequence, reduce_scatter_to_sequence, share_input)
from parallel3d.topology import Topology

ROOT = Path(__file__).resolve().parents[1]
_TOPO: dict[int, Topology] = {}


def _topology(tp: int) -> Topology:
    if tp not in _TOPO:
        _TOPO[tp] = Topology(tp, 1, dist.get_world_size() // tp)
    return _TOPO[tp]


class _Block(nn.Module):
    """Three column-parallel layers on one input, as q, k and v in attention."""

    def __init__(self, group, sp: bool, dims=(24, 16, 8), in_features: int = 20):
        super().__init__()
        torch.manual_seed(3)
        self.a, self.b, self.c = (ColumnParallelLinear.from_dense(nn.Linear(in_features, d, bias=i == 0),
                                                                  group, sequence_parallel=sp)
                                  for i, d in enumerate(dims))
        share_input(self, self.a, self.b, self.c)

    def forward(self, x):
        return self.a(x).sum(-1) + self.b(x).sum(-1) + self.c(x).pow(2).sum(-1)


# -- the order of the overlapped backward ------------------------------------------------

def check_overlap_order(sp: bool) -> list:
    from parallel3d.tensor_parallel import column

    topo = _topology(2)
    block = _Block(topo.tp_group, sp)
    x = torch.randn(2, 8 // (2 if sp else 1), 20, requires_grad=True)
    column.ORDER = []
    try:
        block(x).sum().backward()
        return list(column.ORDER)
    finally:
        column.ORDER = None


@pytest.mark.parametrize("sp", [False, True], ids=["all-reduce", "reduce-scatter"])
def test_dx_reduction_starts_before_the_wgrads_and_is_waited_after(pools, sp):
    expected = ["reduce started", ("wgrad", 0), ("wgrad", 1), ("wgrad", 2), "reduce waited"]
    for rank, order in enumerate(pools(2).run(check_overlap_order, sp)):
        assert order == expected, f"rank {rank}: {order}"


def check_gloo_progresses_alone(nbytes: int) -> float:
    """Seconds until a started reduction completes while this thread only polls."""
    from parallel3d.tensor_parallel.comm import start_all_reduce

    t = torch.ones(nbytes // 4)
    dist.barrier()
    pending = start_all_reduce(t, dist.group.WORLD)
    t0 = time.perf_counter()
    while not pending.work.is_completed():  # never wait(): only gloo's own thread can finish it
        if time.perf_counter() - t0 > 20:
            return float("inf")
        time.sleep(0.001)
    done = time.perf_counter() - t0
    pending.wait()
    assert torch.equal(t, torch.full_like(t, 2.0))
    return done


@pytest.mark.parametrize("nbytes", [64 << 10, 8 << 20], ids=["small-all-to-all", "large-all-reduce"])
def test_gloo_runs_the_started_reduction_on_its_own_thread(pools, nbytes):
    """What 'overlap' means on CPU: the collective finishes without this thread's help."""
    for rank, seconds in enumerate(pools(2).run(check_gloo_progresses_alone, nbytes)):
        assert seconds < 20, f"rank {rank}: the started collective never completed by itself"


# -- copies ------------------------------------------------------------------------------

class _CopyCounter(TorchDispatchMode):
    """Counts full copies (clone, copy_) of at least ``min_numel`` elements made while
    active, except inside the collectives themselves (``paused``)."""

    def __init__(self, min_numel: int):
        super().__init__()
        self.min_numel, self.copies, self.paused = min_numel, [], False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not self.paused and func in (torch.ops.aten.clone.default, torch.ops.aten.copy_.default):
            big = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.numel() >= self.min_numel]
            if big:
                self.copies.append((str(func), tuple(big[0].shape)))
        return out


def _counting(monkeypatch, counter):
    from parallel3d.tensor_parallel import comm

    for name in ("all_reduce", "all_gather_flat", "reduce_scatter_flat"):
        real = getattr(comm, name)

        def paused(*args, _real=real, **kwargs):
            counter.paused = True
            try:
                return _real(*args, **kwargs)
            finally:
                counter.paused = False
        monkeypatch.setattr(comm, name, paused)


def check_copies(batch: int) -> dict:
    monkeypatch = pytest.MonkeyPatch()
    topo, p = _topology(2), 2
    group, S, H = topo.tp_group, 8, 20
    torch.manual_seed(0)
    row = RowParallelLinear.from_dense(nn.Linear(H, H, bias=False), group)
    emb = VocabParallelEmbedding.from_dense(nn.Embedding(50, H), group)
    counts = {}
    try:
        def count(name, fn, min_numel):
            counter = _CopyCounter(min_numel)
            _counting(monkeypatch, counter)
            with counter:
                fn()
            counts[name] = counter.copies
        full = batch * S * H
        x_row = torch.randn(batch, S, H // p)
        count("row forward", lambda: row(x_row), full)
        row.reduce_in_place = False
        count("row forward, reduce_in_place=False", lambda: row(x_row), full)
        count("embedding forward", lambda: emb(torch.randint(0, 50, (batch, S))), full)
        shard = torch.randn(batch, S // p, H, requires_grad=True)
        count("sequence gather", lambda: gather_from_sequence(shard, group), full // p)
        partial = torch.randn(batch, S, H, requires_grad=True)
        count("sequence reduce-scatter", lambda: reduce_scatter_to_sequence(partial, group), full // p)
    finally:
        monkeypatch.undo()
    return counts


@pytest.mark.parametrize("batch", [1, 2])
def test_no_full_copies_where_none_is_needed(pools, batch):
    for rank, counts in enumerate(pools(2).run(check_copies, batch)):
        assert counts["row forward"] == [], (rank, counts)
        assert counts["embedding forward"] == [], (rank, counts)
        assert len(counts["row forward, reduce_in_place=False"]) == 1, (rank, counts)  # the counter sees a copy
        assert counts["sequence gather"] == [], (rank, counts)
        assert counts["sequence reduce-scatter"] == [], (rank, counts)


# -- torch versions ----------------------------------------------------------------------

def check_no_direct_all_gather_single() -> float:
    monkeypatch = pytest.MonkeyPatch()

    def refuse(*args, **kwargs):
        raise AssertionError("comm.py called dist.all_gather_single by name (no fallback on torch < 2.13)")
    monkeypatch.setattr(dist, "all_gather_single", refuse, raising=False)
    try:
        topo = _topology(2)
        x = torch.full((1, 2, 3), float(topo.tp_rank))
        y = gather_from_sequence(x, topo.tp_group)
        return float((y - torch.cat([torch.zeros(1, 2, 3), torch.ones(1, 2, 3)], dim=1)).abs().max())
    finally:
        monkeypatch.undo()


def test_comm_uses_the_fallback_alias_not_the_new_name(pools):
    assert pools(2).run(check_no_direct_all_gather_single) == [0.0, 0.0]


def test_the_alias_falls_back_on_torch_without_the_new_names(monkeypatch):
    import parallel3d.distributed as d

    monkeypatch.delattr(dist, "all_gather_single", raising=False)
    monkeypatch.delattr(dist, "reduce_scatter_single", raising=False)
    try:
        old = importlib.reload(d)
        assert old.all_gather_flat is dist.all_gather_into_tensor
        assert old._reduce_scatter_single is dist.reduce_scatter_tensor
    finally:
        monkeypatch.undo()
        importlib.reload(d)


def test_pyproject_torch_floor_is_the_version_ci_installs():
    floor = re.search(r'"torch>=([\d.]+)"', (ROOT / "pyproject.toml").read_text()).group(1)
    pinned = re.search(r"torch==([\d.]+)", (ROOT / ".ci/run").read_text()).group(1)
    assert tuple(map(int, pinned.split("."))) [:2] == tuple(map(int, floor.split(".")))[:2], (floor, pinned)
    running = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2])
    assert running >= tuple(map(int, floor.split(".")))[:2]


# -- gradient-accumulation fusion, the layer side -----------------------------------------

def check_main_grad(sp: bool, autocast: bool) -> dict[str, float]:
    """Two micro-batches through q/k/v-like shared layers and a row-parallel layer whose
    weights carry main_grad (non-zero to start: += not =); against the dense layers'
    summed .grad (fp32: a few ulps; bf16 autocast: dW rounded to bf16 once per GEMM)."""
    topo = _topology(2)
    group = topo.tp_group
    block = _Block(group, sp)
    torch.manual_seed(4)
    dense_row = nn.Linear(12, 20, bias=True)
    row = RowParallelLinear.from_dense(dense_row, group, sequence_parallel=sp)
    dense = _Block(None, False)  # the same weights (same seed), unsplit
    weights = [block.a.weight, block.b.weight, block.c.weight, row.weight]
    start = [torch.randn(w.shape, generator=torch.Generator().manual_seed(i)) for i, w in enumerate(weights)]
    for w, s in zip(weights, start):
        w.main_grad = s.clone()
    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else torch.autocast("cpu", enabled=False)
    for micro in range(2):
        x = torch.randn(2, 8, 20, generator=torch.Generator().manual_seed(10 + micro))
        h = torch.randn(2, 8, 12, generator=torch.Generator().manual_seed(20 + micro))
        start_h, stop_h = row.weight.p3d_tp_range
        x_mine = x
        if sp:  # this rank's run of the 2 x 8 tokens (the sequence-parallel shard, comm.py)
            x_mine = x.reshape(-1, 20)[topo.tp_rank * 8:(topo.tp_rank + 1) * 8].view(2, 4, 20)
        with ctx:
            (block(x_mine).sum() + row(h[..., start_h:stop_h]).float().pow(2).sum()).backward()
            (dense(x).sum() + dense_row(h).float().pow(2).sum() / (2 if sp else 1)).backward()
    errs = {}
    for name, layer, dense_layer, s in (("a", block.a, dense.a, start[0]), ("b", block.b, dense.b, start[1]),
                                        ("c", block.c, dense.c, start[2])):
        lo, hi = layer.weight.p3d_tp_range
        want = s + dense_layer.weight.grad[lo:hi]
        errs[name] = float((layer.weight.main_grad - want).norm() / want.norm())
        errs[name + " .grad is None"] = float(layer.weight.grad is not None)
    lo, hi = row.weight.p3d_tp_range
    want = start[3] + dense_row.weight.grad[:, lo:hi] * (2 if sp else 1)
    errs["row"] = float((row.weight.main_grad - want).norm() / want.norm())
    errs["row .grad is None"] = float(row.weight.grad is not None)
    errs["bias still in .grad"] = float(block.a.bias.grad is None)
    return errs


@pytest.mark.parametrize("sp,autocast", [(False, False), (True, False), (False, True)],
                         ids=["fp32", "fp32-sp", "bf16-autocast"])
def test_weights_with_main_grad_accumulate_there_and_get_no_grad(pools, sp, autocast):
    # fp32: the sharded GEMMs sum the same products in another order (~1e-7); bf16: the
    # dense side rounds dW to bf16 in .grad's fp32 copy the same way, but inputs and
    # outputs round in bf16 (2^-8 relative), hence 2e-2 as in test_tensor_parallel.py.
    tol = 2e-2 if autocast else 1e-5
    for rank, errs in enumerate(pools(2).run(check_main_grad, sp, autocast)):
        bad = {k: e for k, e in errs.items() if not e < tol or (k.endswith("None") or k.startswith("bias")) and e}
        assert not bad, f"rank {rank}: {bad}"
