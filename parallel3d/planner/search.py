"""Every valid layout for a job, each with its memory and step-time prediction.

A layout is valid when the trainer's own checks accept it (degrees divide the world,
heads and kv-heads divide by tp, every chunk has a layer, the global batch divides into
micro-batches, at least pp micro-batches, the sequence into 2 cp head-tail chunks and,
under sequence parallelism, a cp rank's S / cp tokens over tp; for a Mixture-of-Experts
model, ep dividing dp and the experts; under LoRA no ZeRO 3 with ep > 1); ``tp`` stays inside a
node (its all-reduces are on the critical path of every layer). It fits when its largest stage, plus the
fragmentation margin, is within the GPU's memory less the runtime reserve.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property, partial
from itertools import product
from typing import Callable, get_args

from parallel3d.config_choices import ZeroStage

from parallel3d.planner.hardware import FRAGMENTATION, GPU, Efficiency, usable_bytes
from parallel3d.planner.memory import StageMemory, memory_per_stage
from parallel3d.planner.spec import Layout, Workload, bucket_mb_for
from parallel3d.planner.timing import StepTime, step_time

MAX_MICRO_BATCH = 16
# Context parallelism is searched from this sequence length up (and below it when no layout
# fits without): Llama 3 used it only for its long-context stage (up to 128K tokens).
CP_MIN_SEQ_LEN = 16384
CP_COMMS = ("allgather", "ring")  # parallel.cp_comm values searched at cp > 1
VIRTUAL_STAGES = range(2, 9)
# ZeRO stages searched: those the trainer accepts (parallel.zero), 3 when it does; the
# time and memory models know 0 to 3 (planner.overlap, planner.memory)
ZERO_STAGES = tuple(sorted(get_args(ZeroStage)))  # chunks per rank; beyond 8 the extra point-to-point outweighs the bubble


@dataclass
class Candidate:
    layout: Layout
    stages: list[StageMemory]
    timing: Callable[[], StepTime] = field(repr=False, compare=False)  # the step time model, when asked
    budget: int  # bytes a rank may use

    @cached_property
    def time(self) -> StepTime:
        """The predicted step, computed when first read: the search sorts only the layouts
        that fit by it, and most of those that do not fit never need it."""
        return self.timing()

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


def cp_degrees(work: Workload, n: int, with_cp: bool) -> list[int]:
    """Context-parallel degrees to try on ``n`` ranks: those whose 2 cp head-tail chunks
    divide the sequence; only 1 unless ``with_cp`` (:func:`search` asks for cp > 1 on
    sequences of :data:`CP_MIN_SEQ_LEN` tokens or more, or when nothing fits without)."""
    if not with_cp:
        return [1]
    return [cp for cp in _divisors(n) if work.seq_len % (2 * cp) == 0]


def ep_degrees(model, dp: int) -> list[int]:
    """Expert-parallel degrees to try at ``dp``: the divisors of dp that divide the experts
    (``[1]`` for a dense model)."""
    if getattr(model, "moe", None) is None:
        return [1]
    return [ep for ep in _divisors(dp) if model.moe.n_experts % ep == 0]


def valid_layouts(work: Workload, n_gpus: int, gpus_per_node: int, fixed: dict | None = None,
                  with_cp: bool = False, bucket_rule: bool = False):
    """Yield every valid :class:`Layout` for ``n_gpus``; ``fixed`` pins fields by name.
    Rank order tp, cp, pp/dp: tp and cp inside a node where they fit. ``bucket_rule``: each
    layout's bucket the one :func:`~parallel3d.planner.spec.bucket_mb_for` gives its dp
    (what `plan` writes), else the config's default (a running job's, unchanged by a move)."""
    fixed = fixed or {}
    model = work.model
    with_cp = with_cp or fixed.get("cp", 1) > 1
    for tp in _divisors(n_gpus):
        if tp > gpus_per_node or model.n_heads % tp or model.n_kv_heads % tp:
            continue
        for cp in cp_degrees(work, n_gpus // tp, with_cp):
            for pp in _divisors(n_gpus // (tp * cp)):
                dp = n_gpus // (tp * cp * pp)
                if pp > model.n_layers or work.global_batch % dp:
                    continue
                if any(fixed.get(k, v) != v for k, v in (("tp", tp), ("cp", cp), ("pp", pp), ("dp", dp))):
                    continue
                per_rank = work.global_batch // dp
                for mb in [d for d in _divisors(per_rank) if d <= MAX_MICRO_BATCH]:
                    if per_rank // mb < pp:
                        continue
                    yield from _variants(work, tp, cp, pp, dp, mb, per_rank // mb, fixed, bucket_rule)


def _variants(work, tp, cp, pp, dp, mb, n_micro, fixed, bucket_rule=False):
    model = work.model
    schedules = [("1f1b", 1)]
    if pp > 1:
        # interleaved: as check_job demands, micro-batches a multiple of pp; zb-v: two
        # chunks per rank
        schedules = [("gpipe", 1), ("1f1b", 1), ("zb-h1", 1)] + [
            ("interleaved", v) for v in VIRTUAL_STAGES
            if pp * v <= model.n_layers and n_micro % pp == 0]
        if 2 * pp <= model.n_layers:
            schedules.append(("zb-v", 2))
    zeros = ZERO_STAGES if dp * cp > 1 else (0,)
    eps = ep_degrees(model, dp)
    # sequence parallelism splits a cp rank's S / cp tokens over tp
    sps = (False, True) if tp > 1 and (work.seq_len // cp) % tp == 0 else (False,)
    # both comm modes: the all-gather's traffic is exposed, the ring's hides behind the
    # attention but it keeps its output twice
    comms = CP_COMMS if cp > 1 else ("auto",)
    for (schedule, v), zero, recompute, sp, comm, ep in product(schedules, zeros, ("none", "selective", "full"),
                                                                 sps, comms, eps):
        layout = Layout(tp=tp, pp=pp, dp=dp, micro_batch=mb, schedule=schedule, virtual_stages=v,
                        zero=zero, recompute=recompute, sequence_parallel=sp, cp=cp, cp_comm=comm, ep=ep,
                        reduce_dtype=fixed.get("reduce_dtype", "fp32"),
                        bucket_mb=fixed.get("bucket_mb", bucket_mb_for(dp * cp) if bucket_rule else Layout.bucket_mb))
        if all(getattr(layout, k) == val for k, val in fixed.items()):
            yield layout


def evaluate(work: Workload, layout: Layout, gpu: GPU, gpus_per_node: int,
             eff: Efficiency | None = None) -> Candidate:
    if eff is None:  # the planner's default, inverted from its published anchor run
        from parallel3d.planner.calibrate import default_efficiency
        eff = default_efficiency()
    return Candidate(layout, memory_per_stage(work, layout), partial(step_time, work, layout, gpu, gpus_per_node, eff),
                     usable_bytes(gpu))


def search(work: Workload, n_gpus: int, gpus_per_node: int, gpu: GPU, eff: Efficiency | None = None,
           fixed: dict | None = None) -> list[Candidate]:
    """All valid layouts: those that fit by predicted step time (ties, to 0.1 ms, go to the
    one needing less memory), then those that do not, least over budget first.

    Context parallelism is searched on sequences of :data:`CP_MIN_SEQ_LEN` tokens or more
    (below, a sequence's activations are small next to the model states, and cp only adds
    K/V traffic), or when no layout fits without it."""
    def evaluated(with_cp: bool, least_cp: int = 1) -> list[Candidate]:
        return [evaluate(work, layout, gpu, gpus_per_node, eff)
                for layout in valid_layouts(work, n_gpus, gpus_per_node, fixed, with_cp, bucket_rule=True)
                if layout.cp >= least_cp]

    with_cp = work.seq_len >= CP_MIN_SEQ_LEN
    found = evaluated(with_cp)
    if not with_cp and not any(c.fits for c in found):
        found += evaluated(True, least_cp=2)
    return sorted(found, key=lambda c: (not c.fits, round(c.time.step_s, 4) if c.fits else c.over_bytes,
                                        c.required))


def recommend(candidates: list[Candidate]) -> Candidate | None:
    """The fastest layout that fits; None when none does (never one that does not fit)."""
    return next((c for c in candidates if c.fits), None)
