"""Optimizer state as slots of logical tensors, for every optimizer the trainer can build.

Each adapter says what its optimizer holds in the terms of :mod:`.state`: for parameter
``p`` (placement ``pl``), tensor ``t`` is the whole block of ``optim/exp_avg/<name>``, or
(sharded optimizers) a flat range of it. Loading asks the checkpoint for the same regions
at the new layout, whatever layout wrote them.
"""

from __future__ import annotations

import torch

from .errors import CheckpointError
from .state import Placement, Slot, read_block

MOMENTS = ("exp_avg", "exp_avg_sq")


def optimizer_slots(optimizer, placements: dict[int, Placement]) -> tuple[dict, list[Slot]]:
    """(JSON-able scalars, slots to save) of ``optimizer``."""
    inner = getattr(optimizer, "inner", None)
    if isinstance(inner, torch.optim.AdamW):
        return _adamw_slots(optimizer, placements)
    raise CheckpointError(f"checkpoints do not know the optimizer {type(optimizer).__name__}")


def load_optimizer(optimizer, placements: dict[int, Placement], scalars: dict | None, source) -> bool:
    """Load the optimizer state from ``source`` (a reader); False if the checkpoint holds
    none (a weights-only checkpoint, e.g. converted from Hugging Face)."""
    inner = getattr(optimizer, "inner", None)
    if isinstance(inner, torch.optim.AdamW):
        return _adamw_load(optimizer, placements, scalars or {}, source)
    raise CheckpointError(f"checkpoints do not know the optimizer {type(optimizer).__name__}")


def _has_moments(source, placements: list[Placement]) -> bool:
    present = [source.has(f"optim/{m}/{pl.name}") for pl in placements for m in MOMENTS]
    if present and not all(present) and any(present):
        missing = [f"optim/{m}/{pl.name}" for pl in placements for m in MOMENTS
                   if not source.has(f"optim/{m}/{pl.name}")]
        raise CheckpointError(f"{source.folder} holds optimizer state for some parameters but not "
                              f"{missing[:3]}{' ...' if len(missing) > 3 else ''}")
    return bool(present) and all(present)


# -- torch AdamW over whole (TP-local) parameters: DataParallelOptimizer -------------------------
def _adamw_slots(opt, placements):
    steps, slots = set(), []
    for p in opt.params:
        st = opt.inner.state.get(p)
        if not st:
            continue
        pl = placements[id(p)]
        steps.add(int(st["step"]))
        for m in MOMENTS:
            slots.append(Slot(f"optim/{m}/{pl.name}", pl, st[m]))
    if len(steps) > 1:
        raise CheckpointError(f"AdamW parameters are at different steps {sorted(steps)}")
    return {"kind": "adamw", "step": steps.pop() if steps else 0}, slots


@torch.no_grad()
def _adamw_load(opt, placements, scalars, source) -> bool:
    pls = [placements[id(p)] for p in opt.params]
    if not _has_moments(source, pls):
        return False
    step = int(scalars.get("step", 0))
    for p, pl in zip(opt.params, pls):
        state = {"step": torch.tensor(float(step), dtype=torch.float32)}
        for m in MOMENTS:
            state[m] = read_block(source, f"optim/{m}/{pl.name}", pl, p.dtype, p.device)
        opt.inner.state[p] = state
    return True
