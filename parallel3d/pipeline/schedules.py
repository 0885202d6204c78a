"""Pipeline schedules as plain data: for each rank, the order of its forwards and backwards.

A schedule is a function ``(pp, v, m, pp_rank) -> list of steps``; a step is a tuple of
:class:`Action` run back to back, and between two steps the rank exchanges activations and
gradients with its neighbours in one batch (see :func:`exchanges`). Keeping schedules as
data lets the same plan drive the real runtime (``runtime.py``) and the pure simulator
(``simulate.py``) that checks every plan for deadlock, message order and memory.

Notation: ``m`` micro-batches, ``pp`` stages, ``v`` chunks per stage (virtual stages).
Chunk ``c`` lives on rank ``c % pp`` (``partition.py``); the model is chunks ``0 .. pp*v-1``.

* ``gpipe``: every forward, then every backward (keeps all ``m`` micro-batches alive).
* ``1f1b``: warm-up forwards, then one forward / one backward, then the remaining
  backwards; stage ``r`` keeps at most ``pp - r`` micro-batches alive.
* ``interleaved``: 1F1B over ``v`` chunks per rank in the order of Narayanan et al. 2021
  (micro-batches in groups of ``pp``, each group through chunk 0, then chunk 1, ...);
  the bubble shrinks by ``v`` for ``v``-fold more point-to-point messages.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Action:
    op: str  # "F" forward or "B" backward
    chunk: int  # global chunk index
    mb: int  # micro-batch index

    def __str__(self) -> str:
        return f"{self.op}{self.chunk}.{self.mb}"


Step = tuple  # tuple[Action, ...]: actions run back to back between two exchanges


@dataclass(frozen=True)
class Message:
    """An activation (``act``: output of forward ``chunk``) or a gradient (``grad``: with
    respect to the input of ``chunk``) of micro-batch ``mb``, between pipeline ranks."""

    kind: str
    chunk: int
    mb: int
    src: int  # pp_rank that sends it
    dst: int  # pp_rank that receives it


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

SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b, "interleaved": interleaved}


def _own_chunks(pp: int, v: int, pp_rank: int) -> list[int]:
    return [pp_rank + j * pp for j in range(v)]


def plan(name: str, pp: int, v: int, m: int, pp_rank: int) -> list[Step]:
    """This rank's steps for one optimizer step of schedule ``name``."""
    return SCHEDULES[name](pp, v, m, pp_rank)


def inputs_of(a: Action, pp: int, n_chunks: int) -> list[Message]:
    """What ``a`` must receive before it runs."""
    if a.op == "F" and a.chunk > 0:
        return [Message("act", a.chunk - 1, a.mb, (a.chunk - 1) % pp, a.chunk % pp)]
    if a.op == "B" and a.chunk < n_chunks - 1:
        return [Message("grad", a.chunk + 1, a.mb, (a.chunk + 1) % pp, a.chunk % pp)]
    return []


def outputs_of(a: Action, pp: int, n_chunks: int) -> list[Message]:
    """What ``a`` sends once it has run."""
    if a.op == "F" and a.chunk < n_chunks - 1:
        return [Message("act", a.chunk, a.mb, a.chunk % pp, (a.chunk + 1) % pp)]
    if a.op == "B" and a.chunk > 0:
        return [Message("grad", a.chunk, a.mb, a.chunk % pp, (a.chunk - 1) % pp)]
    return []


def exchanges(steps: list[Step], pp: int, n_chunks: int) -> list[tuple[list[Message], list[Message]]]:
    """The (sends, receives) batches of a rank: ``len(steps) + 1`` of them.

    Batch 0 receives the inputs of step 0; batch ``i + 1`` sends the outputs of step ``i``
    and receives the inputs of step ``i + 1``. In 1F1B's steady state that is exactly
    "send forward, receive backward" after a forward and "send backward, receive forward"
    after a backward: one batched call per step instead of two.
    """
    batches = []
    for i in range(len(steps) + 1):
        sends = [msg for a in steps[i - 1] for msg in outputs_of(a, pp, n_chunks)] if i else []
        recvs = [msg for a in steps[i] for msg in inputs_of(a, pp, n_chunks)] if i < len(steps) else []
        batches.append((sends, recvs))
    return batches
