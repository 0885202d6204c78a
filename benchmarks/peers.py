"""One training run of each side, executed on every rank of a gloo/NCCL pool: here the
helpers every side shares and parallel3d's own side; the DeepSpeed runners are in
``peers_deepspeed``, torch's own in ``peers_torch``.

Each ``run_*`` builds its side from ``_common.initial_model`` (the trainer's weights),
feeds it ``_common.GlobalBatches`` (ours: the trainer's own sampler, the same batches)
and returns a :class:`_common.Run` for this rank: the time of every optimizer step
(forward, backward, gradient sync, clipping, update), the step's loss (mean over the
global batch, the same on every rank) and peak memory.
"""

from __future__ import annotations

import torch

from _common import PeakMemory, Run, job, step_peak, timed

DEVICE = torch.device("cpu")


def _device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return DEVICE


def _time_steps(run: Run, step, steps: int, device: torch.device, mem=None) -> None:
    """Run ``step(s)`` (a whole optimizer step returning the step's loss) for every step,
    recording its time and loss in ``run`` (and, metered, each step's peak above what was
    allocated at its start: ``run.extra["step_peak"]``)."""
    for s in range(steps):
        with step_peak(run, mem):
            dt, loss = timed(lambda: step(s), device)
        run.times.append(dt)
        run.losses.append(float(loss))


# -- parallel3d ------------------------------------------------------------------------------

def run_ours(layout: dict, steps: int, memory_run: bool = False, **job_kw) -> Run:
    """Our Trainer, end to end (its own sampler, schedule and optimizer)."""
    from parallel3d.observe.stats import step_breakdown
    from parallel3d.topology import Topology
    from parallel3d.train.trainer import Trainer

    cfg = job(layout, steps, **job_kw)
    device = _device()
    run = Run()
    with PeakMemory(device, tensors=memory_run) as mem:
        trainer = Trainer(cfg, Topology(cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.dp),
                          device, log=False)
        records = []
        for _ in range(steps):
            with step_peak(run, mem):
                dt, record = timed(trainer.train_step, device)
            records.append(record)
            run.times.append(dt)
            run.losses.append(record["loss"])
            spans = trainer.schedule.timeline.step_spans()
            run.extra.setdefault("breakdown", []).append({**step_breakdown(spans, dt), "step": dt})
            if cfg.parallel.pp > 1:  # from the end of this rank's last backward (B or W)
                run.extra.setdefault("tail", []).append(
                    dt - max(t1 for cat, _, t1 in spans if cat in ("backward", "weight")))
        trainer.finish_records()  # the last step's per-rank figures (the bubble), untimed
        run.extra["bubble_fraction"] = [r["bubble_fraction"] for r in records]
    run.peak = mem.peak
    return run


def run_ours_as(layout: dict, steps: int, as_layout: dict, memory_run: bool = False, **job_kw) -> Run:
    """Our Trainer at ``as_layout`` instead of the row's layout: a row's own reference
    (the zero-bubble rows' 1F1B on the same stages and batches)."""
    return run_ours(as_layout, steps, memory_run=memory_run, **job_kw)
