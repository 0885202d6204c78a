"""Whether to move layers off a slow pipeline stage, and how many: the pipeline split
rebalanced to the stages' measured speeds.

A stage's *speed* is its busy seconds per step (its slowest rank's, from the straggler
checks' per-rank rows: the step time less the waits for other ranks) over its *cost* in
layer units, the split rule's own (:mod:`parallel3d.pipeline.partition`: a decoder layer
costs 1, the embedding ``embed_cost``, the head ``head_cost``)::

    s_i = busy_i / (layers_i + extra_i)          seconds per layer unit on stage i

A stage that runs slow (a throttled host, a thermally limited GPU, a noisy neighbour) has
a larger ``s_i`` whatever layers it holds, which is what keeps the decision from flapping:
after a move the slow stage is no longer the slowest per step, but it is still the slowest
per layer, and the split computed from the speeds is the one it already runs.

The new split minimises the busiest stage, ``max_i s_i (layers_i + extra_i)``, then evens
the costs under that bound (the rule of :func:`~parallel3d.pipeline.partition.balanced_split`,
each stage's layers weighted by its speed). Its step time is predicted from the measured
one by the pipeline's shape: with ``m`` micro-batches a 1F1B step is ``m - 1`` rounds of
the busiest stage plus one pass through every stage, so in per-step busy units

    T(x) = ((m - 1) max_i x_i + sum_i x_i) / m,   predicted = measured * T(new) / T(current)

The job moves when the prediction is faster by more than ``min_gain`` and the seconds it
saves over the remaining steps pay for the move (the rule of :func:`~parallel3d.autopilot.decide.decide`).
Cuts inside a layer (between attention and MLP) are not made: the split is in whole layers.
Only ``virtual_stages = 1`` loop schedules are rebalanced (a rank holding several chunks
would need its speed shared among them).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field


def stage_busy(tables: list[dict], pp: int) -> list[float]:
    """Per pipeline stage, the median over the straggler checks ``tables`` (``ranks.jsonl``
    lines: ``{"step", "ranks": [{"pp", "busy_s", ...}]}``) of its slowest rank's busy
    seconds per step: the slowest rank sets the stage's pace (its tp and dp peers wait)."""
    if not tables:
        raise ValueError("no straggler checks to measure the stages by")
    per_check = []
    for table in tables:
        worst = [0.0] * pp
        for row in table["ranks"]:
            worst[row["pp"]] = max(worst[row["pp"]], row["busy_s"])
        per_check.append(worst)
    return [statistics.median(check[p] for check in per_check) for p in range(pp)]


def stage_costs(split: list[int], embed_cost: float, head_cost: float) -> list[float]:
    """Layer units per stage: its layers, the embedding on the first, the head on the last."""
    costs = [float(n) for n in split]
    costs[0] += embed_cost
    costs[-1] += head_cost
    return costs


def split_for_speeds(n_layers: int, speeds: list[float], embed_cost: float, head_cost: float) -> list[int]:
    """Whole layers per stage, at least one each, minimising ``max_i speeds_i * cost_i``;
    under that bound each further layer goes to the stage it costs least (the most even
    busy times), on a tie to the later stage (earlier stages hold more activations)."""
    n = len(speeds)
    if n_layers < n:
        raise ValueError(f"cannot split {n_layers} layers into {n} stages of at least one layer")
    extras = stage_costs([0] * n, embed_cost, head_cost)
    # The best bound is the busy time of some stage holding k layers.
    bounds = sorted({speeds[i] * (k + extras[i]) for i in range(n) for k in range(1, n_layers + 1)})
    caps = [n_layers] * n
    for bound in bounds:
        caps = [math.floor(bound / speeds[i] - extras[i] + 1e-9) for i in range(n)]
        if min(caps) >= 1 and sum(caps) >= n_layers:
            break
    counts = [1] * n
    for _ in range(n_layers - n):
        room = [i for i in range(n) if counts[i] < caps[i]]
        cost = {i: speeds[i] * (counts[i] + 1 + extras[i]) for i in room}
        least = min(cost.values())
        counts[max(i for i in room if cost[i] <= least * (1 + 1e-9))] += 1
    return counts


def pipeline_step(busy: list[float], microbatches: int) -> float:
    """A 1F1B step in per-step busy units: ``m - 1`` rounds of the busiest stage and one
    pass through all of them (module docstring)."""
    m = max(1, microbatches)
    return ((m - 1) * max(busy) + sum(busy)) / m


@dataclass
class Rebalance:
    action: str  # "rebalance" or "stay"
    reason: str
    split: list[int]  # layers per stage now
    target: list[int]  # layers per stage proposed (= split when staying)
    busy_s: list[float]  # measured busy seconds per step of each stage
    speeds: list[float]  # seconds per layer unit of each stage
    measured_s: float
    predicted_s: float
    gain: float  # 1 - predicted / measured
    switch_cost_s: float
    steps_left: int
    slow_stage: int  # the stage slowest per layer unit
    checks: list[int] = field(default_factory=list)  # the straggler checks (steps) measured

    def event(self, step: int) -> dict:
        """The decision as a metrics.jsonl record (``"event": "autopilot"``, ``"kind":
        "rebalance"``)."""
        return {"step": step, "event": "autopilot", "kind": "rebalance", "action": self.action,
                "reason": self.reason, "from": f"pp_layers {self.split}", "to": f"pp_layers {self.target}",
                "split": self.split, "target_split": self.target, "stage_busy_s": self.busy_s,
                "stage_s_per_layer": self.speeds, "slow_stage": self.slow_stage,
                "measured_step_s": self.measured_s, "predicted_step_s": self.predicted_s,
                "predicted_gain": self.gain, "switch_cost_s": self.switch_cost_s,
                "steps_left": self.steps_left, "checks": self.checks}


def decide_rebalance(busy: list[float], split: list[int], *, embed_cost: float, head_cost: float,
                     microbatches: int, measured_s: float, min_gain: float, steps_left: int,
                     switch_cost_s: float) -> Rebalance:
    """Stay, or rebalance ``split`` (layers per stage) to the stages' speeds measured as
    ``busy`` (seconds per step per stage); see the module docstring."""
    costs = stage_costs(split, embed_cost, head_cost)
    speeds = [b / c for b, c in zip(busy, costs)]
    target = split_for_speeds(sum(split), speeds, embed_cost, head_cost)
    new_busy = [s * c for s, c in zip(speeds, stage_costs(target, embed_cost, head_cost))]
    predicted = measured_s * pipeline_step(new_busy, microbatches) / pipeline_step(busy, microbatches)
    gain = 1 - predicted / measured_s
    saved = (measured_s - predicted) * steps_left
    slow = max(range(len(speeds)), key=lambda i: speeds[i])
    ratio = speeds[slow] / statistics.median(speeds)
    action = "stay"
    if target == split:
        reason = f"the split is balanced to the stages' speeds (stage {slow} {ratio:.2f}x the median per layer)"
    elif gain <= min_gain:
        reason = (f"pp_layers {target} predicted {gain:.0%} faster, not more than autopilot.min_gain "
                  f"{min_gain:.0%}")
    elif saved <= switch_cost_s:
        reason = (f"{saved:.1f} s saved over the {steps_left} remaining steps does not pay the move "
                  f"(about {switch_cost_s:.1f} s)")
    else:
        action = "rebalance"
        reason = (f"stage {slow} is {ratio:.2f}x the median stage's time per layer: pp_layers {split} -> {target} "
                  f"predicted {gain:.0%} faster; saves {saved:.1f} s over {steps_left} steps against a move "
                  f"of about {switch_cost_s:.1f} s")
    return Rebalance(action, reason, list(split), target, list(busy), speeds, measured_s, predicted, gain,
                     switch_cost_s, steps_left, slow)
