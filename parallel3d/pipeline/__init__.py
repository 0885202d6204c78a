"""Pipeline parallelism: cutting layers into stages, schedules, point-to-point, timeline.

* ``partition``: the split rule and ``parallel.pp_layers`` checks (pure).
* ``schedules``: gpipe, 1f1b and interleaved as per-rank lists of actions (pure).
* ``simulate``: plays a plan on all ranks at once; deadlock, message order, ideal bubble.
* ``p2p``: batched send/receive between neighbouring stages.
* ``runtime``: :class:`PipelineSchedule`, what the trainer calls each step.
* ``timeline``: spans per rank, the bubble fraction, the merged Chrome trace.
* ``synthetic``: fixed-cost chunks for measuring schedules (benchmark, tests).
"""

from .runtime import PipelineSchedule, build_schedule

__all__ = ["PipelineSchedule", "build_schedule"]
