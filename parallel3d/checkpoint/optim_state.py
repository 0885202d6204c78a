"""Optimizer state as slots of logical tensors, for every optimizer the trainer can build.

Each adapter says what its optimizer holds in the terms of :mod:`.state`: for parameter
``p`` (placement ``pl``), tensor ``t`` is the whole block of ``optim/exp_avg/<name>``, or
(sharded optimizers) a flat range of it. Loading asks the checkpoint for the same regions
at the new layout, whatever layout wrote them.
"""

from __future__ import annotations

import torch

from .errors import CheckpointError
from .state import Placement, Slot

MOMENTS = ("exp_avg", "exp_avg_sq")


def optimizer_slots(optimizer, placements: dict[int, Placement]) -> tuple[dict, list[Slot]]:
    """(JSON-able scalars, slots to save) of ``optimizer``."""
    if hasattr(optimizer, "parts"):  # dense and expert parts (parallel3d.zero.split): disjoint
        scalars, slots = None, []
        for part in optimizer.parts:
            scalars, more = optimizer_slots(part, placements)
            slots += more
        return scalars, slots
    if _is_zero(optimizer):
        return _zero_slots(optimizer, placements)
    raise CheckpointError(f"checkpoints do not know the optimizer {type(optimizer).__name__}")


def load_optimizer(optimizer, placements: dict[int, Placement], scalars: dict | None, source) -> bool:
    """Load the optimizer state from ``source`` (a reader); False if the checkpoint holds
    none (a weights-only checkpoint, e.g. converted from Hugging Face)."""
    if hasattr(optimizer, "parts"):
        return all([load_optimizer(part, placements, scalars, source) for part in optimizer.parts])
    if _is_zero(optimizer):
        return _zero_load(optimizer, placements, scalars or {}, source)
    raise CheckpointError(f"checkpoints do not know the optimizer {type(optimizer).__name__}")


def _has_moments(source, placements: list[Placement]) -> bool:
    present = [source.has(f"optim/{m}/{pl.name}") for pl in placements for m in MOMENTS]
    if present and not all(present) and any(present):
        missing = [f"optim/{m}/{pl.name}" for pl in placements for m in MOMENTS
                   if not source.has(f"optim/{m}/{pl.name}")]
        raise CheckpointError(f"{source.folder} holds optimizer state for some parameters but not "
                              f"{missing[:3]}{' ...' if len(missing) > 3 else ''}")
    return bool(present) and all(present)


# -- the flat-buffer optimizer (parallel3d.zero.ZeroOptimizer, every stage) ---------------------
# It packs this rank's parameters into buckets; at stages 1 and 2 dp rank r owns the range
# [r * N_b / dp, (r+1) * N_b / dp) of bucket b (stage 0: every rank the whole bucket): its
# fp32 masters ``masters[b]`` and the moments at ``shard_offsets()[b]`` of the flat Adam
# buffers. Each parameter segment inside that range is a flat range [a, c) of the
# parameter's (tensor-parallel) block: one slot.
def _is_zero(opt) -> bool:
    return all(hasattr(opt, a) for a in ("layout", "masters", "master_is_param", "step_count", "adam"))


def _zero_segments(opt, placements):
    """``(param, placement, bucket, lo, hi, a, c)``: shard range [lo, hi) of bucket b holds
    elements [a, c) of the flattened block of ``param``."""
    out = []
    for b, bucket in enumerate(opt.layout.buckets):
        s_lo, _ = bucket.shard_range(opt.shard_rank)
        for seg, lo, hi in bucket.shard_pieces(opt.shard_rank):
            p = opt.params[seg.index]
            a = s_lo + lo - seg.start
            out.append((p, placements[id(p)], b, lo, hi, a, a + hi - lo))
    return out


def _zero_moments(opt) -> dict[str, list[torch.Tensor]]:
    """Per bucket, this rank's moment shard (views, same coordinates as ``masters[b]``)."""
    adam = opt.adam
    if hasattr(adam, "exp_avg"):  # FlatAdamW: flat buffers over the buckets' shards
        offsets = opt.layout.shard_offsets()
        return {m: [getattr(adam, m)[o:o + master.numel()] for o, master in zip(offsets, opt.masters)]
                for m in MOMENTS}
    raise CheckpointError(f"checkpoints do not know the sharded optimizer's {type(adam).__name__} "
                          "(CPU-offloaded Adam state is not supported yet)")


def sharded_model_slots(optimizer, placements: dict[int, Placement], with_frozen: bool = True) -> list[Slot] | None:
    """ZeRO 3: the weights as this rank's flat shards of the parameter buckets, the same
    ranges as its masters (each dp rank writes its own, nothing gathered), and with
    ``with_frozen`` the frozen weights' shards (LoRA's base, ``zero/frozen.py``; without:
    the base is saved by reference); None when the optimizer keeps whole parameters (the
    caller saves them as blocks)."""
    parts = getattr(optimizer, "parts", (optimizer,))  # MoE: the dense and the expert part
    if not all(_is_zero(part) and getattr(part, "sharded", None) is not None for part in parts):
        return None
    if with_frozen:  # each part's frozen weights (LoRA at ZeRO 3), sharded as the part is
        parts = (*parts, *[f for p in parts for f in _frozen_parts(p)])
    return [Slot(f"model/{pl.name}", pl, part.param_shards[b][lo:hi], (a, c))
            for part in parts for p, pl, b, lo, hi, a, c in _zero_segments(part, placements)]


def _frozen_parts(part) -> list:
    """A part's frozen weights' shard holders (``zero/frozen.py``): none, its
    ``FrozenShards``, or the members of its ``FrozenGroups``."""
    frozen = getattr(part, "frozen", None)
    return [] if frozen is None else list(getattr(frozen, "members", [frozen]))


def _zero_slots(opt, placements):
    if getattr(opt, "sharded", None) is None:  # ZeRO 3 reads its shards: no gather to wait for
        opt.wait_for_params()
    moments = _zero_moments(opt) if opt.step_count > 0 else None
    slots = []
    for p, pl, b, lo, hi, a, c in _zero_segments(opt, placements):
        if not opt.master_is_param:
            slots.append(Slot(f"master/{pl.name}", pl, opt.masters[b][lo:hi], (a, c)))
        if moments is not None:
            for m in MOMENTS:
                slots.append(Slot(f"optim/{m}/{pl.name}", pl, moments[m][b][lo:hi], (a, c)))
    return {"kind": "adamw", "step": int(opt.step_count)}, slots


@torch.no_grad()
def _zero_load(opt, placements, scalars, source) -> bool:
    segments = _zero_segments(opt, placements)
    if not opt.master_is_param:  # full-precision masters, whatever dtype the params have
        for p, pl, b, lo, hi, a, c in segments:
            name = f"master/{pl.name}" if source.has(f"master/{pl.name}") else f"model/{pl.name}"
            if not source.has(name):  # LoRA adapters a base checkpoint lacks: masters taken from their init
                continue
            opt.masters[b][lo:hi].copy_(source.read_block_flat(name, pl.offsets, pl.block, a, c))
    if not _has_moments(source, [seg[1] for seg in segments]):
        return False
    moments = _zero_moments(opt)
    for p, pl, b, lo, hi, a, c in segments:
        for m in MOMENTS:
            moments[m][b][lo:hi].copy_(source.read_block_flat(f"optim/{m}/{pl.name}", pl.offsets, pl.block, a, c))
    opt.step_count = int(scalars.get("step", 0))
    return True
