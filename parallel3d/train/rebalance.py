"""``autopilot.rebalance``: move layers off a persistently slow pipeline stage, inside the
running processes (the decision: :mod:`parallel3d.autopilot.balance`).

Every ``autopilot.skip_steps + autopilot.measure_steps`` steps the job judges the straggler
checks (``observability.straggler_interval``: every rank's mean busy time, the rows of
``ranks.jsonl``) of its current split, all of them but those of the split's first
``skip_steps`` (the medians steady as the run goes on, so that the load's noise does not
move the layers back and forth): rank 0 reads them, decides, and broadcasts, so every rank
acts alike. A rebalance is a move to the same
layout with another ``parallel.pp_layers`` (:func:`parallel3d.train.regroup.move`: a
checkpoint, the new stages built, the checkpoint read back), which computes the same
numbers as before: every split is the same model. With ``autopilot.act = false`` the
decisions are logged and never carried out. The window after a move checks it: a
step slower than before the move moves the layers back, once, and rebalancing stops.
Each decision is a ``{"event": "autopilot", "kind": "rebalance", ...}`` line in
metrics.jsonl, a line on rank 0's console and in ``parallel3d report``.
"""

from __future__ import annotations

import json
import statistics

import torch.distributed as dist

from parallel3d.autopilot.balance import decide_rebalance, stage_busy
from parallel3d.models import model_family
from parallel3d.planner.spec import Layout, layer_split
from parallel3d.train.regroup import move


def rank0_value(trainer, value):
    """Rank 0's ``value`` on every rank (over the checkpointer's gloo group): the
    decisions of the rebalance and of the pilot."""
    group = trainer.checkpointer.group
    if group is None:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


def can_rebalance(cfg) -> str:
    """Why the job cannot be rebalanced ("" when it can)."""
    par = cfg.parallel
    if par.pp < 2:
        return "pp 1: no stages"
    if par.virtual_stages != 1 or par.schedule in ("interleaved", "zb-v"):
        return f"{par.schedule} with {par.virtual_stages} chunks per rank (only one chunk per rank is rebalanced)"
    if cfg.observability.straggler_interval <= 0:
        return "observability.straggler_interval is 0: no per-rank rows"
    return ""


def _tables(trainer, after: int, end: int) -> list[dict]:
    """Rank 0: the straggler checks of steps ``after + 1 .. end`` (``ranks.jsonl``)."""
    path = trainer.metrics.path.parent / "ranks.jsonl"
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return [t for t in rows if after < t["step"] <= end]


def _decide(trainer, window: list[dict], tables: list[dict], switch_cost_s: float):
    cfg, par = trainer.cfg, trainer.cfg.parallel
    if not tables or not window:
        return None
    split = layer_split(trainer.model_cfg, par.pp, 1, par.pp_layers, par.schedule)
    embed, head = model_family(cfg.model.family).stage_costs(trainer.model_cfg)
    decision = decide_rebalance(
        stage_busy(tables, par.pp), split, embed_cost=embed, head_cost=head,
        microbatches=cfg.train.global_batch // (cfg.train.micro_batch * par.dp),
        measured_s=statistics.median(r["step_time_s"] for r in window), min_gain=cfg.autopilot.min_gain,
        steps_left=cfg.train.steps - trainer.step, switch_cost_s=switch_cost_s)
    decision.checks = [t["step"] for t in tables]
    return decision


def _say(trainer, event: dict, line: str) -> None:
    trainer.log_event(event)
    if trainer.topo.rank == 0:
        print(f"autopilot: {line}", flush=True)


def _move(trainer, make_trainer, split: list[int], what: str):
    new, seconds = move(trainer, Layout.from_config(trainer.cfg), make_trainer, pp_layers=split)
    _say(new, {"step": new.step, "event": "autopilot", "kind": "rebalance", "action": f"{what} done",
               "to": f"pp_layers {split}", "move_s": seconds},
         f"{what} to pp_layers {split} done in {seconds:.1f} s, resuming at step {new.step}")
    return new


def _verdict(trainer, before_s: float, old_split: list[int], window: list[dict]) -> dict:
    measured = statistics.median(r["step_time_s"] for r in window)
    back = measured >= before_s
    return {"step": trainer.step, "event": "autopilot", "kind": "rebalance",
            "action": "move back" if back else "confirmed", "measured_step_s": measured,
            "before_step_s": before_s, "gain": 1 - measured / before_s, "to": f"pp_layers {old_split}" if back else "",
            "reason": f"measured {measured * 1e3:.0f} ms against {before_s * 1e3:.0f} ms before the rebalance "
                      f"({1 - measured / before_s:+.0%})"}


def rebalance_to(trainer, make_trainer, build_s: float, history: list[dict]):
    """Train to ``train.steps``, rebalancing the stages as the module docstring says;
    appends every step's record to ``history`` and returns the trainer the run ends on."""
    cfg, ap, steps = trainer.cfg, trainer.cfg.autopilot, trainer.cfg.train.steps
    why_not = can_rebalance(cfg)
    if why_not and cfg.parallel.pp > 1:
        _say(trainer, {"step": trainer.step, "event": "autopilot", "kind": "rebalance", "action": "off",
                       "reason": why_not}, f"no rebalancing: {why_not}")
    pending = None  # (measured step before a move, the split moved from)
    since = trainer.step  # the current split runs since this step
    while not why_not:
        start = trainer.step
        end = start + ap.skip_steps + ap.measure_steps
        if end >= steps:
            break
        history += trainer.run_steps(end)
        trainer.flush_records()  # the window's records and straggler rows are written
        window = [r for r in history if start + ap.skip_steps < r["step"] <= end and not r.get("skipped")]
        if pending is not None:
            event = rank0_value(trainer, _verdict(trainer, *pending, window))
            _say(trainer, event, f"step {trainer.step}: {event['action']}: {event['reason']}")
            if event["action"] == "move back":
                trainer = _move(trainer, make_trainer, pending[1], "move back")
                break
            pending = None
            continue
        decision = None
        if trainer.metrics is not None:
            decision = _decide(trainer, window, _tables(trainer, since + ap.skip_steps, end),
                               ap.move_cost_s or build_s)
        decision = rank0_value(trainer, decision)
        if decision is None:
            continue
        event = decision.event(trainer.step)
        if decision.action == "rebalance" and not ap.act:
            event["action"], event["reason"] = "stay", f"autopilot.act is false ({decision.reason})"
        _say(trainer, event, f"step {trainer.step}: {event['action']}: {event['reason']}")
        if event["action"] == "rebalance":
            pending, since = (decision.measured_s, decision.split), end
            trainer = _move(trainer, make_trainer, decision.target, "move")
    history += trainer.run_steps(steps)
    return trainer
