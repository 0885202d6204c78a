"""Zero-bubble schedules (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024).

Each backward is split into B, the input gradient the previous stage is waiting for, and
W, the weight gradient nothing waits for until the optimizer step. Putting W where a
stage would otherwise wait fills the bubble. Notation as in ``schedules.py``: ``pp``
ranks, ``m`` micro-batches, per-chunk costs F, B, W; the figures are for F = B = W.

* ``zb-h1``: 1F1B's order of forwards and B's on one chunk per rank; rank ``r`` keeps
  ``r`` W's pending through the steady state and spends them in the cool-down, where 1F1B
  waits. Bubble ``(pp - 1) / (3 m + pp - 1)`` of the step, a third of 1F1B's (1F1B's
  backward is B + W). Activations alive from F to B: ``min(pp - r, m)`` on rank ``r``,
  1F1B's; counting those waiting for their W: ``min(pp, m)`` on every rank, which 1F1B
  has on the first.
* ``zb-v``: two chunks per rank in a V (``partition.chunk_owners``): rank ``r`` holds
  chunk ``a = r`` on the way down and ``b = 2 pp - 1 - r`` on the way back, so the
  first and the last chunk (embedding, head and loss) share rank 0 and rank ``pp - 1``
  turns the activation round itself. Bubble ``(pp - 1) / (6 m + pp - 1)`` for
  ``m >= 2 pp - 1``, half of zb-h1's; ``2 pp`` chunk-micro-batches alive on every rank
  (each chunk half a stage: 1F1B's first-stage memory, on every rank).

Both are written as warm-up, steady state and cool-down over per-rank orders, and their
exchange batches come from the rules in ``actions.py``: zb-h1's steps group a W with the
action after it, so that the W runs while that action's input is in flight (the runtime
waits for a batch only before the first action that reads from it); zb-v's orders are
placed on the common clock of :func:`~.actions.slot_align`.
"""

from __future__ import annotations

from functools import lru_cache

from .actions import Action, Step, slot_align


# -- ZB-H1 -------------------------------------------------------------------------------------

def zb_h1(pp: int, v: int, m: int, pp_rank: int) -> list[Step]:
    """1F1B's warm-up; steady (W?, F), (B); cool-down (W?, B); the remaining W's. A W
    joins the step after its B once more than ``pp_rank`` W's are pending (steady state)
    or whenever one is (cool-down), so it runs while that step's input travels."""
    assert v == 1, v
    chunk, warmup = pp_rank, min(pp - pp_rank - 1, m)
    steps: list[Step] = [(Action("F", chunk, i),) for i in range(warmup)]
    pending: list[Action] = []  # W's whose B has run, oldest first

    def lead(keep: int) -> tuple:
        return (pending.pop(0),) if len(pending) > keep else ()

    for i in range(m - warmup):  # steady state
        steps.append(lead(pp_rank) + (Action("F", chunk, i + warmup),))
        steps.append((Action("B", chunk, i),))
        pending.append(Action("W", chunk, i))
    for i in range(m - warmup, m):  # cool-down
        steps.append(lead(0) + (Action("B", chunk, i),))
        pending.append(Action("W", chunk, i))
    return steps + [tuple(pending)]


# -- ZB-V --------------------------------------------------------------------------------------

def zb_v(pp: int, v: int, m: int, pp_rank: int) -> list[Step]:
    """This rank's slots of the V schedule (one action or none per slot)."""
    assert v == 2, v
    return list(_zb_v_slots(pp, m)[pp_rank])


@lru_cache(maxsize=256)
def _zb_v_slots(pp: int, m: int) -> tuple:
    orders = [zb_v_order(pp, m, r) for r in range(pp)]
    return tuple(tuple(steps) for steps in slot_align(orders, 2 * pp))


def zb_v_order(pp: int, m: int, pp_rank: int) -> list[Action]:
    """Rank ``r``'s order of actions on its chunks ``a = r`` and ``b = 2 pp - 1 - r``.

    With equal costs the first forward reaches rank ``r`` at slot ``r`` on chunk ``a`` and
    at slot ``2 pp - 1 - r`` on chunk ``b``; its first B reaches chunk ``b`` at slot
    ``2 pp + r``. The warm-up fills those gaps: ``2 (pp - r) - 1`` forwards of ``a``
    before the first of ``b``, then ``r`` pairs (F_b, F_a), then ``pp - r`` triples
    (F_b, B_b, W_b) as the first gradients come back. The steady state runs
    (F_a, B_a, W_a, F_b, B_b, W_b) per micro-batch, six actions on six slots; the
    cool-down ``r`` pairs (B_a, B_b) and ``pp - r`` pairs (B_a, W_a), then the W's left.

    The warm-up needs ``2 pp - 1`` micro-batches on rank 0; with fewer the order is that
    of ``2 pp - 1`` with the actions of the missing micro-batches left out (every action
    depends only on actions of its own micro-batch, so the rest still runs in order)."""
    n = max(m, 2 * pp - 1)
    chunk = {"a": pp_rank, "b": 2 * pp - 1 - pp_rank}
    done = {(op, leg): 0 for op in "FBW" for leg in "ab"}
    order: list[Action] = []

    def run(*names: str) -> None:
        for name in names:
            op, leg = name
            order.append(Action(op, chunk[leg], done[(op, leg)]))
            done[(op, leg)] += 1

    r = pp_rank
    run(*["Fa"] * (2 * (pp - r) - 1))  # warm-up
    for _ in range(r):
        run("Fb", "Fa")
    for _ in range(pp - r):
        run("Fb", "Bb", "Wb")
    while done[("F", "b")] < n:  # steady state
        if done[("F", "a")] < n:
            run("Fa")
        run("Ba", "Wa", "Fb", "Bb", "Wb")
    for _ in range(r):  # cool-down
        run("Ba", "Bb")
    for _ in range(pp - r):
        run("Ba", "Wa")
    run(*["Wb"] * (n - done[("W", "b")]), *["Wa"] * (n - done[("W", "a")]))
    assert all(count == n for count in done.values()), done
    return [a for a in order if a.mb < m]
