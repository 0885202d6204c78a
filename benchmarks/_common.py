"""What every side-by-side benchmark shares: the job, the data, the optimizer settings,
the timing and memory probes, and the median/ratio table.

Every side (parallel3d or a peer) trains the model of ``job(...)``, initialised by
``init_llama_(Llama(model_cfg), train.seed)`` (the counter-based initialisation the
trainer applies shard by shard, so the initial weights are identical), on the global
batches of
:func:`global_batch` (the trainer's own sampler at dp=1: any dp degree sees the same
global batch, rank ``r`` its ``r``-th contiguous slice), with AdamW at a constant lr,
weight decay on >= 2-D parameters only, and clipping of the global gradient norm.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import statistics
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from parallel3d.config import JobConfig, config_from_dict
from parallel3d.models.llama import Llama
from parallel3d.train.optim import param_groups

CORPUS_DIR = "/tmp/p3d-bench-corpus"


def job(layout: dict, steps: int, global_batch: int = 8, micro_batch: int = 2, seq_len: int = 128,
        corpus_dir: str = CORPUS_DIR, dtype: str = "fp32", preset: str = "debug",
        run_dir: str = "/tmp/p3d-bench-run", model: dict | None = None) -> JobConfig:
    """The job both sides run: constant lr (no warm-up, no decay), clip at 1.0; ``model``
    overrides fields of the preset (``{"n_layers": 8}``; a ``vocab_size`` is the data's
    too)."""
    return config_from_dict({
        "model": {"preset": preset, **(model or {})},
        "parallel": layout,
        "train": {"steps": steps, "seed": 1234, "global_batch": global_batch,
                  "micro_batch": micro_batch, "seq_len": seq_len, "lr": 1e-3,
                  "warmup_steps": 0, "min_lr_ratio": 1.0, "grad_clip": 1.0,
                  "dtype": dtype, "log_interval": 10**9},
        "data": {"max_bytes": 1_000_000, "vocab_size": (model or {}).get("vocab_size", 2048),
                 "cache_dir": corpus_dir},
        "run": {"dir": run_dir},
    })


def initial_model(cfg: JobConfig) -> Llama:
    """The full model with the trainer's initial weights."""
    from parallel3d.models.llama.sharded_init import init_llama_
    from parallel3d.train.setup import resolve_model_config

    return init_llama_(Llama(resolve_model_config(cfg.model)), cfg.train.seed)


class GlobalBatches:
    """``(inputs, targets)`` of the whole global batch of a step, (G, S) each, in the order
    the trainer's sampler deals them out to dp ranks."""

    def __init__(self, cfg: JobConfig):
        from parallel3d.train.data import GlobalBatchSampler, TokenWindows, prepare_corpus

        self.windows = TokenWindows(prepare_corpus(cfg.data).split("train"), cfg.train.seq_len)
        t = cfg.train
        self.sampler = GlobalBatchSampler(self.windows.num_samples, t.global_batch,
                                          t.global_batch, 1, 0, t.seed)

    def __call__(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        (idx,) = self.sampler.step_indices(step)
        return self.windows.batch(idx)


def rank_micro_batches(x: torch.Tensor, y: torch.Tensor, dp: int, dp_rank: int,
                       micro: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """dp rank ``dp_rank``'s contiguous slice of the global batch cut into micro-batches."""
    per = x.shape[0] // dp
    xs, ys = x[dp_rank * per:(dp_rank + 1) * per], y[dp_rank * per:(dp_rank + 1) * per]
    return [(xs[i:i + micro], ys[i:i + micro]) for i in range(0, per, micro)]


def adamw(params, cfg: JobConfig) -> torch.optim.AdamW:
    t = cfg.train
    return torch.optim.AdamW(param_groups([p for p in params if p.requires_grad], t.weight_decay),
                             lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps, foreach=True)


@torch.no_grad()
def clip_global_norm(params, max_norm: float, group=None) -> torch.Tensor:
    """Clip plain (non-DTensor) gradients by the norm over all ranks of ``group``, each
    rank holding distinct parameters (pipeline stages); as ``clip_grad_norm_`` otherwise."""
    grads = [p.grad for p in params if p.grad is not None]
    sq = torch.stack([g.float().pow(2).sum() for g in grads]).sum()
    if group is not None:
        dist.all_reduce(sq, group=group)
    norm = sq.sqrt()
    torch._foreach_mul_(grads, torch.clamp(max_norm / (norm + 1e-6), max=1.0))
    return norm


# -- probes ----------------------------------------------------------------------------------

class PeakMemory:
    """Peak memory of this rank over a run.

    CUDA: ``max_memory_allocated``. CPU with ``tensors=True``: the high-water mark of the
    bytes of all live tensors created during the run (``AllocationMeter``: weights,
    gradients, optimizer state, activations, communication buffers; the analogue of
    ``max_memory_allocated``; it slows every operator, so the benchmark measures memory
    in a separate, untimed run). CPU otherwise: the process's resident-set high-water mark
    (``VmHWM``), reset at the start (``/proc/self/clear_refs`` 5) after returning freed
    heap to the OS (``malloc_trim``), minus the resident set at that point: the bytes the
    run added on top of what the process held before it (interpreter, torch, earlier
    runs' caches). It counts everything the run touched (weights, gradients, optimizer
    state, activations, communication buffers), as ``nvidia-smi`` would, not only tensors.
    """

    def __init__(self, device: torch.device, tensors: bool = False):
        self.device = device
        self.meter = None
        if tensors and device.type == "cpu":
            from parallel3d.zero.memory import AllocationMeter

            self.meter = AllocationMeter()

    def __enter__(self):
        gc.collect()
        if self.meter is not None:
            self.meter.__enter__()
        elif self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base = torch.cuda.memory_allocated(self.device)
        else:
            try:
                ctypes.CDLL("libc.so.6").malloc_trim(0)
            except OSError:
                pass
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self.base = _status_kib("VmRSS") * 1024
        return self

    def __exit__(self, *exc):
        if self.meter is not None:
            self.meter.__exit__(*exc)
            self.peak = self.meter.peak
        elif self.device.type == "cuda":
            self.peak = torch.cuda.max_memory_allocated(self.device) - self.base
        else:
            self.peak = _status_kib("VmHWM") * 1024 - self.base
        return False


def _status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{key} not in /proc/self/status")


@contextlib.contextmanager
def step_peak(run: "Run", mem: PeakMemory | None):
    """In a metered run (``PeakMemory(tensors=True)``), append to
    ``run.extra["step_peak"]`` the high-water mark of the enclosed step above the bytes
    allocated at its start: its activations, gradient and communication buffers, the
    optimizer's temporaries (what a step adds to the model states at rest)."""
    meter = getattr(mem, "meter", None)
    if meter is None:
        yield
        return
    base = meter.live
    meter.peak = base
    yield
    run.extra.setdefault("step_peak", []).append(meter.peak - base)


@dataclass
class Run:
    """One side's run on one rank: per-step times (s) and losses, peak memory (bytes)."""
    times: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    peak: int = 0
    extra: dict = field(default_factory=dict)


def timed(step_fn, device: torch.device):
    """Seconds of ``step_fn()`` (a whole optimizer step), ranks started together."""
    dist.barrier()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    out = step_fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0, out


# -- the table -------------------------------------------------------------------------------

@dataclass
class Side:
    """One side of a row, merged over ranks and rounds."""
    name: str
    step_ms: float  # median over rounds of (max over ranks of the step) after warm-up
    tokens_per_s: float
    peak_mib: float  # max over ranks
    final_loss: float
    losses: list[float]
    error: str = ""


def summarize(name: str, runs: list[list[Run]], warmup: int, tokens_per_step: int,
              memory_run: list[Run] | None = None) -> Side:
    """``runs[round][rank]`` -> one :class:`Side`. A step lasts as long as its slowest rank.
    Peak memory from ``memory_run[rank]`` when given (an untimed run), else the timed runs."""
    step_times = [max(r.times[s] for r in ranks) for ranks in runs
                  for s in range(warmup, len(ranks[0].times))]
    step = statistics.median(step_times)
    peak = max(r.peak for r in memory_run) if memory_run else max(r.peak for ranks in runs for r in ranks)
    losses = runs[0][0].losses
    return Side(name, step * 1e3, tokens_per_step / step, peak / 2**20, losses[-1], losses)


def failed(name: str, error: str) -> Side:
    return Side(name, float("nan"), float("nan"), float("nan"), float("nan"), [], error)


def loss_diff(a: Side, b: Side) -> float:
    if not a.losses or not b.losses:
        return float("nan")
    return max(abs(x - y) / abs(y) for x, y in zip(a.losses, b.losses))


def table(rows: list[tuple[str, Side, Side]]) -> str:
    """Markdown: one line per (row, peer) with both sides and parallel3d/peer ratios."""
    head = ("| row | peer | step ms p3d | step ms peer | ratio | tok/s p3d | tok/s peer "
            "| peak MiB p3d | peak MiB peer | final loss p3d | final loss peer | max loss rel. diff |")
    lines = [head, "|" + "---|" * 12]
    for row, ours, peer in rows:
        if peer.error:
            lines.append(f"| {row} | {peer.name} | {ours.step_ms:.0f} | fails: {peer.error} "
                         f"| - | {ours.tokens_per_s:.0f} | - | {ours.peak_mib:.0f} | - "
                         f"| {ours.final_loss:.4f} | - | - |")
            continue
        lines.append(
            f"| {row} | {peer.name} | {ours.step_ms:.0f} | {peer.step_ms:.0f} "
            f"| {ours.step_ms / peer.step_ms:.2f} | {ours.tokens_per_s:.0f} | {peer.tokens_per_s:.0f} "
            f"| {ours.peak_mib:.0f} | {peer.peak_mib:.0f} | {ours.final_loss:.4f} "
            f"| {peer.final_loss:.4f} | {loss_diff(ours, peer):.1e} |")
    return "\n".join(lines)
