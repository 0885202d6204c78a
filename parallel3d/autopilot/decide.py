"""Whether to move a running job, and where: every layout of the same world ranked by the
step time the fitted terms predict (:mod:`parallel3d.planner.fitted`).

The candidates are the planner's valid layouts (:func:`~parallel3d.planner.search.valid_layouts`)
of the same world size, global batch and micro-batch (the compute terms were measured at
that micro-batch), that the trainer's own checks accept, and whose largest stage fits the
memory budget less ``memory_margin`` by the planner's memory model. The job moves to the
fastest when it is predicted faster than the measured step by more than ``min_gain`` and
the time it saves over the remaining steps exceeds the estimated cost of the move (a
checkpoint save, new process groups, the model rebuilt and the checkpoint read back).
A layout that does not fit is never chosen.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

from parallel3d.planner.fitted import FittedTerms, Measured, Prediction, predict
from parallel3d.planner.hardware import FRAGMENTATION
from parallel3d.planner.memory import memory_per_stage
from parallel3d.planner.search import CP_MIN_SEQ_LEN, valid_layouts
from parallel3d.planner.spec import Layout, Workload

GiB = 2**30


@dataclass
class Option:
    layout: Layout
    prediction: Prediction
    required_bytes: int  # the largest stage's peak with the fragmentation margin
    fits: bool
    why: str = ""  # why it lost (or won)

    @property
    def step_s(self) -> float:
        return self.prediction.step_s

    def to_dict(self) -> dict:
        return {"layout": self.layout.describe(), "predicted_step_s": self.step_s, "bound": self.prediction.bound,
                "required_gib": self.required_bytes / GiB, "fits": self.fits, "why": self.why}


@dataclass
class Decision:
    action: str  # "move" or "stay"
    reason: str
    current: Layout
    target: Layout
    measured_s: float
    predicted_current_s: float
    predicted_s: float  # of the target
    gain: float  # 1 - predicted target / measured current
    switch_cost_s: float
    steps_left: int
    terms: FittedTerms
    options: list[Option] = field(default_factory=list)

    def event(self, step: int) -> dict:
        """The decision as a metrics.jsonl record (``"event": "autopilot"``)."""
        shown = [o for o in self.options if o.fits][:8] + [o for o in self.options if not o.fits][:4]
        return {"step": step, "event": "autopilot", "action": self.action, "reason": self.reason,
                "from": self.current.describe(), "to": self.target.describe(),
                "measured_step_s": self.measured_s, "predicted_current_s": self.predicted_current_s,
                "predicted_step_s": self.predicted_s, "predicted_gain": self.gain,
                "switch_cost_s": self.switch_cost_s, "steps_left": self.steps_left,
                "terms": self.terms.to_dict(), "terms_text": self.terms.describe(),
                "candidates": len(self.options), "fitting": sum(o.fits for o in self.options),
                "ranked": [o.to_dict() for o in shown]}


def layout_overrides(layout: Layout) -> dict:
    """The recipe keys of ``layout`` (``pp_layers`` back to the balanced rule)."""
    return {"parallel": {"tp": layout.tp, "pp": layout.pp, "dp": layout.dp, "cp": layout.cp, "ep": layout.ep,
                         "schedule": layout.schedule,
                         "virtual_stages": layout.virtual_stages, "zero": layout.zero,
                         "sequence_parallel": layout.sequence_parallel, "pp_layers": None},
            "train": {"micro_batch": layout.micro_batch, "recompute": layout.recompute}}


def with_layout(cfg, layout: Layout, pp_layers: list[int] | None = None):
    """A copy of the job ``cfg`` at ``layout``, its layers split as ``pp_layers`` (None:
    the balanced rule)."""
    out = copy.deepcopy(cfg)
    for section, keys in layout_overrides(layout).items():
        for key, value in keys.items():
            setattr(getattr(out, section), key, value)
    out.parallel.pp_layers = list(pp_layers) if pp_layers is not None else None
    return out


def _same(a: Layout, b: Layout) -> bool:
    return a == b or (a.pp == 1 and b.pp == 1 and a == Layout(**{**vars(b), "schedule": a.schedule}))


def _option(work: Workload, layout: Layout, terms: FittedTerms, ranks_per_host: int, budget: float) -> Option:
    stages = memory_per_stage(work, layout, gloo=terms.shared)
    required = int(max(s.peak for s in stages) * (1 + FRAGMENTATION))
    return Option(layout, predict(work, layout, terms, ranks_per_host), required, required <= budget)


def _ranked(found) -> list[Option]:
    return sorted(found, key=lambda o: (not o.fits, round(o.step_s, 6), o.required_bytes))


def rank_layouts(work: Workload, world: int, micro_batch: int, terms: FittedTerms, ranks_per_host: int,
                 budget_bytes: int, margin: float, valid=lambda layout: True, with_cp: bool = False) -> list[Option]:
    """Every valid layout of ``world`` ranks at ``micro_batch`` (context-parallel degrees
    too ``with_cp``, or on sequences as long as the planner's search takes cp for),
    fitting ones first by predicted step (ties to the one needing less memory)."""
    with_cp = with_cp or work.seq_len >= CP_MIN_SEQ_LEN
    found = {}
    for layout in valid_layouts(work, world, ranks_per_host, {"micro_batch": micro_batch}, with_cp=with_cp):
        if layout not in found and valid(layout):
            found[layout] = _option(work, layout, terms, ranks_per_host, budget_bytes * (1 - margin))
    return _ranked(found.values())


def options(work: Workload, current: Layout, terms: FittedTerms, ranks_per_host: int, budget_bytes: int,
            margin: float, valid=lambda layout: True) -> list[Option]:
    """Every candidate (the current layout among them), fitting ones first by predicted
    step; other context-parallel degrees among them when the job runs one."""
    found = rank_layouts(work, current.world_size, current.micro_batch, terms, ranks_per_host, budget_bytes,
                         margin, valid, with_cp=current.cp > 1)
    if not any(_same(o.layout, current) for o in found):  # e.g. pp_layers set by hand
        mine = _option(work, current, terms, ranks_per_host, budget_bytes * (1 - margin))
        mine.fits = True  # it runs
        found = _ranked(found + [mine])
    return found


def _parts(option: Option, terms: FittedTerms) -> dict[str, float]:
    """Seconds per step of the option's bound, by what they are spent on."""
    stages = option.prediction.stages
    pick = (lambda xs: sum(xs) / len(xs)) if option.prediction.bound == "host cores" else max
    out = {"compute": pick([s.compute_s for s in stages])}
    for kind in ("tp", "pp", "dp"):  # dp: what the compute does not hide (fitted.dp_hidden_s)
        out[f"{kind} collectives"] = pick([max(0.0, terms.beta * s.counts.get(kind, 0.0)
                                               - (s.hidden_s if kind == "dp" else 0.0)) for s in stages])
    return out


def explain(options_: list[Option], chosen: Option, terms: FittedTerms, budget_bytes: int, margin: float) -> None:
    """Fill each option's ``why``: what it spends more on than the chosen one, or its memory."""
    best = _parts(chosen, terms)
    for o in options_:
        if o is chosen:
            o.why = "chosen"
        elif not o.fits:
            o.why = (f"does not fit: needs {o.required_bytes / GiB:.2f} GiB, budget "
                     f"{budget_bytes * (1 - margin) / GiB:.2f} GiB ({margin:.0%} margin kept)")
        else:
            mine = _parts(o, terms)
            worst = max(mine, key=lambda k: mine[k] - best[k])
            o.why = (f"{(o.step_s / chosen.step_s - 1) * 100:+.0f}%: {worst} "
                     f"{mine[worst] * 1e3:.1f} ms vs {best[worst] * 1e3:.1f} ms")


def decide(work: Workload, measured: Measured, terms: FittedTerms, *, ranks_per_host: int, budget_bytes: int,
           margin: float, min_gain: float, steps_left: int, switch_cost_s: float,
           valid=lambda layout: True) -> Decision:
    """Stay, or move to the fastest fitting layout (see the module docstring)."""
    current = measured.layout
    ranked = options(work, current, terms, ranks_per_host, budget_bytes, margin, valid)
    mine = next(o for o in ranked if _same(o.layout, current))
    best = next((o for o in ranked if o.fits), mine)
    gain = 1 - best.step_s / measured.step_s
    saved = (measured.step_s - best.step_s) * steps_left
    action, target = "stay", best
    if _same(best.layout, current):
        reason = "the current layout is predicted fastest"
    elif gain <= min_gain:
        reason = f"best other layout predicted {gain:.0%} faster, not more than autopilot.min_gain {min_gain:.0%}"
    elif saved <= switch_cost_s:
        reason = (f"{saved:.1f} s saved over the {steps_left} remaining steps does not pay the move "
                  f"(about {switch_cost_s:.1f} s)")
    else:
        action = "move"
        reason = (f"predicted {gain:.0%} faster; saves {saved:.1f} s over {steps_left} steps against a "
                  f"move of about {switch_cost_s:.1f} s")
    if action == "stay":
        target = mine
    explain(ranked, target, terms, budget_bytes, margin)
    return Decision(action, reason, current, target.layout, measured.step_s, mine.step_s, target.step_s,
                    1 - target.step_s / measured.step_s, switch_cost_s, steps_left, terms, ranked)


def judge_move(predicted_s: float, measured_s: float, tolerance: float, cores_before: float | None = None,
               cores_now: float | None = None) -> tuple[bool, float, float]:
    """(move back?, error at the load now, raw error) of a move whose new layout was
    predicted at ``predicted_s`` and measures ``measured_s``. With the cores a shared host
    gave the job before the move and gives it now, the prediction is scaled to the load
    now (a step is the ranks' work over those cores): a busier machine is not the
    layout's doing."""
    raw = measured_s / predicted_s - 1
    at_load = predicted_s * (cores_before / cores_now if cores_before and cores_now else 1.0)
    error = measured_s / at_load - 1
    return error > tolerance, error, raw
