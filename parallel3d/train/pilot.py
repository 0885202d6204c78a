"""``train.autopilot``: measure the running job, fit, decide, move, check the move.

The run goes in phases, each ``autopilot.skip_steps`` steps of warm-up then
``autopilot.measure_steps`` steps measured (medians of the complete step records)::

    measure   -> fit the terms (the compute probe, whose rounds run between chunks of the
                 measured steps, + the measured step), rank the layouts, stay (done) or
                 move (regroup.move) and verify
    verify    -> the new layout measured against its prediction (on a shared CPU host,
                 at the load measured now): within ``autopilot.tolerance`` the move is
                 confirmed; slower than that, the run moves back to the old layout,
                 once, and says so
    done      -> the rest of the steps

Every rank probes (a collective) and measures; rank 0 decides and broadcasts, so every
rank acts alike (each rank's own step times differ a little). Each decision is a
``{"event": "autopilot", ...}`` line in metrics.jsonl and a line on rank 0's console.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from parallel3d.autopilot.decide import Decision, decide, judge_move, with_layout
from parallel3d.autopilot.measure import host_cores, measure, ranks_per_host
from parallel3d.autopilot.probe import (ComputeProbe, probe_adam_seconds_per_element,
                                        probe_collective_seconds_per_byte)
from parallel3d.errors import UserError
from parallel3d.planner.fitted import fit_terms, stage_work_s
from parallel3d.planner.hardware import RUNTIME_RESERVE_BYTES
from parallel3d.planner.search import valid_layouts
from parallel3d.planner.spec import Layout, Workload
from parallel3d.train.rebalance import rank0_value, rebalance_to
from parallel3d.train.regroup import move
from parallel3d.train.setup import check_job

BETA_PRIOR_S = {"cpu": 5e-4, "cuda": 2e-5}  # a collective step before any was measured
PROBE_ROUNDS = 4  # compute probe rounds counted, spread over the measured steps


def workload(trainer) -> Workload:
    dtype = "bf16" if trainer.dtype == torch.bfloat16 else "fp32"
    t = trainer.cfg.train
    return Workload(trainer.model_cfg, t.seq_len, t.global_batch, dtype)


def memory_budget(cfg, device: torch.device, local_ranks: int) -> int:
    """Bytes a rank may hold: ``autopilot.memory_gib``, else the GPU's memory less the
    runtime reserve, else the host's memory over its local ranks less the same reserve."""
    if cfg.autopilot.memory_gib > 0:
        return int(cfg.autopilot.memory_gib * 2**30)
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory - RUNTIME_RESERVE_BYTES
    with open("/proc/meminfo") as f:
        total = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemTotal:"))
    return max(0, total // max(1, local_ranks) - RUNTIME_RESERVE_BYTES)


class Pilot:
    def __init__(self, trainer, make_trainer, build_s: float):
        self.make_trainer, self.build_s = make_trainer, build_s
        self.ap = trainer.cfg.autopilot
        self.phase = "measure"
        self.before: tuple[Layout, float] | None = None  # (layout, measured step) before a move
        self.predicted_s = 0.0
        self.decision: Decision | None = None

    def _valid(self, trainer):
        def valid(layout: Layout) -> bool:
            try:
                check_job(with_layout(trainer.cfg, layout), trainer.model_cfg, trainer.topo.world_size)
            except UserError:
                return False
            return True
        return valid

    def probe(self, trainer) -> ComputeProbe | None:
        """The compute probe of this phase (None when no decision is to be made)."""
        if self.phase != "measure":
            return None
        world, work = trainer.topo.world_size, workload(trainer)
        mb = trainer.cfg.train.micro_batch
        tps = sorted({layout.tp for layout in valid_layouts(work, world, ranks_per_host(world), {"micro_batch": mb})})
        return ComputeProbe(trainer.model_cfg, tps or [1], mb, work.seq_len, trainer.device, trainer.dtype)

    def _fit_and_decide(self, trainer, measured, probe: ComputeProbe) -> Decision:
        device, world = trainer.device, trainer.topo.world_size
        local = ranks_per_host(world)
        work = workload(trainer)
        group = trainer.topo.world_group
        compute = probe.result(group)
        psi = probe_collective_seconds_per_byte(device, group)
        adam = probe_adam_seconds_per_element(device)
        terms = fit_terms(work, measured, compute, shared=device.type == "cpu", cores=host_cores(),
                          threads=torch.get_num_threads(), ranks_per_host=local, psi=psi, adam=adam,
                          beta_prior=BETA_PRIOR_S.get(device.type, 2e-5))
        budget = memory_budget(trainer.cfg, device, local)
        steps_left = trainer.cfg.train.steps - trainer.step
        return decide(work, measured, terms, ranks_per_host=local, budget_bytes=budget,
                      margin=self.ap.memory_margin, min_gain=self.ap.min_gain, steps_left=steps_left,
                      switch_cost_s=self.ap.move_cost_s or self.build_s, valid=self._valid(trainer))

    def _say(self, trainer, event: dict, line: str) -> None:
        trainer.log_event(event)
        if trainer.topo.rank == 0:
            print(f"autopilot: {line}", flush=True)

    def step(self, trainer, window: list[dict], probe: ComputeProbe | None = None):
        """Act on a finished measurement window; returns the trainer to go on with."""
        measured = measure(window, Layout.from_config(trainer.cfg))
        if self.phase == "measure":
            decision = self._fit_and_decide(trainer, measured, probe)
            decision = rank0_value(trainer, decision)
            act = decision.action == "move" and self.ap.act
            event = decision.event(trainer.step)
            if decision.action == "move" and not self.ap.act:
                event["action"], event["reason"] = "stay", f"autopilot.act is false ({decision.reason})"
            self._say(trainer, event, f"step {trainer.step}: {event['action']} {decision.current.describe()} "
                      f"({decision.measured_s * 1e3:.0f} ms measured) -> {decision.target.describe()} "
                      f"({decision.predicted_s * 1e3:.0f} ms predicted): {event['reason']}")
            if not act:
                self.phase = "done"
                return trainer
            self.before, self.predicted_s = (decision.current, decision.measured_s), decision.predicted_s
            self.decision = decision
            self.phase = "verify"
            return self._move(trainer, decision.target, "move")
        # verify: the new layout against its prediction (rank 0's verdict: step times are
        # each rank's own, and ranks that disagreed on moving back would hang)
        event = rank0_value(trainer, self._verdict(trainer, measured))
        self._say(trainer, event, f"step {trainer.step}: {event['action']}: {event['reason']}")
        self.phase = "done"
        return self._move(trainer, self.before[0], "move back") if event["action"] == "move back" else trainer

    def _verdict(self, trainer, measured) -> dict:
        """Confirm the move, or move back: the new layout's measured step against its
        prediction. On a shared CPU host the prediction is taken at the load the job runs
        under now (scaled by the cores it got before the move over those it gets now): the
        other jobs on the machine are not the layout's doing, and judged on raw step times a
        busier machine would send every move back. The raw error is reported too."""
        diagnosis = self._diagnosis(trainer, measured)
        back, error, raw = judge_move(self.predicted_s, measured.step_s, self.ap.tolerance,
                                      diagnosis.get("cores_before"), diagnosis.get("cores_now"))
        at_load = measured.step_s / (1 + error)
        old_layout, old_step = self.before
        event = {"step": trainer.step, "event": "autopilot", "action": "move back" if back else "confirmed",
                 "from": measured.layout.describe(), "to": (old_layout if back else measured.layout).describe(),
                 "measured_step_s": measured.step_s, "predicted_step_s": self.predicted_s,
                 "prediction_error": raw, "predicted_at_load_s": at_load, "error_at_load": error,
                 "tolerance": self.ap.tolerance, "before_step_s": old_step,
                 "gain": 1 - measured.step_s / old_step, **diagnosis}
        load = (f"; at the load now ({diagnosis['cores_now']:.2f} cores against {diagnosis['cores_before']:.2f}) "
                f"{at_load * 1e3:.0f} ms, {error:+.0%}" if diagnosis else "")
        event["reason"] = (f"measured {measured.step_s * 1e3:.0f} ms against {self.predicted_s * 1e3:.0f} ms "
                           f"predicted ({raw:+.0%}{load}; stated error {self.ap.tolerance:.0%}); before the "
                           f"move {old_step * 1e3:.0f} ms")
        return event

    def _diagnosis(self, trainer, measured) -> dict:
        """Where a prediction missed: the CPU per rank and step it predicted against the
        measured one, and the cores the job got before the move and after (CPU ranks)."""
        terms = self.decision.terms
        if not terms.shared:
            return {}
        chosen = next(o for o in self.decision.options if o.layout == self.decision.target)
        stages = chosen.prediction.stages
        local = min(ranks_per_host(trainer.topo.world_size), trainer.topo.world_size)
        return {"predicted_cpu_s": sum(stage_work_s(s, terms) for s in stages) / len(stages),
                "measured_cpu_s": measured.cpu_s, "cores_before": terms.delivered(local * terms.threads),
                "cores_now": local * measured.cpu_s / measured.step_s}

    def _move(self, trainer, layout: Layout, what: str):
        new, seconds = move(trainer, layout, self.make_trainer)
        self._say(new, {"step": new.step, "event": "autopilot", "action": f"{what} done",
                        "to": layout.describe(), "move_s": seconds},
                  f"{what} to {layout.describe()} done in {seconds:.1f} s, resuming at step {new.step}")
        return new


def fit_with_autopilot(trainer, make_trainer, build_s: float) -> list[dict]:
    """Train to ``train.steps`` under the autopilot; returns every step's record.
    ``make_trainer(cfg, topo)`` builds a trainer (the move's); ``build_s``: how long the
    first one took to build (the move's cost is estimated from it)."""
    pilot = Pilot(trainer, make_trainer, build_s)
    ap, steps = trainer.cfg.autopilot, trainer.cfg.train.steps
    history: list[dict] = []
    pilot.phase = pilot.phase if ap.layouts else "done"
    while pilot.phase != "done":
        start = trainer.step
        end = start + ap.skip_steps + ap.measure_steps
        if end >= steps:
            break
        history += trainer.run_steps(start + ap.skip_steps)
        probe, after_probe = pilot.probe(trainer), set()
        for chunk_end in _chunks(start + ap.skip_steps, end, PROBE_ROUNDS):
            if probe is not None:  # a round between chunks: the probe sees the window's load
                probe.round()
                _together(trainer)  # or the next step would time the slowest rank's probe
                if chunk_end - trainer.step > 1:  # its first step left out: the probe evicted caches
                    after_probe.add(trainer.step + 1)
            history += trainer.run_steps(chunk_end)
        if probe is not None:
            probe.round()
        trainer.flush_records()  # the window's last record completes (collective)
        window = [r for r in history if start + ap.skip_steps < r["step"] <= end and r["step"] not in after_probe]
        trainer = pilot.step(trainer, window, probe)
    if ap.rebalance:  # then move layers off a slow pipeline stage (train/rebalance.py)
        trainer = rebalance_to(trainer, make_trainer, build_s, history)
    history += trainer.run_steps(steps)
    trainer.close()
    return history


def _together(trainer) -> None:
    """Every rank here before the next step starts (over the checkpointer's gloo group)."""
    if trainer.checkpointer.group is not None:
        dist.barrier(group=trainer.checkpointer.group)


def _chunks(start: int, end: int, n: int) -> list[int]:
    """The ends of ``n`` chunks of the steps ``start + 1 .. end`` (fewer if fewer steps)."""
    n = max(1, min(n, end - start))
    return sorted({start + round((end - start) * (i + 1) / n) for i in range(n)})


def timed_trainer(build):
    """``build()`` and how long it took."""
    t0 = time.perf_counter()
    trainer = build()
    return trainer, time.perf_counter() - t0
