"""Move a running job to another layout inside its processes: no relaunch.

The move is a resume at another layout, which is exact (every layout trains identically
from the same weights, and checkpoints reshard to any layout)::

    1. complete and write the step records; save a checkpoint of this step at the old
       layout (atomic: until its ``latest`` is written, the previous checkpoint stands)
    2. let go of the old trainer's data loader, metrics file and progress bar, then of
       its state (model, optimizer buffers, schedule): the new trainer allocates into the
       memory they held, and the move's peak is one trainer's, not two
    3. build the new topology: every group of more than one rank of the new layout
       (``new_group`` is collective over the world: every rank creates every group, in
       the same order; an axis of degree 1 has none)
    4. build the new trainer on it, resuming from the checkpoint of step 1: model,
       optimizer state, LR schedule and data position, each rank reading its own slices
    5. destroy the old layout's groups

The world, the global batch and every rank's process stay; the step count continues;
metrics.jsonl continues in the same file. A failure after step 1 leaves the run
resumable from that checkpoint, at the old layout, by starting it again (with torchrun's
``--max-restarts`` that is automatic); a failure inside step 1 leaves the previous one.
"""

from __future__ import annotations

import gc
import time

import torch.distributed as dist

from parallel3d.autopilot.decide import with_layout
from parallel3d.checkpoint.reader import read_latest
from parallel3d.planner.spec import Layout
from parallel3d.topology import Topology


def save_for_move(trainer) -> str:
    """Checkpoint this step at the current layout (unless it already is); its folder."""
    trainer.flush_records()
    ckpt = trainer.checkpointer
    trainer.watch.pause("checkpoint save")
    if ckpt._last_saved != trainer.step:
        ckpt.save(trainer)
    ckpt.writer.wait()
    latest = read_latest(ckpt.root)
    if latest is None or not latest.name.endswith(f"{trainer.step:08d}"):
        raise RuntimeError(f"the checkpoint of step {trainer.step} for the move is not in {ckpt.root}")
    return str(latest)


# what holds a trainer's tensors and threads (its watch, config and topology stay)
TRAINER_STATE = ("model", "loss_fn", "optimizer", "schedule", "data", "sampler", "checkpointer",
                 "observer", "timeline", "step_hooks", "on_stop", "records")


def release_state(trainer) -> None:
    """After ``trainer.release()``, let go of its model, optimizer (masters, moments, flat
    and gradient buffers), schedule and data loader, so that the trainer built next
    allocates into the memory they held: the caller may keep the object (the autopilot's
    loop does, until the move returns), but nothing reachable from it holds a tensor."""
    if hasattr(trainer, "optimizer"):
        trainer.optimizer.release()  # its tensor hooks, which the cycle collector cannot see
    for name in TRAINER_STATE:
        if hasattr(trainer, name):
            delattr(trainer, name)
    gc.collect()  # modules, hooks and the optimizer reference each other in cycles


def new_topology(layout: Layout, old: Topology) -> Topology:
    """The groups of ``layout`` over the same world (collective on every rank)."""
    return Topology.of(layout, timeout_s=old.timeout_s)


def _destroy_groups(topo: Topology, extra=()) -> None:
    if not dist.is_initialized():
        return
    seen = set()
    for group in [getattr(topo, f"{a}_group") for a in ("tp", "dp", "pp", "mp", "embed")] + list(extra):
        if group is None or group is dist.group.WORLD or id(group) in seen:  # None: axis off
            continue
        seen.add(id(group))
        dist.destroy_process_group(group)


def move(trainer, layout: Layout, make_trainer, pp_layers: list[int] | None = None):
    """The trainer of ``layout`` (its layers split as ``pp_layers``; None: the balanced
    rule) continuing ``trainer``'s run (see the module docstring); ``make_trainer(cfg,
    topo)`` builds one. Returns (new trainer, seconds the move took)."""
    started = time.perf_counter()
    folder = save_for_move(trainer)
    cfg = with_layout(trainer.cfg, layout, pp_layers)
    cfg.checkpoint.resume = folder
    old_topo, old_groups = trainer.topo, [trainer.checkpointer.group]
    trainer.release()
    release_state(trainer)
    topo = new_topology(layout, old_topo)
    trainer.watch.topo = topo  # reports name the new groups
    new = make_trainer(cfg, topo)
    _destroy_groups(old_topo, old_groups)
    return new, time.perf_counter() - started
