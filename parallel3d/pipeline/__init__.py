"""Pipeline parallelism: cutting layers into stages, schedules, point-to-point, timeline.

* ``partition``: the split rule, ``parallel.pp_layers`` checks, where each chunk lives (pure).
* ``actions``: actions (F, B, W), messages, the exchange batches of a plan (pure).
* ``schedules``: gpipe, 1f1b and interleaved as per-rank lists of actions; the registry (pure).
* ``zero_bubble``: zb-h1 and zb-v, whose backward is split into B and W (pure).
* ``simulate``: plays a plan on all ranks at once; deadlock, message order, ideal bubble.
* ``p2p``: batched send/receive between neighbouring stages.
* ``runtime``: :class:`PipelineSchedule`, what the trainer calls each step.
* ``timeline``: spans per rank, the bubble fraction, the merged Chrome trace.
* ``synthetic``: fixed-cost chunks for measuring schedules (benchmark, tests).
"""

__all__ = ["PipelineSchedule", "build_schedule"]


def __getattr__(name: str):
    # the runtime (torch) on first use: the planner reads the pure modules without torch
    if name in __all__:
        from . import runtime
        return getattr(runtime, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
