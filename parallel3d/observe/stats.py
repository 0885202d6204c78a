"""What a training step spent its time on, measured on every rank, summed to every rank.

The breakdown is built from the spans the pipeline :class:`~parallel3d.pipeline.timeline.Timeline`
records (one mechanism: the same spans make the Chrome trace and the bubble). Per rank,
each field is the summed duration of one kind of span inside the step, so the fields are
disjoint stretches of the step's wall time and add up to ``step_time_s``:

``data_wait_s``      fetching the step's micro-batches (blocked on the data pipeline)
``forward_s``        forward spans: compute, plus the tensor-parallel collectives and the
                     ZeRO parameter all-gather waits issued inside the forward
``backward_s``       backward spans: compute, plus the tp collectives (and ZeRO-2's
                     gradient reduce-scatters when they block) inside the backward; with
                     a zero-bubble schedule both halves, B and the deferred W (the trace
                     shows them apart)
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

Beside the breakdown each record has ``cpu_s``, the process CPU seconds of a rank in the
step (every thread: the training thread, torch's compute threads, gloo's, the data
loader's), and ``cpu_fwd_bwd_s``, those spent while the schedule ran forward and backward
(means over ranks). On a CPU host with more ranks than cores, CPU time is what a layout
really costs: the autopilot fits its model to it (``parallel3d/planner/fitted.py``).

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

from parallel3d.flops import mfu, model_flops_per_token
from parallel3d.planner.hardware import GPU, GPUS

BREAKDOWN = ("data_wait_s", "forward_s", "backward_s", "optimizer_s", "comm_exposed_s", "bubble_s",
             "other_s")
_CAT_FIELD = {"data": "data_wait_s", "forward": "forward_s", "backward": "backward_s",
              "weight": "backward_s", "comm": "comm_exposed_s", "wait": "bubble_s"}


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


# Per-rank figures whose maximum (with the rank holding it) and minimum every record
# carries, and the quantum each is rounded to in the step's collective (see _Extremes).
EXTREMES = {"step_time_s": 1e-6, "busy_s": 1e-6, "peak_mem_bytes": 1024.0}


class _Extremes:
    """Maximum (with its rank) and minimum of per-rank values, by a MAX all-reduce of
    fixed size: rank r contributes ``q * world + r`` and ``-q`` for its value rounded to
    ``q`` quanta, so the maximum key names the largest value and its rank (exact in fp64
    while ``q * world < 2^53``: 100 days in microseconds at 8192 ranks)."""

    def __init__(self, world: int, rank: int):
        self.world, self.rank = world, rank

    def encode(self, values: dict[str, float]) -> list[float]:
        out = []
        for key, unit in EXTREMES.items():
            q = float(round(values[key] / unit))
            out += [q * self.world + self.rank, -q]
        return out

    def decode(self, maxes: list[float]) -> dict:
        out = {}
        for k, (key, unit) in enumerate(EXTREMES.items()):
            top, low = int(maxes[2 * k]), -maxes[2 * k + 1]
            out[key] = ((top // self.world) * unit, top % self.world, low * unit)
        return out


class StepObserver:
    """Turns a finished step's timeline into metrics.

    A step's per-rank figures (:meth:`row`) travel in the *next* step's one collective, as
    a payload of fixed size whatever the world (:meth:`payload`): the sums of the
    breakdown fields and of the bubble (means over ranks), and the maximum (with its rank
    and coordinates) and minimum of the step time, the busy time and the peak memory. So
    the figures cost no collective of their own, and a record is complete one step after
    it was made (:meth:`summary`); :meth:`gather` reduces the payload alone for the last
    step of a run. Per-rank rows travel only every ``straggler_interval`` steps, gathered
    to the rank that logs (:meth:`check_stragglers`)."""

    ROW = 1 + len(BREAKDOWN) + 4  # step time, the breakdown, bubble, CPU (step, fwd/bwd), peak memory
    SUMS = len(BREAKDOWN) + 3  # the breakdown fields, the bubble and the CPU times, summed over ranks
    MAXES = 2 * len(EXTREMES)

    def __init__(self, obs_cfg, topo, device: torch.device, model_cfg, *, global_batch: int, seq_len: int):
        """``obs_cfg``: the ``observability`` section; ``global_batch`` sequences of
        ``seq_len`` tokens a step (what the model FLOPs count)."""
        tokens = global_batch * seq_len
        self.flops_per_step = model_flops_per_token(model_cfg, seq_len) * tokens
        self.topo, self.device = topo, device
        self.obs = obs_cfg
        self.gpu = gpu_of(device)
        self.hosts: list[str] | None = None
        self._hosts_pending = True
        self._extremes = _Extremes(topo.world_size, topo.rank)
        self._own = [0.0, 0.0, 0.0]  # this rank's busy and step time summed since the last check, peak memory
        self._own_steps = 0
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

    def row(self, step_time: float, spans, bubble: float = 0.0, cpu: tuple[float, float] = (0.0, 0.0)
            ) -> list[float]:
        """This rank's figures of the step just finished: its step time, its breakdown,
        ``bubble`` (its idle share of its pipeline step window), ``cpu`` (process CPU
        seconds of the step and of its forward/backward) and its peak memory."""
        own = step_breakdown(spans, step_time)
        return [step_time, *own.values(), bubble, *cpu, float(peak_memory_bytes(self.device)[0])]

    @staticmethod
    def busy(row: list[float]) -> float:
        """A rank's busy time: its step time less its waits for other ranks."""
        return row[0] - row[1 + BREAKDOWN.index("comm_exposed_s")] - row[1 + BREAKDOWN.index("bubble_s")]

    def payload(self, row: list[float] | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(sums, maxes): fp64 vectors of :data:`SUMS` and :data:`MAXES` slots on the
        device, to be summed and max-reduced over the world (zeros without a row)."""
        if row is None:
            return (torch.zeros(self.SUMS, dtype=torch.float64, device=self.device),
                    torch.zeros(self.MAXES, dtype=torch.float64, device=self.device))
        self._own = [self._own[0] + self.busy(row), self._own[1] + row[0], max(self._own[2], row[-1])]
        self._own_steps += 1
        maxes = self._extremes.encode({"step_time_s": row[0], "busy_s": self.busy(row),
                                       "peak_mem_bytes": row[-1]})
        return (torch.tensor(row[1:1 + self.SUMS], dtype=torch.float64).to(self.device),
                torch.tensor(maxes, dtype=torch.float64).to(self.device))

    def gather(self, row: list[float]) -> dict:
        """The summary of ``row``'s step by a collective of its own (the last step of a
        run); the same fields as :meth:`summary`."""
        from parallel3d.distributed import all_reduce_sum_max

        sums, maxes = self.payload(row)
        all_reduce_sum_max(sums, maxes, self.topo.world_group)
        return self.summary(sums, maxes)

    def summary(self, sums: torch.Tensor, maxes: torch.Tensor) -> dict:
        """The fields of a record made from the reduced payload: the breakdown and the
        bubble as means over ranks; the largest step time, busy time and peak memory with
        the rank (and its coordinates) that had it, and the smallest."""
        n = self.topo.world_size
        sums, maxes = sums.tolist(), maxes.tolist()
        record = {k: sums[i] / n for i, k in enumerate(BREAKDOWN)}
        record["bubble_fraction"] = sums[len(BREAKDOWN)] / n
        record["cpu_s"] = sums[len(BREAKDOWN) + 1] / n
        record["cpu_fwd_bwd_s"] = sums[len(BREAKDOWN) + 2] / n
        for key, (top, rank, low) in self._extremes.decode(maxes).items():
            name = key.removesuffix("_s").removesuffix("_bytes")
            record[f"max_{key}" if key != "peak_mem_bytes" else key] = top
            record[f"min_{key}"] = low
            record[f"max_{name}_rank"] = {"rank": rank, **self.topo.grid.coords(rank)}
        record["peak_mem_bytes"] = int(record["peak_mem_bytes"])
        record["min_peak_mem_bytes"] = int(record["min_peak_mem_bytes"])
        record["mem_source"] = self.mem_source
        return record

    def check_stragglers(self, step: int) -> tuple[list[dict], list[dict]] | None:
        """Every ``straggler_interval`` steps (collective over the world; the same steps on
        every rank): each rank's mean busy and step time since the last check and its peak
        memory, gathered to rank 0 only. Returns, on rank 0, (stragglers, per-rank rows
        with coordinates and host); None elsewhere and between checks."""
        every = self.obs.straggler_interval
        if every <= 0 or step % every or self._own_steps == 0:
            return None
        mine = [self._own[0] / self._own_steps, self._own[1] / self._own_steps, self._own[2]]
        self._own, self._own_steps = [0.0, 0.0, 0.0], 0
        rows = self._gather_to_logger(torch.tensor(mine, dtype=torch.float64, device=self.device))
        hosts = self._host_names()
        if rows is None:
            return None
        table = [{"rank": r, **self.topo.grid.coords(r), "host": hosts[r], "busy_s": b,
                  "step_time_s": t, "peak_mem_bytes": int(m)} for r, (b, t, m) in enumerate(rows)]
        found = []
        if len(rows) > 1:
            for r, median in find_stragglers([b for b, _, _ in rows], self.obs.straggler_factor, self.peers):
                found.append({**{k: table[r][k] for k in ("rank", "tp", "pp", "dp", "host", "busy_s")},
                              "median_busy_s": median})
        return found, table

    def _gather_to_logger(self, mine: torch.Tensor) -> list[list[float]] | None:
        if not (dist.is_available() and dist.is_initialized() and self.topo.world_size > 1):
            return [mine.tolist()]
        out = [torch.empty_like(mine) for _ in range(self.topo.world_size)] if self.topo.rank == 0 else None
        dist.gather(mine, out, dst=0)
        return [t.tolist() for t in out] if out is not None else None

    def _host_names(self) -> list[str] | None:
        """Every rank's host name, on rank 0 (gathered once, at the first check: every
        rank calls this)."""
        if self._hosts_pending:
            self._hosts_pending = False
            self.hosts = [socket.gethostname()]
            if dist.is_available() and dist.is_initialized() and self.topo.world_size > 1:
                self.hosts = [None] * self.topo.world_size if self.topo.rank == 0 else None
                dist.gather_object(socket.gethostname(), self.hosts, dst=0)
        return self.hosts


def straggler_warning(s: dict, factor: float) -> str:
    return (f"warning: straggler rank {s['rank']} (tp {s['tp']}, pp {s['pp']}, dp {s['dp']}, host "
            f"{s['host']}): busy {s['busy_s'] * 1e3:.0f} ms per step vs median "
            f"{s['median_busy_s'] * 1e3:.0f} ms of its pipeline stage's ranks (> {factor:g}x)")
