"""Pipeline schedules as plain data: for each rank, the order of its forwards and backwards.

A schedule is a function ``(pp, v, m, pp_rank) -> list of steps``; a step is a tuple of
:class:`~.actions.Action` run back to back, and between two steps the rank exchanges
activations and gradients with its neighbours in one batch (:func:`batches`). Keeping
schedules as data lets the same plan drive the real runtime (``runtime.py``) and the pure
simulator (``simulate.py``) that checks every plan for deadlock, message order and memory.

Notation: ``m`` micro-batches, ``pp`` stages, ``v`` chunks per stage (virtual stages); the
model is chunks ``0 .. pp*v-1``, placed by ``partition.chunk_owners`` (``c % pp``, or a V
for zb-v).

* ``gpipe``: every forward, then every backward (keeps all ``m`` micro-batches alive).
* ``1f1b``: warm-up forwards, then one forward / one backward, then the remaining
  backwards; stage ``r`` keeps at most ``pp - r`` micro-batches alive.
* ``interleaved``: 1F1B over ``v`` chunks per rank in the order of Narayanan et al. 2021
  (micro-batches in groups of ``pp``, each group through chunk 0, then chunk 1, ...);
  the bubble shrinks by ``v`` for ``v``-fold more point-to-point messages.
* ``zb-h1``, ``zb-v``: zero-bubble schedules, whose backward is split into B (input
  gradient) and W (weight gradient), W filling the bubble (``zero_bubble.py``).
"""

from __future__ import annotations

from functools import lru_cache

from .actions import Action, Batch, Message, Step, exchanges, inputs_of, outputs_of, slot_exchanges
from .partition import chunk_owners
from .zero_bubble import zb_h1, zb_v


def _F(chunk: int, mb: int) -> Action:
    return Action("F", chunk, mb)


def _B(chunk: int, mb: int) -> Action:
    return Action("B", chunk, mb)


# -- GPipe -------------------------------------------------------------------------------

def gpipe(pp: int, v: int, m: int, pp_rank: int) -> list[Step]:
    """All forwards, then all backwards (backwards in micro-batch order, as pp=1 does, so
    gradients accumulate in the same order)."""
    (chunk,) = _own_chunks(pp, v, pp_rank)
    return [(_F(chunk, i),) for i in range(m)] + [(_B(chunk, i),) for i in range(m)]


# -- 1F1B --------------------------------------------------------------------------------

def one_f_one_b(pp: int, v: int, m: int, pp_rank: int) -> list[Step]:
    """Warm-up, steady one-forward-one-backward, cool-down (PipeDream-Flush)."""
    (chunk,) = _own_chunks(pp, v, pp_rank)
    warmup = min(pp - pp_rank - 1, m)
    return (_1f1b_warmup(chunk, warmup) + _1f1b_steady(chunk, warmup, m)
            + _1f1b_cooldown(chunk, warmup, m))


def _1f1b_warmup(chunk: int, warmup: int) -> list[Step]:
    # Fill the pipeline: the stages after this one need these before a backward comes back.
    return [(_F(chunk, i),) for i in range(warmup)]


def _1f1b_steady(chunk: int, warmup: int, m: int) -> list[Step]:
    # Forward i+warmup, then the backward of the oldest live micro-batch i: the number
    # alive stays at warmup + 1 = pp - pp_rank.
    steps = []
    for i in range(m - warmup):
        steps += [(_F(chunk, i + warmup),), (_B(chunk, i),)]
    return steps


def _1f1b_cooldown(chunk: int, warmup: int, m: int) -> list[Step]:
    # Drain: the backwards of the warm-up micro-batches.
    return [(_B(chunk, i),) for i in range(m - warmup, m)]


# -- Interleaved 1F1B ---------------------------------------------------------------------

def interleaved(pp: int, v: int, m: int, pp_rank: int) -> list[Step]:
    """1F1B over ``v`` chunks per rank. The k-th forward of a rank runs micro-batch
    ``(k // (pp v)) pp + k % pp`` through its chunk ``(k // pp) % v``; backwards visit the
    chunks in reverse. Needs ``m % pp == 0``."""
    assert m % pp == 0 and v >= 1, (m, pp, v)
    total = v * m
    if m == pp:
        warmup = total  # too few micro-batches for a steady state: all forwards first
    else:
        # Enough forwards in flight that the backward of the first micro-batch of the
        # last chunk can start on the last stage (Narayanan et al. 2021).
        warmup = min(total, (pp - pp_rank - 1) * 2 + (v - 1) * pp)
    fwd = [_interleaved_action("F", k, pp, v, pp_rank) for k in range(total)]
    bwd = [_interleaved_action("B", k, pp, v, pp_rank) for k in range(total)]
    return (_interleaved_warmup(fwd, warmup) + _interleaved_steady(fwd, bwd, warmup)
            + _interleaved_cooldown(bwd, total - warmup))


def _interleaved_action(op: str, k: int, pp: int, v: int, pp_rank: int) -> Action:
    local = (k // pp) % v
    if op == "B":
        local = v - 1 - local
    mb = (k // (pp * v)) * pp + k % pp
    return Action(op, local * pp + pp_rank, mb)


def _interleaved_warmup(fwd: list[Action], warmup: int) -> list[Step]:
    return [(a,) for a in fwd[:warmup]]


def _interleaved_steady(fwd: list[Action], bwd: list[Action], warmup: int) -> list[Step]:
    # One step holds a forward and a backward, so one exchange carries the forward's
    # output, the backward's gradient, and the inputs of both next actions.
    return [(fwd[warmup + i], bwd[i]) for i in range(len(fwd) - warmup)]


def _interleaved_cooldown(bwd: list[Action], start: int) -> list[Step]:
    return [(a,) for a in bwd[start:]]


# -- Plans and the messages they imply -----------------------------------------------------

SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b, "interleaved": interleaved,
             "zb-h1": zb_h1, "zb-v": zb_v}
SPLIT_BACKWARD = ("zb-h1", "zb-v")  # schedules whose B is the input gradient, W the weights'
SLOT_ALIGNED = ("zb-v",)  # schedules whose batches follow the slot rule (actions.py)


def _own_chunks(pp: int, v: int, pp_rank: int) -> list[int]:
    return [pp_rank + j * pp for j in range(v)]


def owners(name: str, pp: int, v: int) -> list[int]:
    """The pipeline rank of every global chunk under schedule ``name``."""
    return chunk_owners(pp, v, name)


def plan(name: str, pp: int, v: int, m: int, pp_rank: int) -> list[Step]:
    """This rank's steps for one optimizer step of schedule ``name``."""
    return SCHEDULES[name](pp, v, m, pp_rank)


def batches(name: str, pp: int, v: int, m: int, pp_rank: int) -> list[Batch]:
    """This rank's exchange batches for :func:`plan`'s steps: ``len(steps) + 1`` of
    them, batch ``i`` posted before step ``i`` (the last after the last step)."""
    if name in SLOT_ALIGNED:
        return list(_slot_batches(name, pp, v, m)[pp_rank])
    return exchanges(plan(name, pp, v, m, pp_rank), owners(name, pp, v))


@lru_cache(maxsize=256)
def _slot_batches(name: str, pp: int, v: int, m: int) -> tuple:
    steps = [plan(name, pp, v, m, r) for r in range(pp)]
    return tuple(tuple(b) for b in slot_exchanges(steps, owners(name, pp, v)))


__all__ = ["Action", "Message", "Step", "SCHEDULES", "SPLIT_BACKWARD", "batches", "exchanges",
           "inputs_of", "outputs_of", "owners", "plan"]
