"""Every valid layout for a job, each with its memory and step-time prediction.

A layout is valid when the trainer's own checks accept it (degrees divide the world,
heads and kv-heads divide by tp, every chunk has a layer, the global batch divides into
micro-batches, at least pp micro-batches); ``tp`` stays inside a node (its all-reduces
are on the critical path of every layer). It fits when its largest stage, plus the
fragmentation margin, is within the GPU's memory less the runtime reserve.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import product

from parallel3d.planner.hardware import FRAGMENTATION, GPU, Efficiency, usable_bytes
from parallel3d.planner.memory import StageMemory, memory_per_stage
from parallel3d.planner.spec import Layout, Workload
from parallel3d.planner.timing import StepTime, step_time

MAX_MICRO_BATCH = 16
VIRTUAL_STAGES = range(2, 9)  # chunks per rank; beyond 8 the extra point-to-point outweighs the bubble


@dataclass
class Candidate:
    layout: Layout
    stages: list[StageMemory]
    time: StepTime
    budget: int  # bytes a rank may use

    @property
    def worst(self) -> StageMemory:
        return max(self.stages, key=lambda s: s.peak)

    @property
    def required(self) -> int:
        """Bytes the largest stage needs, fragmentation margin included."""
        return int(self.worst.peak * (1 + FRAGMENTATION))

    @property
    def fits(self) -> bool:
        return self.required <= self.budget

    @property
    def over_bytes(self) -> int:
        return self.required - self.budget

    def verdict(self) -> str:
        if self.fits:
            return "fits"
        return (f"does not fit: stage {self.worst.stage} needs {self.required / 2**30:.1f} GiB, "
                f"{self.over_bytes / 2**30:.1f} GiB over the {self.budget / 2**30:.1f} GiB budget")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def valid_layouts(work: Workload, n_gpus: int, gpus_per_node: int, fixed: dict | None = None):
    """Yield every valid :class:`Layout` for ``n_gpus``; ``fixed`` pins fields by name."""
    fixed = fixed or {}
    model = work.model
    for tp in _divisors(n_gpus):
        if tp > gpus_per_node or model.n_heads % tp or model.n_kv_heads % tp:
            continue
        for pp in _divisors(n_gpus // tp):
            dp = n_gpus // (tp * pp)
            if pp > model.n_layers or work.global_batch % dp:
                continue
            if any(fixed.get(k, v) != v for k, v in (("tp", tp), ("pp", pp), ("dp", dp))):
                continue
            per_rank = work.global_batch // dp
            for mb in [d for d in _divisors(per_rank) if d <= MAX_MICRO_BATCH]:
                if per_rank // mb < pp:
                    continue
                yield from _variants(model, tp, pp, dp, mb, per_rank // mb, fixed)


def _variants(model, tp, pp, dp, mb, n_micro, fixed):
    schedules = [("1f1b", 1)]
    if pp > 1:
        # interleaved: as check_job demands, micro-batches a multiple of pp; zb-v: two
        # chunks per rank
        schedules = [("gpipe", 1), ("1f1b", 1), ("zb-h1", 1)] + [
            ("interleaved", v) for v in VIRTUAL_STAGES
            if pp * v <= model.n_layers and n_micro % pp == 0]
        if 2 * pp <= model.n_layers:
            schedules.append(("zb-v", 2))
    zeros = (0, 1, 2) if dp > 1 else (0,)
    sps = (False, True) if tp > 1 else (False,)
    for (schedule, v), zero, recompute, sp in product(schedules, zeros, ("none", "selective", "full"), sps):
        layout = Layout(tp=tp, pp=pp, dp=dp, micro_batch=mb, schedule=schedule, virtual_stages=v,
                        zero=zero, recompute=recompute, sequence_parallel=sp)
        if all(getattr(layout, k) == val for k, val in fixed.items()):
            yield layout


def evaluate(work: Workload, layout: Layout, gpu: GPU, gpus_per_node: int,
             eff: Efficiency | None = None) -> Candidate:
    if eff is None:  # the planner's default, inverted from its published anchor run
        from parallel3d.planner.calibrate import default_efficiency
        eff = default_efficiency()
    return Candidate(layout, memory_per_stage(work, layout), step_time(work, layout, gpu, gpus_per_node, eff),
                     usable_bytes(gpu))


def search(work: Workload, n_gpus: int, gpus_per_node: int, gpu: GPU, eff: Efficiency | None = None,
           fixed: dict | None = None) -> list[Candidate]:
    """All valid layouts: those that fit by predicted step time (ties, to 0.1 ms, go to the
    one needing less memory), then those that do not, least over budget first."""
    found = [evaluate(work, layout, gpu, gpus_per_node, eff)
             for layout in valid_layouts(work, n_gpus, gpus_per_node, fixed)]
    return sorted(found, key=lambda c: (not c.fits, round(c.time.step_s, 4) if c.fits else c.over_bytes,
                                        c.required))


def recommend(candidates: list[Candidate]) -> Candidate | None:
    """The fastest layout that fits; None when none does (never one that does not fit)."""
    return next((c for c in candidates if c.fits), None)
