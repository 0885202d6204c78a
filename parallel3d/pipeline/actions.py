"""What pipeline plans are made of: actions, the messages they imply, the exchange batches.

A rank's plan is a list of steps; a step is a tuple of :class:`Action` run back to back;
before each step the rank exchanges activations and gradients with its neighbours in one
batch of sends and receives. ``owners[c]`` is the pipeline rank holding global chunk
``c`` (``partition.chunk_owners``). A message between two chunks of the same rank (the V
placement's turning point) is *local*: the runtime hands the tensor over directly and no
batch carries it.

Two rules say which messages a batch carries:

* :func:`exchanges` (gpipe, 1f1b, interleaved, zb-h1): batch ``i + 1`` sends the outputs of
  step ``i`` and receives the inputs of step ``i + 1``; in 1F1B's steady state exactly
  "send forward, receive backward" after a forward and the reverse after a backward.
* :func:`slot_exchanges` (zb-v): every rank's steps are time slots of one common clock
  (:func:`slot_align`: one action or none per slot, as the actions would run with equal
  costs), and a message is sent and received in the batch right after the slot that
  produced it, on both ranks, however much later it is used. Every rank's batch ``t``
  then pairs with its neighbours' batch ``t`` and nothing else, so no plan built this
  way can deadlock: all ranks post batch 0; once all have posted batch ``t`` each can
  complete it and post ``t + 1``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Action:
    """``op``: "F" forward; "B" backward (the input gradient only in schedules that
    split it, the whole backward otherwise); "W" the weight gradient of an earlier B."""

    op: str
    chunk: int  # global chunk index
    mb: int  # micro-batch index

    def __str__(self) -> str:
        return f"{self.op}{self.chunk}.{self.mb}"


Step = tuple  # tuple[Action, ...]: actions run back to back between two exchanges
Batch = tuple  # (sends: list[Message], receives: list[Message])


@dataclass(frozen=True)
class Message:
    """An activation (``act``: output of forward ``chunk``) or a gradient (``grad``: with
    respect to the input of ``chunk``) of micro-batch ``mb``, between pipeline ranks."""

    kind: str
    chunk: int
    mb: int
    src: int  # pp_rank that sends it
    dst: int  # pp_rank that receives it

    @property
    def local(self) -> bool:
        return self.src == self.dst


def inputs_of(a: Action, owners: list[int]) -> list[Message]:
    """What ``a`` must have received before it runs (W needs nothing)."""
    last = len(owners) - 1
    if a.op == "F" and a.chunk > 0:
        return [Message("act", a.chunk - 1, a.mb, owners[a.chunk - 1], owners[a.chunk])]
    if a.op == "B" and a.chunk < last:
        return [Message("grad", a.chunk + 1, a.mb, owners[a.chunk + 1], owners[a.chunk])]
    return []


def outputs_of(a: Action, owners: list[int]) -> list[Message]:
    """What ``a`` sends once it has run."""
    last = len(owners) - 1
    if a.op == "F" and a.chunk < last:
        return [Message("act", a.chunk, a.mb, owners[a.chunk], owners[a.chunk + 1])]
    if a.op == "B" and a.chunk > 0:
        return [Message("grad", a.chunk, a.mb, owners[a.chunk], owners[a.chunk - 1])]
    return []


def undivided_backwards(steps: list[Step]) -> frozenset[tuple[int, int]]:
    """The (chunk, micro-batch) pairs whose backward a split plan runs undivided, in its
    B: the first chunk's. Nothing waits for that chunk's input gradient (its input is
    token ids), so splitting its backward buys no time and costs the split itself (the
    layer inputs and output gradients read twice, the records and their replay, its
    layers' own autograd functions: ``parallelize_llama`` leaves them out). Its W then
    has nothing left to do.

    Moving the W's work into its B changes no timeline under the runtime's rule on gloo
    (a batch's sends waited one batch later). Under NCCL's (waiting for a batch waits for
    its sends) a batch between the B and the W is posted a W later, which delays zb-v's
    neighbours only where W costs more than B (``simulate`` plays both; tests)."""
    return frozenset((a.chunk, a.mb) for step in steps for a in step if a.op == "B" and a.chunk == 0)


def _remote(messages: list[Message]) -> list[Message]:
    return [m for m in messages if not m.local]


def exchanges(steps: list[Step], owners: list[int]) -> list[Batch]:
    """The (sends, receives) batches of a rank, ``len(steps) + 1`` of them: batch 0
    receives the inputs of step 0; batch ``i + 1`` sends the outputs of step ``i`` and
    receives the inputs of step ``i + 1``."""
    batches = []
    for i in range(len(steps) + 1):
        sends = _remote([msg for a in steps[i - 1] for msg in outputs_of(a, owners)]) if i else []
        recvs = _remote([msg for a in steps[i] for msg in inputs_of(a, owners)]) if i < len(steps) else []
        batches.append((sends, recvs))
    return batches


def _dependencies(a: Action, n_chunks: int) -> list[tuple[str, int, int]]:
    """The actions ``a`` waits for, as (op, chunk, mb)."""
    if a.op == "F":
        return [("F", a.chunk - 1, a.mb)] if a.chunk > 0 else []
    if a.op == "B":
        return [("F", a.chunk, a.mb)] + ([("B", a.chunk + 1, a.mb)] if a.chunk < n_chunks - 1 else [])
    return [("B", a.chunk, a.mb)]


def slot_align(orders: list[list[Action]], n_chunks: int) -> list[list[Step]]:
    """Every rank's ``orders`` placed on one clock of equal-cost slots: each action in the
    first slot after its rank's previous action and after the slots of the actions it
    depends on. Returns each rank's steps, one per slot (``()``: idle), all of one length.
    Raises ``ValueError`` if the orders wait on each other in a cycle."""
    slot: dict[tuple[str, int, int], int] = {}
    pos, free = [0] * len(orders), [0] * len(orders)
    left = sum(map(len, orders))
    while left:
        moved = False
        for r, order in enumerate(orders):
            while pos[r] < len(order):
                a = order[pos[r]]
                deps = _dependencies(a, n_chunks)
                if not all(d in slot for d in deps):
                    break
                t = max([free[r]] + [slot[d] + 1 for d in deps])
                slot[(a.op, a.chunk, a.mb)], free[r] = t, t + 1
                pos[r], left, moved = pos[r] + 1, left - 1, True
        if not moved:
            raise ValueError(f"the orders wait on each other: ranks at {pos}")
    steps: list[list[Step]] = [[()] * max(free) for _ in orders]
    for r, order in enumerate(orders):
        for a in order:
            steps[r][slot[(a.op, a.chunk, a.mb)]] = (a,)
    return steps


def slot_exchanges(all_steps: list[list[Step]], owners: list[int]) -> list[list[Batch]]:
    """Each rank's batches under the slot rule (module docstring): batch ``t + 1`` of both
    ranks carries every message produced in slot ``t``."""
    n = len(all_steps[0])
    batches = [[([], []) for _ in range(n + 1)] for _ in all_steps]
    for steps in all_steps:
        for t, step in enumerate(steps):
            for msg in _remote([m for a in step for m in outputs_of(a, owners)]):
                batches[msg.src][t + 1][0].append(msg)
                batches[msg.dst][t + 1][1].append(msg)
    return batches
