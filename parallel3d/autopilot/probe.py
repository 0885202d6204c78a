"""What a micro-batch costs on this rank's device, measured: the compute terms of the fit.

One layout's step cannot tell compute from tensor-parallel communication (both happen
inside forward and backward), so the autopilot measures compute alone: every rank runs,
at the same time (so the probe shares the cores or the device as training does), the
forward and backward of small dense models with the *shard shapes* of a tensor-parallel
degree (heads, kv-heads, MLP width and vocabulary divided by tp), at the job's
micro-batch and sequence length::

    A  embedding, 1 layer, final norm, head, cross-entropy
    B  the same with 2 layers
    C  embedding and 1 layer, no head

so that ``layer = B - A``, ``head = A - C`` and ``base = C - layer`` (a chunk's cost without
its layers). The clock is the process's CPU time on CPU (immune to waiting for a core:
what is measured is the work) and CUDA events on a GPU. Every rank runs every
configuration (:func:`probe_compute`), and the medians are averaged over the world, so
every rank holds the same table. One probe model exists at a time: each is built, run and
freed (with its gradients) before the next, so the probe adds one small model's state to
the trainer's, never the three per degree.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import replace

import torch
import torch.distributed as dist
import torch.nn.functional as F

from parallel3d.planner.fitted import ChunkCost

CONFIGS = (("A", 1, True), ("B", 2, True), ("C", 1, False))  # name, layers, with head


def shard_config(model, tp: int):
    """The dense config whose layer has the shapes of one tp rank's shard of ``model``."""
    kv = model.n_kv_heads // tp if model.n_kv_heads % tp == 0 else 1  # replicated kv-heads
    return replace(model, n_heads=model.n_heads // tp, n_kv_heads=kv, ffn_dim=model.ffn_dim // tp,
                   vocab_size=math.ceil(model.vocab_size / tp), head_dim_override=model.head_dim,
                   tie_embeddings=False)


def _clock(device: torch.device):
    """(mark, seconds between two marks): process CPU time on CPU, CUDA events on a GPU."""
    if device.type == "cuda":
        def mark():
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e

        def seconds(a, b):
            b.synchronize()
            return a.elapsed_time(b) / 1e3
        return mark, seconds
    return time.process_time, lambda a, b: b - a


def _run_once(model_cfg, tp: int, layers: int, head: bool, micro_batch: int, seq_len: int,
              device: torch.device, dtype: torch.dtype, mark, seconds) -> float:
    """Build the probe model (see the docstring), time one forward and backward on its own
    and let it go, gradients included: seconds. The clock excludes the build, as when the
    models were built once (each timed run then allocated its gradients anew too)."""
    from parallel3d.models.llama.model import Llama

    cfg = replace(shard_config(model_cfg, tp), n_layers=layers)
    gen = torch.Generator().manual_seed(0)
    # its random init draws from a fork of torch's generators: the probe, run between
    # training steps every round, leaves the training's random state as it found it
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), torch.device(device):
        model = Llama(cfg).to(dtype)
    if not head:
        model.lm_head = None
    tokens = torch.randint(0, cfg.vocab_size, (micro_batch, seq_len), generator=gen).to(device)
    a = mark()
    out = model(tokens)
    if head:
        loss = F.cross_entropy(out.float().view(-1, cfg.vocab_size), tokens.view(-1))
    else:
        loss = out.float().square().mean()
    loss.backward()
    elapsed = seconds(a, mark())
    del out, loss, model  # the parameters and their .grad go with the model
    return elapsed


class ComputeProbe:
    """The compute probe, one round at a time: :meth:`round` runs every configuration once
    (the first round warms up and is not counted), :meth:`result` turns the rounds so far
    into the table (collective over ``group``).

    Every rank runs every configuration, interleaved, so that a burst of load elsewhere on
    the machine falls on all of them alike; the autopilot runs a round between chunks of
    its measured steps, so that the probe samples the conditions the measurement saw.
    The median over rounds counts (a training step is measured by medians too: the
    minimum would leave out the interference training sees), averaged over the ranks."""

    def __init__(self, model_cfg, tps: list[int], micro_batch: int, seq_len: int, device: torch.device,
                 dtype: torch.dtype = torch.float32):
        self.tps = sorted(set(tps))
        self.jobs = [(tp, name, layers, head) for tp in self.tps for name, layers, head in CONFIGS]
        self.shape = (model_cfg, micro_batch, seq_len, device, dtype)
        self.device = device
        self.mark, self.seconds = _clock(device)
        self.samples: list[list[float]] = [[] for _ in self.jobs]
        self.rounds = 0

    def round(self) -> None:
        model_cfg, micro_batch, seq_len, device, dtype = self.shape
        for i, (tp, _, layers, head) in enumerate(self.jobs):
            took = _run_once(model_cfg, tp, layers, head, micro_batch, seq_len, device, dtype,
                             self.mark, self.seconds)
            if self.rounds:  # round 0 warms up (first-call dispatch, kernel selection)
                self.samples[i].append(took)
        self.rounds += 1

    def result(self, group=None) -> dict[int, ChunkCost]:
        medians = torch.tensor([statistics.median(x) for x in self.samples], dtype=torch.float64)
        if dist.is_initialized() and dist.get_world_size(group) > 1:
            moved = medians.to(self.device)  # NCCL takes device tensors
            dist.all_reduce(moved, group=group)
            medians = moved.cpu() / dist.get_world_size(group)
        times = {(tp, name): float(medians[i]) for i, (tp, name, _, _) in enumerate(self.jobs)}
        out = {}
        for tp in self.tps:
            a, b, c = times[(tp, "A")], times[(tp, "B")], times[(tp, "C")]
            layer = max(0.0, b - a)
            out[tp] = ChunkCost(base=max(0.0, c - layer), layer=layer, head=max(0.0, a - c))
        return out


def probe_compute(model_cfg, tps: list[int], micro_batch: int, seq_len: int, device: torch.device,
                  dtype: torch.dtype = torch.float32, rounds: int = 4, group=None) -> dict[int, ChunkCost]:
    """:class:`ChunkCost` per tensor-parallel degree in ``tps``, ``rounds`` rounds at once
    (after one of warm-up); collective over ``group`` when torch.distributed is up."""
    probe = ComputeProbe(model_cfg, tps, micro_batch, seq_len, device, dtype)
    for _ in range(rounds + 1):
        probe.round()
    return probe.result(group)


def probe_collective_seconds_per_byte(device: torch.device, group=None, nbytes: int = 4 * 2**20,
                                      reps: int = 3) -> float:
    """Seconds per byte a rank moves in an all-reduce over ``group`` (collective): the
    clock of a ``nbytes`` all-reduce less that of a 4 KiB one, over the ring's bytes
    ``2 (g - 1) / g * nbytes`` (on CPU the process's CPU time: gloo's threads and the
    kernel's loopback copies are what a byte costs there). Without peers, a local copy."""
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    mark, seconds = _clock(device)
    big = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    if world <= 1:
        out = torch.empty_like(big)
        out.copy_(big)
        best = math.inf
        for _ in range(reps):
            a = mark()
            out.copy_(big)
            best = min(best, seconds(a, mark()))
        return best / nbytes
    small = torch.ones(1024, dtype=torch.float32, device=device)
    times = {}
    for name, t in (("small", small), ("big", big)):
        dist.all_reduce(t, group=group)  # warm-up
        best = math.inf
        for _ in range(reps):
            dist.barrier(group=group)
            a = mark()
            dist.all_reduce(t, group=group)
            best = min(best, seconds(a, mark()))
        times[name] = best
    moved = 2 * (world - 1) / world * (nbytes - small.numel() * 4)
    return max(0.0, times["big"] - times["small"]) / moved


def probe_adam_seconds_per_element(device: torch.device, dtype: torch.dtype = torch.float32,
                                   numel: int = 2**20, reps: int = 3) -> float:
    """Seconds per element of one fused AdamW step (the optimizer's kernel)."""
    p = torch.zeros(numel, dtype=torch.float32, device=device, requires_grad=True)
    p.grad = torch.ones_like(p)
    opt = torch.optim.AdamW([p], lr=1e-3, fused=True)
    opt.step()
    mark, seconds = _clock(device)
    best = math.inf
    for _ in range(reps):
        a = mark()
        opt.step()
        best = min(best, seconds(a, mark()))
    return best / numel
