"""What a training step spent its time on, measured on every rank, summed to every rank.

The breakdown is built from the spans the pipeline :class:`~parallel3d.pipeline.timeline.Timeline`
records (one mechanism: the same spans make the Chrome trace and the bubble). Per rank,
each field is the summed duration of one kind of span inside the step, so the fields are
disjoint stretches of the step's wall time and add up to ``step_time_s``:

``data_wait_s``      fetching the step's micro-batches (blocked on the data pipeline)
``forward_s``        forward spans: compute, plus the tensor-parallel collectives and the
                     ZeRO parameter all-gather waits issued inside the forward
``backward_s``       backward spans: compute, plus the tp collectives (and ZeRO-2's
                     gradient reduce-scatters when they block) inside the backward
``optimizer_s``      the optimizer step, less the collective waits inside it
``comm_exposed_s``   blocked in collectives outside forward/backward: the tied-embedding
                     gradient all-reduce, the data-parallel gradient all-reduce (ZeRO: the
                     reduce-scatter finish and the last all-gather), the step's closing
                     all-reduce (norm, loss and per-rank figures in one; for a pipeline
                     stage that finished early, its wait for the others)
``bubble_s``         blocked in pipeline point-to-point waits (receiving a neighbour's
                     activations or gradients): the fill and drain of the schedule, plus
                     any transfer time the schedule did not hide. 0 with ``pp = 1``
``other_s``          what no span covers: zeroing gradients, the schedule's Python
                     bookkeeping between actions, the end-of-step device synchronisation

A rank's *busy* time is ``step_time_s - comm_exposed_s - bubble_s``: the part of the step
it was not waiting for another rank. Stragglers are judged on it, since every rank's
step time includes the waits a slow rank causes. Every ``straggler_interval`` steps each
rank's mean busy time over those steps is compared with the median of the ranks of its
own pipeline stage (they run the same layers; stages legitimately differ, e.g. the one
holding the output head): above ``straggler_factor`` times that median, it is named.
With one rank per stage (tp = dp = 1) all ranks are compared with the overall median.
(A slow rank's tensor-parallel peers wait for it inside forward/backward, which counts as
busy: their busy time rises too, but not above the slow rank's own.)
"""

from __future__ import annotations

import resource
import socket
import statistics
import sys

import torch
import torch.distributed as dist

from parallel3d.distributed import all_reduce
from parallel3d.flops import mfu, model_flops_per_token
from parallel3d.planner.hardware import GPU, GPUS

BREAKDOWN = ("data_wait_s", "forward_s", "backward_s", "optimizer_s", "comm_exposed_s", "bubble_s",
             "other_s")
_CAT_FIELD = {"data": "data_wait_s", "forward": "forward_s", "backward": "backward_s",
              "comm": "comm_exposed_s", "wait": "bubble_s"}


def step_breakdown(spans: list[tuple[str, float, float]], step_time: float) -> dict[str, float]:
    """The fields above from one rank's spans ``(cat, t0, t1)`` (seconds from the step's
    start). Collective waits nested in the optimizer span count once, as communication."""
    out = dict.fromkeys(BREAKDOWN, 0.0)
    optimizer = [(t0, t1) for cat, t0, t1 in spans if cat == "optimizer"]
    for cat, t0, t1 in spans:
        if cat == "optimizer":
            out["optimizer_s"] += t1 - t0
        elif cat in _CAT_FIELD:
            out[_CAT_FIELD[cat]] += t1 - t0
            if cat == "comm" and any(a <= t0 and t1 <= b for a, b in optimizer):
                out["optimizer_s"] -= t1 - t0
    # Every span lies inside the step, so the remainder is >= 0 up to clock rounding.
    out["other_s"] = max(0.0, step_time - sum(out.values()))
    return out


def gpu_of(device: torch.device) -> GPU | None:
    """The table entry of ``device``'s GPU, or None (CPU, or a GPU the table lacks: MFU is
    then left out rather than computed against a guessed peak)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device).upper()
    if "H200" in name:
        return GPUS["h200"]
    if "H100" in name and "PCIE" not in name and "NVL" not in name:  # the table's SXM part
        return GPUS["h100-80g"]
    if "A100" in name:  # 312 TFLOP/s bf16 dense for every A100 variant
        return GPUS["a100-80g"]
    return None


def peak_memory_bytes(device: torch.device) -> tuple[int, str]:
    """This process's peak memory and where it comes from: the CUDA caching allocator's
    ``max_memory_allocated`` on GPU, the process's peak resident set size on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device), "cuda_max_allocated"
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss * (1 if sys.platform == "darwin" else 1024), "cpu_max_rss"  # Linux: KiB


def find_stragglers(busy: list[float], factor: float, peers: list[list[int]] | None = None
                    ) -> list[tuple[int, float]]:
    """``(rank, median of its peers)`` for each rank whose busy time exceeds ``factor``
    times the median of its group in ``peers`` (default: one group of every rank)."""
    groups = peers or [list(range(len(busy)))]
    found = []
    for group in groups:
        median = statistics.median(busy[r] for r in group)
        found += [(r, median) for r in group if busy[r] > factor * median]
    return sorted(found)


class StepObserver:
    """Turns a finished step's timeline into metrics.

    A step's per-rank figures (:meth:`row`) travel to every rank in the *next* step's one
    collective: the trainer sums a vector of ``world x ROW`` slots, each rank's row in its
    own slot, together with that step's gradient norm and loss (:meth:`slots`). So the
    figures cost no collective of their own, and a record is complete one step after it
    was made (:meth:`per_rank`); :meth:`gather` sums the slots alone for the last step
    of a run."""

    ROW = 1 + len(BREAKDOWN) + 2  # step time, the breakdown, bubble, peak memory

    def __init__(self, cfg, topo, device: torch.device, model_cfg):
        train = cfg.train
        tokens = train.global_batch * train.seq_len
        self.flops_per_step = model_flops_per_token(model_cfg, train.seq_len) * tokens
        self.topo, self.device = topo, device
        self.obs = cfg.observability
        self.gpu = gpu_of(device)
        self.hosts: list[str] | None = None
        self._busy_sum: list[float] | None = None  # per rank, since the last straggler check
        self._busy_steps = 0
        grid = topo.grid
        stages = [[r for r in range(topo.world_size) if grid.coords(r)["pp"] == p] for p in range(topo.pp)]
        self.peers = stages if len(stages[0]) > 1 else None  # ranks that run the same layers
        self.mem_source = peak_memory_bytes(device)[1]

    def throughput(self, step_time: float) -> dict:
        """The figures of a step known at once: model TFLOP/s per device, and MFU on a GPU
        whose peak is known."""
        n = self.topo.world_size
        out = {"tflops_per_device": self.flops_per_step / step_time / n / 1e12}
        if self.gpu is not None:
            out["mfu"] = mfu(1.0 / step_time, self.flops_per_step, n, self.gpu.peak_flops)
        return out

    def row(self, step_time: float, spans, bubble: float = 0.0) -> list[float]:
        """This rank's figures of the step just finished: its step time, its breakdown,
        ``bubble`` (its idle share of its pipeline step window) and its peak memory."""
        own = step_breakdown(spans, step_time)
        return [step_time, *own.values(), bubble, float(peak_memory_bytes(self.device)[0])]

    def slots(self, row: list[float] | None) -> torch.Tensor:
        """``world x ROW`` fp64 zeros with ``row`` in this rank's slot (all zeros without
        one): summed over the world, every rank's row."""
        out = torch.zeros((self.topo.world_size, self.ROW), dtype=torch.float64)
        if row is not None:
            out[self.topo.rank] = torch.tensor(row, dtype=torch.float64)
        return out.view(-1).to(self.device)

    def gather(self, row: list[float]) -> list[list[float]]:
        """Every rank's row by a collective of its own (the last step of a run)."""
        return self.rows(all_reduce(self.slots(row), self.topo.world_group))

    def rows(self, sums: torch.Tensor) -> list[list[float]]:
        return sums.view(self.topo.world_size, self.ROW).tolist()

    def per_rank(self, step: int, rows: list[list[float]]) -> dict:
        """The fields of step ``step``'s record made from every rank's row: the breakdown
        and bubble as means over ranks, per-rank step and busy times, peak memory, and
        (every ``straggler_interval`` steps) the stragglers."""
        n = len(rows)
        record = {k: sum(r[1 + i] for r in rows) / n for i, k in enumerate(BREAKDOWN)}
        record["bubble_fraction"] = sum(r[-2] for r in rows) / n
        record["rank_step_time_s"] = [r[0] for r in rows]
        busy = [r[0] - r[1 + BREAKDOWN.index("comm_exposed_s")] - r[1 + BREAKDOWN.index("bubble_s")]
                for r in rows]
        record["rank_busy_s"] = busy
        record["peak_mem_bytes"] = int(max(r[-1] for r in rows))
        record["rank_peak_mem_bytes"] = [int(r[-1]) for r in rows]
        record["mem_source"] = self.mem_source
        self._busy_sum = [a + b for a, b in zip(self._busy_sum or [0.0] * n, busy)]
        self._busy_steps += 1
        every = self.obs.straggler_interval
        if every > 0 and step % every == 0 and n > 1:
            mean_busy = [b / self._busy_steps for b in self._busy_sum]
            self._busy_sum, self._busy_steps = None, 0
            record["stragglers"] = self._stragglers(mean_busy)
        return record

    def _host_names(self) -> list[str]:
        if self.hosts is None:
            self.hosts = [socket.gethostname()]
            if dist.is_available() and dist.is_initialized() and self.topo.world_size > 1:
                self.hosts = [None] * self.topo.world_size
                dist.all_gather_object(self.hosts, socket.gethostname())
        return self.hosts

    def _stragglers(self, busy: list[float]) -> list[dict]:
        hosts = self._host_names()
        found = []
        for r, median in find_stragglers(busy, self.obs.straggler_factor, self.peers):
            c = self.topo.grid.coords(r)
            found.append({"rank": r, "tp": c["tp"], "pp": c["pp"], "dp": c["dp"], "host": hosts[r],
                          "busy_s": busy[r], "median_busy_s": median})
        return found


def straggler_warning(s: dict, factor: float) -> str:
    return (f"warning: straggler rank {s['rank']} (tp {s['tp']}, pp {s['pp']}, dp {s['dp']}, host "
            f"{s['host']}): busy {s['busy_s'] * 1e3:.0f} ms per step vs median "
            f"{s['median_busy_s'] * 1e3:.0f} ms of its pipeline stage's ranks (> {factor:g}x)")
