"""Starting torch.distributed inside a worker, and small collective helpers.

A worker is started by ``torchrun`` (or our own elastic launch, which sets the same
variables): ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``,
``MASTER_PORT``. Those (and ``LOCAL_SIZE``, which DeepSpeed's launcher sets instead of
``LOCAL_WORLD_SIZE``, and ``TORCHELASTIC_USE_AGENT_STORE``, which torchrun sets when its
agent hosts the store) are the only environment variables parallel3d reads.
"""

from __future__ import annotations

import os
import secrets
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from parallel3d.config import Backend, HostMemory
from parallel3d.errors import UserError


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ


def env_world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def pick_backend(requested: Backend) -> str:
    if requested == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    if requested == "nccl" and not torch.cuda.is_available():
        raise UserError("launch.backend 'nccl' needs CUDA devices: use gloo (or auto) on CPU")
    return requested


def device_for(backend: str) -> torch.device:
    if backend == "nccl":
        dev = torch.device("cuda", local_rank())
        torch.cuda.set_device(dev)
        return dev
    return torch.device("cpu")


def init_from_env(backend: str, timeout_s: float = 600.0) -> None:
    """Join the process group described by torchrun's environment variables.

    Under torchrun's shared store (``TORCHELASTIC_USE_AGENT_STORE=True``, its default with
    the c10d rendezvous) the agent keeps one TCPStore for all restarts, so the keys the
    workers of an earlier attempt wrote (gloo's and NCCL's addresses, our heartbeats) are
    still there when the restarted workers look for their peers': a rank can read a dead
    peer's address and fail to connect (pytorch/pytorch#135712, #167288). The workers of
    one attempt therefore agree on a fresh key prefix first (:func:`fresh_namespace`) and
    build the process group inside it.
    """
    if dist.is_initialized():
        return
    timeout = timedelta(seconds=timeout_s)
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        dist.init_process_group(backend=backend, timeout=timeout)
        return
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    agent_store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                                world_size=world, is_master=False, timeout=timeout)
    store = dist.PrefixStore(fresh_namespace(agent_store, rank, world, timeout_s), agent_store)
    dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world, timeout=timeout)


def fresh_namespace(store, rank: int, world: int, timeout_s: float, poll_s: float = 0.005) -> str:
    """A key prefix that no earlier user of ``store`` has written under, the same on all
    ``world`` ranks of this attempt, however many stale keys earlier attempts left.

    Rank 0 draws the prefix from a counter in the store (``add`` is atomic, so it is new).
    Every other rank asks for it under a random nonce of its own and waits for the answer
    under a key derived from that nonce -- a key nobody wrote before, so it cannot be
    read stale. Rank 0 answers each nonce it finds until every rank has acknowledged
    under the new prefix (a nonce left by a dead worker of an earlier attempt gets an
    answer nobody reads).
    """
    if world == 1:
        return f"parallel3d/attempt_{store.add('parallel3d/attempts', 1)}"
    if rank != 0:
        nonce = secrets.token_hex(8)
        store.set(f"parallel3d/ask/{rank}", nonce)
        namespace = store.get(f"parallel3d/answer/{rank}/{nonce}").decode()  # waits (store timeout)
        store.set(f"{namespace}/joined/{rank}", "1")
        return namespace
    namespace = f"parallel3d/attempt_{store.add('parallel3d/attempts', 1)}"
    pending, answered = set(range(1, world)), set()
    deadline = time.monotonic() + timeout_s
    while pending:
        for r in sorted(pending):
            if store.check([f"{namespace}/joined/{r}"]):
                pending.discard(r)
            elif store.check([f"parallel3d/ask/{r}"]):
                nonce = store.get(f"parallel3d/ask/{r}").decode()
                if (r, nonce) not in answered:
                    store.set(f"parallel3d/answer/{r}/{nonce}", namespace)
                    answered.add((r, nonce))
        if pending and time.monotonic() > deadline:
            raise RuntimeError(f"ranks {sorted(pending)} did not join the process group within "
                               f"{timeout_s:g} s (reliability.comm_timeout_s)")
        if pending:
            time.sleep(poll_s)
    return namespace


def set_cpu_threads(threads_per_proc: int) -> None:
    """Share the cores between the local processes (torchrun sets OMP_NUM_THREADS=1;
    our own launch does not, so the worker decides)."""
    if threads_per_proc <= 0:
        # DeepSpeed's launcher sets LOCAL_SIZE instead of torchrun's LOCAL_WORLD_SIZE.
        local = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("LOCAL_SIZE", "1")))
        threads_per_proc = max(1, (os.cpu_count() or 1) // local)
    torch.set_num_threads(threads_per_proc)


# CPU training: what glibc's allocator does with a step's freed buffers, by
# ``launch.host_memory``: (mmap threshold, trim threshold) in bytes, None: glibc's own.
#   fast   buffers from 4 MiB are mapped and unmapped (their memory goes back to the
#          system when freed), smaller ones are reused from the heap, which gives back
#          only what exceeds 16 MiB at its top;
#   tight  every buffer from 128 KiB is mapped and unmapped: resident memory follows what
#          the tensors hold, at the price of a page fault per 4 KiB each time a step
#          touches a new buffer;
#   libc   glibc's defaults: it raises the mmap threshold as large blocks are freed (up to
#          32 MiB) and keeps those in its heaps, where they fragment.
# Measured 2026-12-01 on the 2-core machine, the default model at 1 rank (median step of 20,
# three alternating rounds): 227-264 ms fast, 380-391 ms tight (1.9 M page faults in 26
# steps against 86 k, 28% of its CPU time in the kernel), 229-249 ms libc; the 501
# M-parameter model at tp 2 x pp 2 (benchmarks/bench_scale.py), rank 0's peak after 2
# steps: 2722 MiB fast, 2640 tight, 2911 libc, against 2103 MiB of its own state.
HOST_MEMORY = {"fast": (4 * 2**20, 16 * 2**20), "tight": (128 * 2**10, None), "libc": (None, None)}


def set_host_allocator(mode: HostMemory) -> bool:
    """Apply ``launch.host_memory`` (:data:`HOST_MEMORY`) to this process's C allocator;
    returns whether it applied (``libc`` and other C libraries than glibc: not). CPU only:
    on GPU, host memory holds little of the step."""
    import ctypes
    import ctypes.util

    mmap_threshold, trim_threshold = HOST_MEMORY[mode]
    if mmap_threshold is None:
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        applied = bool(libc.mallopt(-3, mmap_threshold))  # M_MMAP_THRESHOLD (fixes it: no raising)
        if trim_threshold is not None:
            applied = bool(libc.mallopt(-1, trim_threshold)) and applied  # M_TRIM_THRESHOLD
        return applied
    except (OSError, AttributeError):
        return False


# Under this many bytes x ranks, a gloo all-reduce goes by one all-to-all (see all_reduce).
GLOO_SMALL_BYTES = 4 * 2**20


def check_device(t: torch.Tensor, group) -> None:
    """An NCCL group takes only CUDA tensors; say so naming the tensor's device, instead of
    NCCL's "No backend type associated with device type cpu" from deep in a step."""
    if t.device.type != "cuda" and dist.get_backend(group) == "nccl":
        raise RuntimeError(f"a {t.device.type} tensor {tuple(t.shape)} was handed to a collective on an "
                           "NCCL group, which takes only CUDA tensors: create it on the training device")


def gloo_p2p_needs_host(backend: str, device: torch.device | str) -> bool:
    """Whether a send or receive of a tensor on ``device`` over a ``backend`` group must go
    through a host buffer: on gloo, for every device but the CPU. gloo copies device
    tensors through the host for its collectives, but its send and receive hand the
    tensor's data pointer to the TCP transport, which only reads and writes host memory."""
    return backend == "gloo" and torch.device(device).type != "cpu"


def check_p2p_device(t: torch.Tensor, group) -> None:
    """A send/receive tensor must live where the group's transport reads it: on NCCL, on
    CUDA (:func:`check_device`); on gloo, on the host (:func:`gloo_p2p_needs_host`). Refuse
    the others here, naming the tensor, instead of a failed or hung first pipeline step."""
    check_device(t, group)
    if gloo_p2p_needs_host(dist.get_backend(group), t.device):
        raise RuntimeError(f"a {t.device.type} tensor {tuple(t.shape)} was handed to a send/receive on a "
                           "gloo group, whose transport reads only host memory: stage it through a host "
                           "buffer (parallel3d.pipeline.staging.HostStaging)")


def all_reduce(t: torch.Tensor, group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """In-place all-reduce (SUM, MAX or MIN); a no-op when ``group`` is None or has one rank.

    On gloo, whose all-reduce runs 2(p-1) dependent message rounds (measured on the 2-core
    machine for a few floats: 1.2 ms at 2 ranks, 5 ms at 4, 19 ms at 8), a tensor with
    bytes x p <= ``GLOO_SMALL_BYTES`` is sent whole to every rank in one all-to-all
    (0.6, 2.7 and 4.7 ms; 0.6 against 1.6 ms for 128 KiB at 2 ranks) and each rank folds
    the p copies in rank order, so every rank gets the same bits. Larger tensors, and
    every tensor on NCCL, take the backend's all-reduce."""
    if group is None:
        return t
    p = dist.get_world_size(group)
    if p == 1:
        return t
    check_device(t, group)
    small = t.numel() * t.element_size() * p <= GLOO_SMALL_BYTES
    if not (small and dist.get_backend(group) == "gloo"):
        dist.all_reduce(t, op=op, group=group)
        return t
    if op == dist.ReduceOp.SUM:
        fold = torch.Tensor.add_
    elif op == dist.ReduceOp.MAX:
        fold = lambda a, b: torch.maximum(a, b, out=a)  # noqa: E731
    elif op == dist.ReduceOp.MIN:
        fold = lambda a, b: torch.minimum(a, b, out=a)  # noqa: E731
    else:
        dist.all_reduce(t, op=op, group=group)
        return t
    mine = t.reshape(1, -1)
    received = torch.empty((p, mine.shape[1]), dtype=t.dtype, device=t.device)
    dist.all_to_all_single(received, mine.expand(p, -1).contiguous(), group=group)
    acc = received[0]
    for r in range(1, p):
        fold(acc, received[r])
    t.copy_(acc.view(t.shape))
    return t


def all_reduce_sum_max(sums: torch.Tensor, maxes: torch.Tensor, group) -> None:
    """In place: ``sums`` summed and ``maxes`` max-reduced over ``group`` (both 1-D, same
    dtype and device). On gloo, while small, one all-to-all carries both and each part is
    folded with its own operation in rank order (one collective); otherwise, two
    all-reduces (on NCCL each costs microseconds)."""
    if group is None or dist.get_world_size(group) == 1:
        return
    p = dist.get_world_size(group)
    check_device(sums, group)
    both = torch.cat([sums, maxes])
    small = both.numel() * both.element_size() * p <= GLOO_SMALL_BYTES
    if not (small and dist.get_backend(group) == "gloo"):
        dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
        dist.all_reduce(maxes, op=dist.ReduceOp.MAX, group=group)
        return
    received = torch.empty((p, both.numel()), dtype=both.dtype, device=both.device)
    dist.all_to_all_single(received, both.reshape(1, -1).expand(p, -1).contiguous(), group=group)
    n = sums.numel()
    acc_sum, acc_max = received[0, :n].clone(), received[0, n:].clone()
    for r in range(1, p):
        acc_sum.add_(received[r, :n])
        torch.maximum(acc_max, received[r, n:], out=acc_max)
    sums.copy_(acc_sum)
    maxes.copy_(acc_max)


# torch 2.13 renamed the flat collectives; older torch only has the old names.
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class _Done:
    def wait(self) -> bool:
        return True


class _CopyOnWait:
    """A reduce-scatter into a temporary of the wire's dtype, copied (upcast) into ``out``."""

    def __init__(self, work, tmp: torch.Tensor, out: torch.Tensor):
        self.work, self.tmp, self.out = work, tmp, out

    def wait(self) -> bool:
        if self.tmp is not None:
            self.work.wait()
            self.out.copy_(self.tmp)
            self.tmp = None
        return True


class _SumOnWait:
    """A gloo reduce-scatter in flight: the all-to-all's wait, then the local sum."""

    def __init__(self, work, received: torch.Tensor, out: torch.Tensor, n_ranks: int):
        self.work, self.received, self.out, self.n_ranks = work, received, out, n_ranks

    def wait(self) -> bool:
        if self.received is not None:
            self.work.wait()
            # in out's dtype: bf16 copies summed in fp32 (parallel.reduce_dtype = "bf16")
            torch.sum(self.received.view(self.n_ranks, -1), dim=0, dtype=self.out.dtype, out=self.out)
            self.received = None
        return True


def reduce_scatter_flat(out: torch.Tensor, flat: torch.Tensor, group, async_op: bool = False):
    """``out`` <- this rank's ``1/p`` slice of the sum over ``group`` of the 1-D ``flat``
    (``flat.numel() == p * out.numel()``); ``async_op`` returns a handle with ``wait()``,
    after which ``out`` holds the result. ``flat`` may be of a narrower dtype than ``out``
    (bf16 on the wire, fp32 out): gloo sums the received copies in ``out``'s dtype, NCCL
    sums in ``flat``'s and the result is upcast into ``out``.

    NCCL runs its reduce-scatter. gloo has none of its own (ProcessGroupGloo's
    reduce-scatter all-reduces a copy of the input), so there each rank receives every
    rank's copy of its slice in one all-to-all and sums the ``p`` copies locally, in rank
    order: it moves ``(p-1)/p`` of the buffer per rank, half what an all-reduce moves,
    and measured 3x faster than ``all_reduce`` on 5 MB at 2 and 4 ranks.
    """
    p = 1 if group is None else dist.get_world_size(group)
    if flat.numel() != p * out.numel():
        raise ValueError(f"reduce_scatter_flat: {flat.numel()} elements do not split into {p} x {out.numel()}")
    if p == 1:
        out.copy_(flat)
        return _Done() if async_op else None
    check_device(flat, group)
    if dist.get_backend(group) != "gloo":
        if out.dtype != flat.dtype:
            tmp = torch.empty(out.shape, dtype=flat.dtype, device=out.device)
            work = _reduce_scatter_single(tmp, flat, group=group, async_op=async_op)
            pending = _CopyOnWait(work if async_op else _Done(), tmp, out)
            if async_op:
                return pending
            pending.wait()
            return None
        work = _reduce_scatter_single(out, flat, group=group, async_op=async_op)
        return work
    received = torch.empty_like(flat)
    work = dist.all_to_all_single(received, flat, group=group, async_op=async_op)
    pending = _SumOnWait(work if async_op else _Done(), received, out, p)
    if async_op:
        return pending
    pending.wait()
    return None
